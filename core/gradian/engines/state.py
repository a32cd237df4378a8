"""Fitted engine states, stored beside the gradient index they were fitted on.

Interface: ``fit_engine(name, train, config, context, cache_dir) -> EngineState`` fits the engine
``name`` on ``train`` (a ``GradientIndex`` or in-memory gradients), or loads the state fitted
before from ``<cache_dir>/engines/<state_id>/``; ``state_id(index_id, engine, settings)``.

The id covers the index id (every input of the stored gradients), the engine's name and the
settings its fit depends on (``Engine.settings``), so a state is reused exactly when the same fit
would be repeated. Settings applied only at scoring time (the damping) are not in it. A state
directory holds ``state.json`` (identity and meta) and ``arrays.npz``; it is written under a
temporary name and renamed into place, so it exists whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from gradian.engines.base import EngineState, FitContext, TrainGradients
from gradian.engines.registry import get_engine

__all__ = ["fit_engine", "state_id", "STATE_FORMAT_VERSION"]

STATE_FORMAT_VERSION = 1


def state_id(index_id: str, engine: str, settings: dict[str, Any]) -> str:
    canonical = json.dumps({"format": STATE_FORMAT_VERSION, "index_id": index_id, "engine": engine,
                            "settings": settings}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


def fit_engine(name: str, train: TrainGradients, config: Any, context: FitContext | None = None,
               cache_dir: str | Path | None = None) -> EngineState:
    """The fitted state of engine ``name`` on ``train``: from the cache when it was fitted before."""
    engine = get_engine(name)
    index_id = getattr(train, "index_id", None)
    settings = engine.settings(config)
    root = None
    if engine.persists(settings) and index_id and cache_dir is not None:
        sid = state_id(index_id, name, settings)
        root = Path(cache_dir) / "engines" / sid
        loaded = _load(root, name, train, sid)
        if loaded is not None:
            return loaded
    started = time.perf_counter()
    state = engine.fit(train, config, context)
    state.fit_seconds = time.perf_counter() - started
    state.meta.setdefault("settings", settings)
    if root is not None and index_id:
        state.state_id = root.name
        _save(root, state, str(index_id))
    return state


def _load(root: Path, name: str, train: TrainGradients, sid: str) -> EngineState | None:
    meta_path, arrays_path = root / "state.json", root / "arrays.npz"
    if not (meta_path.is_file() and arrays_path.is_file()):
        return None
    try:
        stored = json.loads(meta_path.read_text(encoding="utf-8"))
        with np.load(arrays_path, allow_pickle=False) as handle:
            arrays = {k: handle[k] for k in handle.files}
    except (OSError, ValueError, json.JSONDecodeError):
        return None  # a damaged state is refitted, never trusted
    if stored.get("engine") != name or stored.get("state_id") != sid:
        return None
    return EngineState(name, train, arrays=arrays, meta=stored.get("meta", {}), state_id=sid, cache_hit=True,
                       fit_seconds=float(stored.get("fit_seconds", 0.0)))


def _save(root: Path, state: EngineState, index_id: str) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with (tmp / "arrays.npz").open("wb") as handle:
        np.savez(handle, **state.arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    record = {"state_id": state.state_id, "engine": state.engine, "index_id": index_id,
              "fit_seconds": round(state.fit_seconds, 3), "meta": state.meta,
              "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (tmp / "state.json").write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    if root.exists():  # a damaged state the loader refused: replace it
        shutil.rmtree(root, ignore_errors=True)
    try:
        os.replace(tmp, root)
    except OSError:  # another process stored the same state first; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
