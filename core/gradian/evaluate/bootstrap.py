"""The paired bootstrap over eval items, and the status it gives the capability delta.

Both models answer the same items, so the items are resampled in pairs: one resample draws ``n``
item indices with replacement and takes ``mean(tuned[idx]) - mean(base[idx])``, which is the mean
of the per-item differences ``d = tuned - base`` over the drawn indices. The interval is the
percentile interval of ``n_bootstrap`` such resamples at ``ci_level``, using the inverse of the
empirical distribution function (numpy's ``inverted_cdf``), so for pass/fail metrics its ends are
attainable deltas (multiples of ``1/n``) rather than interpolations between them.

Status: ``regressed`` when the whole interval lies below zero, ``improved`` when it lies above,
``not_significant`` when it contains zero. Everything is drawn from one ``numpy`` PCG64 generator
seeded with ``seed``, in chunks whose size depends only on ``n``: the same inputs give the same
interval bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gradian.errors import ConfigError

__all__ = ["STATUSES", "BootstrapResult", "bootstrap_deltas", "paired_bootstrap", "status_of_interval"]

#: the capability statuses, as written in report.json
STATUSES: tuple[str, ...] = ("regressed", "improved", "not_significant")

# Indices drawn per chunk; bounds memory at about 32 MiB of int64 whatever n_bootstrap is.
_CHUNK_INDICES = 1 << 22


@dataclass(frozen=True)
class BootstrapResult:
    """A paired bootstrap of ``mean(tuned) - mean(base)``; units are the metric's."""

    delta: float
    ci: tuple[float, float]
    ci_level: float
    n_bootstrap: int
    n_items: int
    seed: int
    status: str

    @property
    def excludes_zero(self) -> bool:
        return self.status != "not_significant"


def _differences(base_scores: Sequence[float], tuned_scores: Sequence[float]) -> np.ndarray:
    base = np.asarray(base_scores, dtype=np.float64)
    tuned = np.asarray(tuned_scores, dtype=np.float64)
    if base.ndim != 1 or base.shape != tuned.shape:
        raise ValueError(
            f"paired bootstrap needs one base and one tuned score per item; got {base.shape} "
            f"base and {tuned.shape} tuned scores"
        )
    if base.size == 0:
        raise ValueError("paired bootstrap over zero items: the eval set is empty")
    if not (np.isfinite(base).all() and np.isfinite(tuned).all()):
        raise ValueError("paired bootstrap got a non-finite score (NaN or inf); check the metric's inputs")
    return tuned - base


def bootstrap_deltas(differences: Sequence[float] | np.ndarray, n_bootstrap: int, seed: int) -> np.ndarray:
    """``n_bootstrap`` resampled means of the per-item ``differences`` (float64, in draw order)."""
    d = np.asarray(differences, dtype=np.float64)
    n = d.size
    if n_bootstrap < 1:
        raise ConfigError(f"evaluation.n_bootstrap is {n_bootstrap}; it must be at least 1 (2000 is usual)")
    rng = np.random.default_rng(seed)
    rows_per_chunk = max(1, _CHUNK_INDICES // n)
    out = np.empty(n_bootstrap, dtype=np.float64)
    for start in range(0, n_bootstrap, rows_per_chunk):
        rows = min(rows_per_chunk, n_bootstrap - start)
        idx = rng.integers(0, n, size=(rows, n))
        out[start:start + rows] = d[idx].mean(axis=1)
    return out


def status_of_interval(lo: float, hi: float) -> str:
    """``regressed`` if ``hi < 0``, ``improved`` if ``lo > 0``, else ``not_significant``."""
    if hi < 0:
        return "regressed"
    if lo > 0:
        return "improved"
    return "not_significant"


def paired_bootstrap(
    base_scores: Sequence[float],
    tuned_scores: Sequence[float],
    n_bootstrap: int = 2000,
    ci_level: float = 0.95,
    seed: int = 1234,
) -> BootstrapResult:
    """Delta ``mean(tuned) - mean(base)``, its percentile interval at ``ci_level``, and the status."""
    if not 0 < ci_level < 1:
        raise ConfigError(f"evaluation.ci_level is {ci_level!r}; it must lie strictly between 0 and 1 (e.g. 0.95)")
    d = _differences(base_scores, tuned_scores)
    deltas = bootstrap_deltas(d, n_bootstrap, seed)
    alpha = 1.0 - ci_level
    lo, hi = np.quantile(deltas, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    lo, hi = float(lo), float(hi)
    return BootstrapResult(
        delta=float(d.mean()),
        ci=(lo, hi),
        ci_level=float(ci_level),
        n_bootstrap=int(n_bootstrap),
        n_items=int(d.size),
        seed=int(seed),
        status=status_of_interval(lo, hi),
    )
