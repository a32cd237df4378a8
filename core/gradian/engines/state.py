"""Fitted engine states, stored beside the gradient index they were fitted on.

Interface: ``fit_engine(name, train, config, context, cache_dir) -> EngineState`` fits the engine
``name`` on ``train`` (a ``GradientIndex`` or in-memory gradients), or loads the state fitted
before from ``<cache_dir>/engines/<state_id>/``; ``state_id(index_id, engine, settings)``.

The id covers the index id (every input of the stored gradients), the engine's name and the
settings its fit depends on (``Engine.settings``), so a state is reused exactly when the same fit
would be repeated. Settings applied only at scoring time (the damping) are not in it. A state
directory holds ``state.json`` (identity, meta, the sha256 of ``arrays.npz`` and a checksum of
itself) and ``arrays.npz``; it is written under a temporary name and renamed into place, so it
exists whole or not at all, and a state whose bytes no longer match is fitted again, never used.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from gradian.engines.base import EngineState, FitContext, TrainGradients
from gradian.engines.registry import get_engine

if TYPE_CHECKING:
    from gradian.config import EngineConfig

__all__ = ["fit_engine", "state_id", "STATE_FORMAT_VERSION"]

STATE_FORMAT_VERSION = 1


def state_id(index_id: str, engine: str, settings: Mapping[str, object]) -> str:
    canonical = json.dumps({"format": STATE_FORMAT_VERSION, "index_id": index_id, "engine": engine,
                            "settings": settings}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


def fit_engine(name: str, train: TrainGradients, config: EngineConfig, context: FitContext | None = None,
               cache_dir: str | Path | None = None) -> EngineState:
    """The fitted state of engine ``name`` on ``train``: from the cache when it was fitted before.

    A stored state whose files do not match the checksums recorded when it was written (a flipped
    byte, numbers rewritten, a file cut short) is never used: it is fitted again and stored over
    the damaged one, ``EngineState.repaired`` says what was wrong, and ``context.log`` says so.
    """
    engine = get_engine(name)
    index_id = getattr(train, "index_id", None)
    settings = engine.settings(config)
    root = None
    repaired = None
    if engine.persists(settings) and index_id and cache_dir is not None:
        sid = state_id(index_id, name, settings)
        root = Path(cache_dir) / "engines" / sid
        loaded, repaired = _load(root, name, train, sid)
        if loaded is not None:
            return loaded
        if repaired and context is not None and context.log is not None:
            context.log(f"{name}: the fitted state {sid} in {root} is damaged ({repaired}); fitting it again")
    started = time.perf_counter()
    state = engine.fit(train, config, context)
    state.fit_seconds = time.perf_counter() - started
    state.meta.setdefault("settings", settings)
    state.repaired = repaired
    if root is not None and index_id:
        state.state_id = root.name
        _save(root, state, str(index_id))
    return state


def _checksum(record: Mapping[str, object]) -> str:
    """sha256 of ``state.json``'s canonical JSON without its own ``checksum``."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _load(root: Path, name: str, train: TrainGradients, sid: str) -> tuple[EngineState | None, str | None]:
    """``(state, None)`` when the stored state checks out, ``(None, what is wrong)`` when it is
    damaged, ``(None, None)`` when none is stored."""
    meta_path, arrays_path = root / "state.json", root / "arrays.npz"
    if not meta_path.exists() and not arrays_path.exists():
        return None, None
    try:
        stored = json.loads(meta_path.read_text(encoding="utf-8"))
        data = arrays_path.read_bytes()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"unreadable: {type(err).__name__}"
    if not isinstance(stored, dict) or "checksum" not in stored or "arrays_sha256" not in stored:
        return None, "state.json records no checksums (written by an older version)"
    if stored["checksum"] != _checksum(stored):
        return None, "state.json does not match its checksum"
    if hashlib.sha256(data).hexdigest() != stored["arrays_sha256"]:
        return None, f"arrays.npz does not match the sha256 state.json recorded ({len(data)} bytes)"
    if stored.get("engine") != name or stored.get("state_id") != sid:
        return None, "state.json names another engine or state"
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as handle:
            arrays = {k: handle[k] for k in handle.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:  # checksummed, yet unreadable: refit anyway
        return None, f"arrays.npz is unreadable ({type(err).__name__})"
    return EngineState(name, train, arrays=arrays, meta=stored.get("meta", {}), state_id=sid, cache_hit=True,
                       fit_seconds=float(stored.get("fit_seconds", 0.0))), None


def _save(root: Path, state: EngineState, index_id: str) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    buffer = io.BytesIO()
    np.savez(buffer, **state.arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    data = buffer.getvalue()
    (tmp / "arrays.npz").write_bytes(data)
    record = {"state_id": state.state_id, "engine": state.engine, "index_id": index_id,
              "fit_seconds": round(state.fit_seconds, 3), "meta": json.loads(json.dumps(state.meta, default=str)),
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "arrays_sha256": hashlib.sha256(data).hexdigest()}
    record["checksum"] = _checksum(record)
    (tmp / "state.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    if root.exists():  # a damaged state the loader refused: replace it
        shutil.rmtree(root, ignore_errors=True)
    try:
        os.replace(tmp, root)
    except OSError:  # another process stored the same state first; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
