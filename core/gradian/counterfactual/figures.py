"""The numbers a counterfactual reports, as pure functions of measured values.

Interface:

- ``capability_recovery(base, before, after, n_items, metric, status_after) -> Recovery`` (the
  report's block): how much of
  the lost capability came back. With ``lost = base - before`` (the drop the original fine-tune
  caused) ``recovered_fraction = (after - before) / lost``; for pass/fail metrics
  ``items_below_base = (base - after) * n_items`` counts the items still lost.
- ``removal_precision(removed, planted) -> dict``: of the removed rows, the share that were
  planted (precision), and of the planted rows, the share removed (recall).
- ``predicted_score_sums(scores, removed) -> dict``: the accusing attribution's scores summed
  over all, removed and kept examples. Under the sign convention (``gradian.engines``) a sum below
  zero means that group, taken together, degraded the capability; ``sign_changed`` says whether
  the kept data's sum has the opposite sign to the whole set's (harmful as a whole, helpful once
  the removed rows are gone). ``predicted_loss_delta_if_removed = sum_removed / n``.
- ``counterfactual_outcome(recovery) -> (outcome, verdict kind)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Mapping

from gradian.report.schema import Recovery

if TYPE_CHECKING:
    from gradian.jsontypes import JsonScalar

__all__ = [
    "OUTCOMES",
    "capability_recovery",
    "counterfactual_outcome",
    "predicted_score_sums",
    "removal_precision",
]

#: outcomes, best first
OUTCOMES = ("recovered", "partial", "not_recovered", "nothing_to_recover")

#: pass/fail metrics, whose scores are shares of items
_ITEM_METRICS = ("exact_match", "contains", "not_contains")


def capability_recovery(base: float, before: float | None, after: float, n_items: int, metric: str,
                        status_after: str | None = None, before_source: str = "") -> Recovery:
    """Recovery of a capability once the removed examples are gone (see the module docstring).

    ``base``: the base model's score; ``before``: the original fine-tune's (None when unknown);
    ``after``: the retrained fine-tune's; ``status_after``: the bootstrap status of after vs base.
    """
    recovered = (after - before) / (base - before) if before is not None and base - before > 0 else None
    below_before = below_after = within = None
    if metric in _ITEM_METRICS:
        # scores are shares of n_items; round away float noise before counting items
        below_after = round((base - after) * n_items, 6)
        if before is not None:
            below_before = round((base - before) * n_items, 6)
        within = below_after <= 1.0
    return Recovery(metric=metric, n_items=n_items, base=base, before=before, after=after,
                    delta_before=None if before is None else before - base, delta_after=after - base,
                    status_after=status_after, recovered_fraction=recovered, items_below_base_before=below_before,
                    items_below_base_after=below_after, within_one_item=within, before_source=before_source)


def counterfactual_outcome(recovery: Recovery) -> tuple[str, str]:
    """``(outcome, verdict kind)``.

    - ``nothing_to_recover`` (kind ``no_regression``): the original fine-tune lost nothing;
    - ``recovered`` (kind ``data``): the retrained model no longer regresses significantly
      against the base and, where the before score is known, it improved on it;
    - ``partial`` (``inconclusive``): better than before, still a significant regression;
    - ``not_recovered`` (``inconclusive``): no better than before.
    """
    delta_before = recovery.delta_before
    delta_after = recovery.delta_after
    if delta_before is not None and delta_before >= 0:
        return "nothing_to_recover", "no_regression"
    improved = delta_before is None or delta_after > delta_before
    still_regressed = recovery.status_after == "regressed"
    if improved and not still_regressed:
        return "recovered", "data"
    if improved:
        return "partial", "inconclusive"
    return "not_recovered", "inconclusive"


def removal_precision(removed: Iterable[int], planted: Iterable[int]) -> dict[str, JsonScalar]:
    """Precision and recall of the removed rows against the planted ones (row indices)."""
    removed_set, planted_set = set(removed), set(planted)
    hit = len(removed_set & planted_set)
    return {
        "n_removed": len(removed_set),
        "n_planted": len(planted_set),
        "n_planted_removed": hit,
        "precision": hit / len(removed_set) if removed_set else None,
        "recall": hit / len(planted_set) if planted_set else None,
    }


def _sign(x: float) -> int:
    return 0 if x == 0 or math.isnan(x) else (1 if x > 0 else -1)


def predicted_score_sums(scores: Mapping[str, float], removed: Iterable[str]) -> dict[str, JsonScalar]:
    """Summed scores of all, removed and kept examples (``scores``: example id -> score)."""
    removed_set = set(removed)
    n = len(scores)
    sum_all = float(sum(scores.values()))
    sum_removed = float(sum(v for k, v in scores.items() if k in removed_set))
    sum_kept = sum_all - sum_removed
    return {
        "n": n,
        "sum_all": sum_all,
        "sum_removed": sum_removed,
        "sum_kept": sum_kept,
        "predicted_loss_delta_if_removed": sum_removed / n if n else None,
        "sign_all": _sign(sum_all),
        "sign_kept": _sign(sum_kept),
        "sign_changed": _sign(sum_all) != _sign(sum_kept),
    }
