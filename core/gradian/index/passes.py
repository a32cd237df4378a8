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
  most every ``SUMS_EVERY_S`` seconds from the start of the pass, and after its last chunk, since
  they can be large);
- ``progress.json``: ``through`` and the sha256 of each of those files.

A pass sharded over the processes of a ``torchrun`` launch (``gradian.index.stream``) keeps one
record per rank's contiguous span of chunks ``A..B`` (``progress-AAAAA-BBBBB.json`` and
``sums-AAAAA-BBBBB-0/1.npz``, the sums over that span alone) beside the shared ``rows-NNNNN.npz``;
once every span is folded, rank 0 ``commit``s the whole pass as one ``progress.json`` and removes
the span records, so a finished pass is read back whole by any number of processes.

Every file is written atomically and checked against ``progress.json`` when read back. A pass with
per-row outputs only resumes chunk by chunk (its chunks do not depend on each other); a pass with
sums resumes after the last chunk folded into the sums file, or from the start when anything it
needs is missing or damaged, so a resumed pass adds in exactly the order an uninterrupted one does.

Interface: ``PassProgress(root, n_chunks, rows, sums, span=None)`` (``span``: the chunks
``first..end-1`` this record covers, all of them by default); ``resume() -> (todo, rows, sums)``,
the chunks still to compute and what the finished ones gave; ``save(k, part, totals)`` after chunk
``k``; ``checksums`` the sha256 of every per-row file finished so far; ``commit(checksums,
totals)`` records a whole pass finished; ``repaired`` names what was found damaged and recomputed.
A pass with per-row outputs only takes a chunk as done whichever record (a rank's, or the whole
pass's) says so.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence, TypedDict

import numpy as np

from gradian.atomic import write_bytes_atomic, write_text_atomic

__all__ = ["PassProgress", "keep_arrays", "kept_arrays"]


class _PassRecord(TypedDict, total=False):
    """``progress.json`` (or a rank's span record): the last chunk folded into the sums file, the sha256
    of each finished chunk's per-row file and of the sums file, and the pass's chunk count."""

    through: int
    rows: dict[str, str | None]
    sums: str | None
    n_chunks: int


def _npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    # untyped: numpy's stubs would match a ** mapping of arrays against savez's allow_pickle keyword
    named: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
    np.savez(buffer, **named)
    return buffer.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def keep_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` (npz) and its sha256 beside it (``<path>.sha256``), each
    atomically: results a pass computed once and a later run reads back (``kept_arrays``)."""
    data = _npz_bytes(arrays)
    write_bytes_atomic(path, data)
    write_text_atomic(path.with_name(path.name + ".sha256"), _sha(data))


def kept_arrays(path: Path) -> dict[str, np.ndarray] | None:
    """What ``keep_arrays`` wrote to ``path``, or None when it is missing, damaged or unreadable."""
    try:
        data = path.read_bytes()
        sha = path.with_name(path.name + ".sha256").read_text().strip()
    except OSError:
        return None
    if _sha(data) != sha:
        return None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError):
        return None


class PassProgress:
    """What one streamed pass has finished, on disk (see the module doc)."""

    #: the shortest time between two writes of a pass's running sums
    SUMS_EVERY_S = 30.0

    def __init__(self, root: Path, n_chunks: int, rows: Sequence[str], sums: Sequence[str],
                 span: tuple[int, int] | None = None) -> None:
        self.root, self.n_chunks = Path(root), int(n_chunks)
        self.rows, self.sums = tuple(rows), tuple(sums)
        self.first, self.end = span if span is not None else (0, self.n_chunks)
        whole = (self.first, self.end) == (0, self.n_chunks)
        self._name = "progress.json" if whole else f"progress-{self.first:05d}-{self.end:05d}.json"
        self._sums_stem = "sums" if whole else f"sums-{self.first:05d}-{self.end:05d}"
        self.repaired: list[str] = []
        #: the sha256 of each finished chunk's per-row file (None for a pass of sums only)
        self.checksums: dict[int, str | None] = {}
        self._record: _PassRecord = {"through": -1, "rows": {}, "sums": None}
        # the clock of the running sums' writes starts with the pass: a pass shorter than
        # SUMS_EVERY_S writes them once, at its last chunk
        self._sums_saved_at = time.monotonic()

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

    def _read_record(self, name: str) -> _PassRecord | None:
        path = self.root / name
        try:
            record: _PassRecord = json.loads(path.read_text())
            if not isinstance(record, dict) or record.get("n_chunks") != self.n_chunks:
                raise ValueError("another layout")
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            self.repaired.append(f"{path} is not readable; the pass starts again")
            return None
        return record

    def resume(self) -> tuple[list[int], dict[int, dict[str, np.ndarray]], dict[str, np.ndarray] | None]:
        """``(todo, rows by chunk, sums so far)``: the chunks of the span still to compute, the
        per-row outputs of the finished ones, and the sums through the last finished chunk (None:
        none yet)."""
        everything = list(range(self.first, self.end))
        if not self.sums:
            # per-row outputs only: a chunk is done whichever record (the whole pass's or a
            # rank's) lists it, as long as its file checks out
            names = ["progress.json", *sorted(p.name for p in self.root.glob("progress-?????-?????.json"))]
            listed: dict[int, str | None] = {}
            for name in names:
                record = self._read_record(name) or {}
                for key, sha in dict(record.get("rows") or {}).items():
                    if self.first <= int(key) < self.end:
                        listed.setdefault(int(key), sha)
            done_rows: dict[int, dict[str, np.ndarray]] = {}
            for k, sha in sorted(listed.items()):
                part = self._load(f"rows-{k:05d}.npz", sha) if self.rows else {}
                if part is not None and set(self.rows) <= set(part):
                    done_rows[k] = part
                    self.checksums[k] = sha
            self._record = {"through": -1, "rows": {str(k): self.checksums[k] for k in done_rows}, "sums": None}
            return [k for k in everything if k not in done_rows], done_rows, None
        own = self._read_record(self._name)
        if own is None:
            return everything, {}, None
        record = own
        done_rows = {}
        for key, sha in dict(record.get("rows") or {}).items():
            part = self._load(f"rows-{int(key):05d}.npz", sha) if self.rows else {}
            if part is not None and set(self.rows) <= set(part):
                done_rows[int(key)] = part
        through = int(record.get("through", -1))
        totals = self._load(f"{self._sums_stem}-{through % 2}.npz", record.get("sums")) if through >= self.first else None
        if (totals is None or not set(self.sums) <= set(totals) or through >= self.end
                or any(k not in done_rows for k in range(self.first, through + 1))):
            if through >= 0:
                self.repaired.append(f"the partial sums under {self.root} are incomplete; the pass starts again")
            return everything, {}, None
        kept = range(self.first, through + 1)
        self._record = {"through": through, "rows": {str(k): record["rows"][str(k)] for k in kept},
                        "sums": record.get("sums")}
        self.checksums = {k: record["rows"][str(k)] for k in kept}
        return everything[through + 1 - self.first:], {k: done_rows[k] for k in kept}, totals

    # -- writing ------------------------------------------------------------------------------------

    def save(self, k: int, part: Mapping[str, np.ndarray], totals: Mapping[str, np.ndarray]) -> None:
        """Record chunk ``k`` as finished: its per-row outputs, and the sums through it.

        The sums can be large (a square of each layer's width for the Kronecker factors), so they
        are rewritten at most every ``SUMS_EVERY_S`` seconds and at the last chunk; a resumed pass
        starts after the last chunk whose sums were kept, recomputing the few after it."""
        self.root.mkdir(parents=True, exist_ok=True)
        sha = None
        if self.rows:
            data = _npz_bytes({name: part[name] for name in self.rows})
            write_bytes_atomic(self.root / f"rows-{k:05d}.npz", data)
            sha = _sha(data)
        self.checksums[k] = sha  # a pass of sums only keeps no file per chunk
        if self.sums and k != self.end - 1 and time.monotonic() - self._sums_saved_at < self.SUMS_EVERY_S:
            return  # the rows alone do not move the resume point of a pass with sums
        self._record["rows"].update({str(j): self.checksums[j] for j in range(self.first, k + 1)
                                     if j in self.checksums} if self.sums else {str(k): sha})
        if self.sums:
            sums = _npz_bytes({name: totals[name] for name in self.sums})
            write_bytes_atomic(self.root / f"{self._sums_stem}-{k % 2}.npz", sums)
            self._record.update({"through": k, "sums": _sha(sums)})
            self._sums_saved_at = time.monotonic()
        write_text_atomic(self.root / self._name, json.dumps({**self._record, "n_chunks": self.n_chunks}))

    def commit(self, checksums: Mapping[int, str | None], totals: Mapping[str, np.ndarray]) -> None:
        """Record the whole pass finished (``checksums``: every chunk's per-row file, ``totals``:
        the sums over every chunk) in ``progress.json``, and remove the ranks' span records."""
        self.root.mkdir(parents=True, exist_ok=True)
        last = self.n_chunks - 1
        record: _PassRecord = {"through": last if self.sums else -1,
                                  "rows": {str(k): checksums[k] for k in range(self.n_chunks)}, "sums": None}
        if self.sums:
            sums = _npz_bytes({name: totals[name] for name in self.sums})
            write_bytes_atomic(self.root / f"sums-{last % 2}.npz", sums)
            record["sums"] = _sha(sums)
        write_text_atomic(self.root / "progress.json", json.dumps({**record, "n_chunks": self.n_chunks}))
        for leftover in [*self.root.glob("progress-?????-?????.json"), *self.root.glob("sums-?????-?????-?.npz")]:
            leftover.unlink(missing_ok=True)
