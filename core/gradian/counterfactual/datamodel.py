"""Fidelity of attribution scores against retraining: the linear datamodeling score and its kin.

An attribution score predicts what retraining without an example would do to the query loss:
``predicted_loss_delta_if_removed_j = score_j / n`` (``gradian.engines.SIGN_CONVENTION``). Summed
over a set, the prediction for training on a subset ``S`` alone is

    phi(S) ~= phi(D) + sum_{j not in S} score_j / n  =  const - sum_{i in S} score_i / n,

so the *predicted* loss of subset ``S`` orders like ``-sum_{i in S} score_i``. Two checks compare
that prediction with measured retraining:

- **LDS** (linear datamodeling score): retrain on ``K`` random subsets (half the data each), measure
  the loss ``phi(S_k)``, and take ``Spearman(phi(S_k), -sum_{i in S_k} score_i)`` over the ``K``
  subsets. 1 is a perfect ordering, 0 no better than chance, negative an inverted one.
- **Leave-one-group-out**: retrain without each group ``c`` (e.g. a declared cluster), measure
  ``phi(D \\ c) - phi(D)``, and take its Spearman with ``sum_{j in c} score_j`` over the groups.

Both check orderings, not magnitudes. Uncertainty comes from a bootstrap over the subsets (or
groups): resample them with replacement, recompute every engine's correlation on the same
resample, and report the percentile interval, plus the paired interval of each engine's margin
over the next one.

Interface: ``sample_subsets``, ``subset_score_sums``, ``spearman``, ``linear_datamodeling_score``,
``group_removal_sums``, ``compare_rankings`` (the bootstrap comparison of several engines),
``lds_table``, ``lds_difference`` (one engine's LDS minus another's, paired) and
``group_removal_table``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence, TypedDict

import numpy as np

from gradian.engines.correlation import rank_correlation, rowwise_rank_correlation

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: a vector of floats: a sequence or a 1-d array
Floats = Sequence[float] | np.ndarray

__all__ = [
    "compare_rankings",
    "group_removal_sums",
    "group_removal_table",
    "linear_datamodeling_score",
    "lds_table",
    "sample_subsets",
    "spearman",
    "subset_score_sums",
]


class EngineAgreement(TypedDict):
    """One engine's Spearman with the measurements: the point estimate, the bootstrap mean and interval."""

    spearman: float
    bootstrap_mean: float | None
    ci: list[float | None]


class Margin(TypedDict):
    """The best engine against another one, on the same resamples."""

    difference: float
    ci: list[float | None]
    share_best_wins: float | None


class RankingComparison(TypedDict):
    """What ``compare_rankings`` returns."""

    n: int
    n_bootstrap: int
    ci_level: float
    engines: dict[str, EngineAgreement]
    ranking: list[str]
    best: str | None
    margins: dict[str, Margin]


class BootstrapSettings(TypedDict, total=False):
    """The keyword arguments ``lds_table`` and ``group_removal_table`` pass on to ``compare_rankings``."""

    n_bootstrap: int
    ci_level: float
    seed: int


def sample_subsets(n: int, k: int, fraction: float = 0.5, seed: int = 0) -> np.ndarray:
    """``[k, n]`` boolean masks, each keeping exactly ``round(fraction * n)`` examples at random."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"subset fraction {fraction!r} must lie strictly between 0 and 1")
    if k < 2 or n < 2:
        raise ValueError(f"need at least 2 subsets of at least 2 examples, got k={k}, n={n}")
    size = max(1, min(n - 1, round(fraction * n)))
    rng = np.random.default_rng(seed)
    masks = np.zeros((k, n), dtype=bool)
    for row in masks:
        row[rng.choice(n, size=size, replace=False)] = True
    return masks


def subset_score_sums(masks: np.ndarray, scores: Floats) -> np.ndarray:
    """``[k]``: ``sum_{i in S_k} score_i`` for each subset mask."""
    masks = np.asarray(masks, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    if masks.ndim != 2 or masks.shape[1] != s.shape[0]:
        raise ValueError(f"masks are {masks.shape} but there are {s.shape[0]} scores")
    return masks.astype(np.float64) @ s


def spearman(a: Floats, b: Floats) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant.
    ``gradian.engines.correlation`` holds the one implementation."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"spearman needs two vectors of one length, got {x.shape} and {y.shape}")
    return rank_correlation(x, y)


def linear_datamodeling_score(losses: Floats, masks: np.ndarray, scores: Floats) -> float:
    """``Spearman(phi(S_k), -sum_{i in S_k} score_i)``: the LDS of one engine's scores."""
    return spearman(losses, -subset_score_sums(masks, scores))


def group_removal_sums(groups: Sequence[Sequence[int]], scores: Floats) -> np.ndarray:
    """``[g]``: ``sum_{j in c} score_j`` for each group of row indices, the predicted loss rise
    (times ``n``) when the group is removed."""
    s = np.asarray(scores, dtype=np.float64)
    return np.array([s[np.asarray(list(g), dtype=int)].sum() for g in groups], dtype=np.float64)


def compare_rankings(measured: Floats, predicted: Mapping[str, Floats], *,
                     n_bootstrap: int = 2000, ci_level: float = 0.95, seed: int = 0) -> RankingComparison:
    """Spearman of ``measured`` with each engine's ``predicted`` values, with bootstrap intervals.

    Returns ``{"n", "engines": {name: {"spearman", "bootstrap_mean", "ci"}}, "ranking",
    "best", "margins": {name: {"difference", "ci", "share_best_wins"}}}``. ``margins`` compares the
    best engine with each other one on the same resamples: ``difference`` is best minus other
    (point estimate), ``share_best_wins`` the share of resamples where the best stays ahead.
    """
    y = np.asarray(measured, dtype=np.float64)
    names = list(predicted)
    preds = {k: np.asarray(v, dtype=np.float64) for k, v in predicted.items()}
    for k, v in preds.items():
        if v.shape != y.shape:
            raise ValueError(f"engine '{k}' predicts {v.shape[0]} values for {y.shape[0]} measurements")
    m = y.shape[0]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, m, size=(n_bootstrap, m))
    boot = {k: rowwise_rank_correlation(y[idx], preds[k][idx]) for k in names}
    lo_q, hi_q = (1 - ci_level) / 2, 1 - (1 - ci_level) / 2

    def interval(values: np.ndarray) -> list[float | None]:
        finite = values[np.isfinite(values)]
        if finite.size == 0:
            return [None, None]
        return [float(np.quantile(finite, lo_q)), float(np.quantile(finite, hi_q))]

    rho = {k: spearman(y, preds[k]) for k in names}
    engines: dict[str, EngineAgreement] = {}
    for k in names:
        finite = boot[k][np.isfinite(boot[k])]
        engines[k] = {"spearman": rho[k],
                      "bootstrap_mean": float(finite.mean()) if finite.size else None,
                      "ci": interval(boot[k])}
    ranking = sorted(names, key=lambda k: -np.nan_to_num(rho[k], nan=-np.inf))
    best = ranking[0] if ranking else None
    margins: dict[str, Margin] = {}
    if best is not None:
        for k in ranking[1:]:
            diff = boot[best] - boot[k]
            finite = diff[np.isfinite(diff)]
            margins[k] = {"difference": rho[best] - rho[k],
                          "ci": interval(diff),
                          "share_best_wins": float((finite > 0).mean()) if finite.size else None}
    return {"n": m, "n_bootstrap": n_bootstrap, "ci_level": ci_level, "engines": engines,
            "ranking": ranking, "best": best, "margins": margins}


def lds_table(losses: Floats, masks: np.ndarray, scores: Mapping[str, Floats],
              **bootstrap: Unpack[BootstrapSettings]) -> RankingComparison:
    """``compare_rankings`` of the measured subset losses with each engine's predicted ordering."""
    return compare_rankings(losses, {k: -subset_score_sums(masks, s) for k, s in scores.items()}, **bootstrap)


def lds_difference(losses: Floats, masks: np.ndarray, scores: Floats, other: Floats,
                   **bootstrap: Unpack[BootstrapSettings]) -> dict[str, float | list[float] | None]:
    """The LDS of ``scores`` minus that of ``other`` on the same bootstrap resamples (``lds_table``'s,
    so a table with the same settings draws the same subsets): ``{"difference", "ci": [low, high],
    "share_ahead"}``, the share of resamples where ``scores`` is ahead; an interval or share the
    resamples cannot give is None."""
    pair = lds_table(losses, masks, {"a": scores, "b": other}, **bootstrap)
    margin = pair["margins"][pair["ranking"][1]]
    sign = 1.0 if pair["best"] == "a" else -1.0
    low, high = margin["ci"]
    share = margin["share_best_wins"]
    return {"difference": sign * margin["difference"],
            "ci": None if low is None or high is None else ([low, high] if sign > 0 else [-high, -low]),
            "share_ahead": None if share is None else (share if sign > 0 else 1.0 - share)}


def group_removal_table(deltas: Floats, groups: Sequence[Sequence[int]],
                        scores: Mapping[str, Floats], **bootstrap: Unpack[BootstrapSettings]) -> RankingComparison:
    """``compare_rankings`` of measured ``phi(D \\ c) - phi(D)`` with each engine's group sums."""
    return compare_rankings(deltas, {k: group_removal_sums(groups, s) for k, s in scores.items()}, **bootstrap)
