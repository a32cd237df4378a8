"""The partial results of a streamed pass, kept on disk so an interrupted pass resumes where it stopped.

A stream (``gradian.index.stream``) recomputes every chunk's per-example gradients in each pass and
keeps nothing of them. What a pass computes from them (each row's score and self-influence, each
chunk's share of a sum such as EK-FAC's eigenvalue correction or the Kronecker factors) is small,
and is written here after every chunk, so a pass killed part way (a pre-empted job, a lost node)
restarts at the first chunk it had not finished, and a pass that already finished is not made
again on a second run over the same inputs.

Layout, under ``<cache_dir>/stream/<index id>/passes/<pass key>/`` (the key is the pass's name and
a digest of everything it computes from, ``gradian.engines.base.pass_key``):

- ``rows-NNNNN.npz``: one chunk's per-row outputs (none for a pass of sums only);
- ``sums-0.npz`` / ``sums-1.npz``: the sums folded over chunks ``0..through`` in chunk order
  (written in turn, so the one ``progress.json`` names stays whole while the next is written; at
  most every ``SUMS_EVERY_S`` seconds, since they can be large);
- ``progress.json``: ``through`` and the sha256 of each of those files.

Every file is written atomically and checked against ``progress.json`` when read back. A pass with
per-row outputs only resumes chunk by chunk (its chunks do not depend on each other); a pass with
sums resumes after the last chunk folded into the sums file, or from the start when anything it
needs is missing or damaged, so a resumed pass adds in exactly the order an uninterrupted one does.

Interface: ``PassProgress(root, n_chunks, rows, sums)``; ``resume() -> (todo, partial)``, the
chunks still to compute and what the finished ones gave; ``save(k, part, totals)`` after chunk
``k``; ``repaired`` names what was found damaged and recomputed.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from gradian.atomic import write_bytes_atomic, write_text_atomic

__all__ = ["PassProgress"]


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    np.savez(buffer, **named)
    return buffer.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class PassProgress:
    """What one streamed pass has finished, on disk (see the module doc)."""

    #: the shortest time between two writes of a pass's running sums
    SUMS_EVERY_S = 30.0

    def __init__(self, root: Path, n_chunks: int, rows: Sequence[str], sums: Sequence[str]) -> None:
        self.root, self.n_chunks = Path(root), int(n_chunks)
        self.rows, self.sums = tuple(rows), tuple(sums)
        self.repaired: list[str] = []
        self._record: dict[str, Any] = {"through": -1, "rows": {}, "sums": None}
        self._sums_saved_at = float("-inf")

    # -- reading back -----------------------------------------------------------------------------

    def _load(self, name: str, sha: str | None) -> dict[str, np.ndarray] | None:
        path = self.root / name
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if sha is None or _sha(data) != sha:
            self.repaired.append(f"{path} does not match its checksum; recomputed")
            return None
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError):
            self.repaired.append(f"{path} is not readable; recomputed")
            return None

    def resume(self) -> tuple[list[int], dict[int, dict[str, np.ndarray]], dict[str, np.ndarray] | None]:
        """``(todo, rows by chunk, sums so far)``: the chunks still to compute, the per-row outputs
        of the finished ones, and the sums through the last finished chunk (None: none yet)."""
        everything = list(range(self.n_chunks))
        try:
            record = json.loads((self.root / "progress.json").read_text())
            if not isinstance(record, dict) or record.get("n_chunks") != self.n_chunks:
                raise ValueError("another layout")
        except FileNotFoundError:
            return everything, {}, None
        except (OSError, ValueError):
            self.repaired.append(f"{self.root / 'progress.json'} is not readable; the pass starts again")
            return everything, {}, None
        done_rows: dict[int, dict[str, np.ndarray]] = {}
        for key, sha in dict(record.get("rows") or {}).items():
            part = self._load(f"rows-{int(key):05d}.npz", sha) if self.rows else {}
            if part is not None and set(self.rows) <= set(part):
                done_rows[int(key)] = part
        if not self.sums:
            self._record = {"through": -1, "rows": {str(k): record["rows"][str(k)] for k in done_rows}, "sums": None}
            return [k for k in everything if k not in done_rows], done_rows, None
        through = int(record.get("through", -1))
        totals = self._load(f"sums-{through % 2}.npz", record.get("sums")) if through >= 0 else None
        if totals is None or not set(self.sums) <= set(totals) or any(k not in done_rows for k in range(through + 1)):
            if through >= 0:
                self.repaired.append(f"the partial sums under {self.root} are incomplete; the pass starts again")
            return everything, {}, None
        self._record = {"through": through, "rows": {str(k): record["rows"][str(k)] for k in range(through + 1)},
                        "sums": record.get("sums")}
        return everything[through + 1:], {k: done_rows[k] for k in range(through + 1)}, totals

    # -- writing ------------------------------------------------------------------------------------

    def save(self, k: int, part: Mapping[str, np.ndarray], totals: Mapping[str, np.ndarray]) -> None:
        """Record chunk ``k`` as finished: its per-row outputs, and the sums through it.

        The sums can be large (a square of each layer's width for the Kronecker factors), so they
        are rewritten at most every ``SUMS_EVERY_S`` seconds and at the last chunk; a resumed pass
        starts after the last chunk whose sums were kept, recomputing the few after it."""
        import time

        self.root.mkdir(parents=True, exist_ok=True)
        if self.sums and k != self.n_chunks - 1 and time.monotonic() - self._sums_saved_at < self.SUMS_EVERY_S:
            if self.rows:  # the rows alone do not move the resume point of a pass with sums
                write_bytes_atomic(self.root / f"rows-{k:05d}.npz", _npz_bytes({name: part[name] for name in self.rows}))
            return
        if self.rows:
            data = _npz_bytes({name: part[name] for name in self.rows})
            write_bytes_atomic(self.root / f"rows-{k:05d}.npz", data)
            self._record["rows"][str(k)] = _sha(data)
        else:  # a pass of sums only keeps no file per chunk
            self._record["rows"][str(k)] = None
        if self.sums:
            sums = _npz_bytes({name: totals[name] for name in self.sums})
            write_bytes_atomic(self.root / f"sums-{k % 2}.npz", sums)
            self._record.update(through=k, sums=_sha(sums))
            self._sums_saved_at = time.monotonic()
        write_text_atomic(self.root / "progress.json", json.dumps({**self._record, "n_chunks": self.n_chunks}))
