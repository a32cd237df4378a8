"""Training examples as points in gradient space: what the model would learn from each row.

Interface: ``gradient_features(train, rows, dim, seed) -> ndarray [len(rows), <= dim]``. Each
row's per-example gradient (every block of a ``TrainGradients``, e.g. an opened
``GradientIndex``, concatenated) is L2-normalized, so rows are compared by the direction they
push the weights and not by how hard; a gradient wider than ``dim`` is then multiplied by a seeded
Gaussian matrix ``R / sqrt(dim)`` (Johnson-Lindenstrauss: cosine similarities survive up to a
small distortion), and normalized again. The projection is applied block by block and summed,
so no row is ever held at its full width and no ``width x dim`` matrix is formed at once.

Two rows with the same question form but different answers point in different directions here
even when a sentence encoder puts them side by side, which is why the accused set and
``clustering.space: gradient`` look at this space.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:
    from gradian.engines.base import TrainGradients

__all__ = ["DEFAULT_GRADIENT_DIM", "gradient_features"]

#: width of the projected gradient features
DEFAULT_GRADIENT_DIM = 256


def gradient_features(train: TrainGradients, rows: Sequence[int] | None = None, dim: int = DEFAULT_GRADIENT_DIM,
                      seed: int = 0) -> np.ndarray:
    """Unit-length, seeded-projected gradients of ``rows`` (all rows when None), in ``rows`` order.

    ``train`` is any ``TrainGradients`` (``iter_chunks()`` yields ``(start, {block: [rows,
    width]})``). A row whose gradient is zero stays the zero vector.
    """
    n = int(train.n)
    wanted = np.arange(n) if rows is None else np.asarray(list(rows), dtype=np.int64)
    blocks = list(train.block_names)
    widths: dict[str, int] = {}
    projections: dict[str, np.ndarray] = {}
    out: np.ndarray | None = None
    for slots, chunk in _wanted_chunks(train, wanted, rows is None):
        if out is None:
            widths = {b: int(chunk[b].shape[1]) for b in blocks}
            total = sum(widths.values())
            width = min(dim, total)
            if total > dim:
                rng = np.random.default_rng(seed)
                projections = {b: (rng.standard_normal((widths[b], dim)) / np.sqrt(dim)).astype(np.float32)
                               for b in blocks}
            out = np.zeros((len(wanted), width), dtype=np.float64)
        parts = {b: np.asarray(chunk[b], dtype=np.float64) for b in blocks}
        norms = np.sqrt(sum(np.einsum("ij,ij->i", v, v) for v in parts.values()))
        if projections:
            y = sum((parts[b].astype(np.float32) @ projections[b]).astype(np.float64) for b in blocks)
        else:
            y = np.concatenate([parts[b] for b in blocks], axis=1)
        y = np.divide(y, norms[:, None], out=np.zeros_like(y), where=norms[:, None] > 0)
        out[slots] = y
    if out is None:
        return np.zeros((len(wanted), 0))
    return _unit_rows(out)


def _wanted_chunks(train: TrainGradients, wanted: np.ndarray,
                   every: bool) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """``(slots, {block: [rows, width]})``: the gradients of ``wanted[slots]``, a chunk at a time.

    A subset is read through the container's ``rows`` when it has one and says its ``chunk_size``
    (an index reads only those chunks; a stream computes only those rows), grouped by chunk as a
    pass would give them, so each product below has the same operands either way; otherwise, and
    for every row, from one pass over the chunks."""
    size = getattr(train, "chunk_size", None)
    fetch = getattr(train, "rows", None)
    if not every and callable(fetch) and isinstance(size, int) and size > 0:
        for k in sorted(set((wanted // size).tolist())):
            slots = np.flatnonzero(wanted // size == k)
            yield slots, fetch(wanted[slots])
        return
    for start, chunk in train.iter_chunks():
        size = len(next(iter(chunk.values()))) if chunk else 0
        mask = (wanted >= start) & (wanted < start + size)
        if not mask.any():
            continue
        # rows of ``wanted`` in this chunk, in the order they were asked for
        slots = np.flatnonzero(mask)
        yield slots, {b: v[wanted[slots] - start] for b, v in chunk.items()}


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return np.divide(matrix, norms, out=np.zeros_like(matrix), where=norms > 0)
