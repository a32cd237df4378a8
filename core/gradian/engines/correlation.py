"""Agreement between two engines' rankings."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["rank_correlation"]


def rank_correlation(a: Any, b: Any) -> float:
    """Spearman rank correlation of two score vectors over the same examples, in [-1, 1].

    Returns NaN when either vector is constant (no ranking to compare).
    """
    from scipy.stats import spearmanr

    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"score vectors differ in length: {a.shape[0]} vs {b.shape[0]}")
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(spearmanr(a, b).statistic)
