"""One pass over chunks of rows, folded: the rule every gradient container adds partial results by.

A pass computes, from each chunk of training rows, per-row outputs (a score, a self-influence, a
squared norm) and per-chunk shares of sums (EK-FAC's eigenvalue correction, DataInf's
preconditioner, Kronecker factors). ``fold`` places the per-row outputs and adds the sums in chunk
order; ``accumulate`` is that step for one chunk, shared by a container that keeps partial results
on disk (``gradian.index.stream``), so a resumed pass adds in exactly the order an uninterrupted one
does. ``pass_key(name, inputs)`` names a pass by its content, for such a container.

Plain numpy, no model and no storage: the engines (``gradian.engines.base.chunk_pass``) and the
stores both build on it.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

__all__ = ["ChunkOutputs", "accumulate", "fold", "pass_key"]

ChunkOutputs = dict[str, np.ndarray]


def pass_key(name: str, inputs: Mapping[str, object]) -> str:
    """A content key for one pass: its name and the bytes of everything it computes from (arrays by
    dtype, shape and bytes; other values by ``repr``), so a resumable container keeps the partial
    results of a pass only for exactly that pass."""
    import hashlib

    digest = hashlib.sha256(name.encode())
    for key in sorted(inputs):
        value = inputs[key]
        digest.update(key.encode())
        if isinstance(value, np.ndarray):
            value = np.ascontiguousarray(value)
            digest.update(f"{value.dtype}{value.shape}".encode())
            digest.update(value.tobytes())
        else:
            digest.update(repr(value).encode())
    return f"{name}-{digest.hexdigest()[:16]}"


def fold(chunks: Iterator[tuple[int, dict[str, np.ndarray]]], n: int,
         of_chunk: Callable[[int, dict[str, np.ndarray]], ChunkOutputs], rows: Sequence[str] = (),
         sums: Sequence[str] = (), partial: ChunkOutputs | None = None) -> ChunkOutputs:
    """Apply ``of_chunk(start, chunk)`` to every chunk: its ``rows`` outputs (one leading entry per
    row of the chunk) are placed at the chunk's rows of ``[n, ...]`` arrays, its ``sums`` outputs
    added up in chunk order, starting from ``partial`` (what earlier chunks of the same pass gave)."""
    out: ChunkOutputs = dict(partial or {})
    for start, chunk in chunks:
        accumulate(out, n, start, of_chunk(start, chunk), rows, sums)
    return out


def accumulate(out: ChunkOutputs, n: int, start: int, part: ChunkOutputs, rows: Sequence[str],
               sums: Sequence[str]) -> None:
    """Add one chunk's outputs ``part`` to ``out`` (see ``fold``): the one rule every container
    folds by, so a resumed pass adds in the same order as an uninterrupted one."""
    for name in rows:
        value = np.asarray(part[name])
        if name not in out:
            out[name] = np.zeros((n, *value.shape[1:]), dtype=value.dtype)
        out[name][start: start + value.shape[0]] = value
    for name in sums:
        value = np.asarray(part[name])
        if name not in out:
            out[name] = np.zeros_like(value)
        out[name] = out[name] + value
