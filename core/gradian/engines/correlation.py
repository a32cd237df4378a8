"""Rank agreement: Spearman's correlation, written once for the engines' cross-check and for the
counterfactual fidelity tables (``gradian.counterfactual.datamodel``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["rank_correlation", "rowwise_rank_correlation"]


def rowwise_rank_correlation(a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
    """Spearman of matching rows of ``a`` and ``b`` (``[..., m]``; average ranks for ties, as
    scipy's ``spearmanr``), in [-1, 1]; NaN where either row is constant."""
    from scipy.stats import rankdata

    ra, rb = rankdata(np.asarray(a, dtype=np.float64), axis=-1), rankdata(np.asarray(b, dtype=np.float64), axis=-1)
    ra = ra - ra.mean(axis=-1, keepdims=True)
    rb = rb - rb.mean(axis=-1, keepdims=True)
    denom = np.sqrt((ra * ra).sum(axis=-1) * (rb * rb).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (ra * rb).sum(axis=-1) / np.where(denom > 0, denom, 1.0), np.nan)


def rank_correlation(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    """Spearman rank correlation of two score vectors over the same examples, in [-1, 1].

    Returns NaN when either vector is constant (no ranking to compare) or has fewer than 2 values.
    """
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"score vectors differ in length: {a.shape[0]} vs {b.shape[0]}")
    if a.size < 2:
        return float("nan")
    return float(rowwise_rank_correlation(a, b))
