"""The significance gate: attribution is a diagnosis only when the capability really regressed.

A regression clears the gate when its bootstrap interval lies wholly below zero (status
``regressed``) over at least ``evaluation.min_items`` eval items. Anything else fails it: an
interval containing zero is indistinguishable from noise, an improvement has nothing to explain,
and too few items cannot show significance at all (a one-item set resamples to the same item every
time, so its interval has no width and looks certain). With ``require_significant`` (the default) a
failed gate refuses attribution; without it attribution goes ahead but is marked gated, and both
cases record the ``attribution.gate_failed`` finding so the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradian.evaluate.result import CapabilityResult
from gradian.findings import Finding

__all__ = ["AttributionGate", "gate_attribution"]


@dataclass(frozen=True)
class AttributionGate:
    """``allowed``: attribution may run. ``gated``: the gate failed (scores are not a diagnosis)."""

    allowed: bool
    gated: bool
    finding: Finding | None = None


def gate_attribution(result: CapabilityResult, require_significant: bool = True,
                     min_items: int | None = None) -> AttributionGate:
    """Decide whether ``result`` supports attributing its change to training data.

    It does when the status is ``regressed`` and at least ``min_items`` items were measured
    (``None``: the default of ``evaluation.min_items``).
    """
    if min_items is None:
        from gradian.config import EvaluationConfig

        min_items = EvaluationConfig().min_items
    too_few = result.n_items < min_items
    if result.status == "regressed" and not too_few:
        return AttributionGate(allowed=True, gated=False)
    lo, hi = result.ci
    level = f"{result.ci_level:.0%}"
    if too_few:
        why = (
            f"Only {result.n_items} eval item(s) measured '{result.name}' ({result.metric} {result.base:.4f} -> "
            f"{result.tuned:.4f}, delta {result.delta:+.4f}), fewer than evaluation.min_items={min_items}: so few "
            f"items cannot show a significant change (each moves the score by 1/{result.n_items}, and the "
            f"bootstrap interval [{lo:+.4f}, {hi:+.4f}] of so few resampled items is not a measure of noise)."
        )
        fix = (f"Add eval items that describe the capability (at least {min_items}; 16 or more resolve a "
               "change well), or lower evaluation.min_items if you accept a coarser test.")
        title = (f"Only {result.n_items} eval item(s) for '{result.name}', fewer than evaluation.min_items="
                 f"{min_items}: too few to call a change significant")
    elif result.status == "improved":
        why = (
            f"'{result.name}' improved ({result.metric} {result.base:.4f} -> {result.tuned:.4f}, "
            f"delta {result.delta:+.4f}, {level} interval [{lo:+.4f}, {hi:+.4f}]): there is no "
            "regression to attribute."
        )
        fix = "If a capability did get worse, describe it with its own eval set and metric."
        title = f"No significant regression in '{result.name}'; attribution is not a diagnosis"
    else:
        why = (
            f"The change in '{result.name}' ({result.metric} {result.base:.4f} -> {result.tuned:.4f}, "
            f"delta {result.delta:+.4f}) has a {level} bootstrap interval [{lo:+.4f}, {hi:+.4f}] "
            f"that contains zero over {result.n_items} items: it cannot be told apart from noise."
        )
        fix = (
            "Add eval items that describe the capability (each item moves the score by "
            f"1/{result.n_items}), or check that the metric measures correctness rather than format."
        )
        title = f"No significant regression in '{result.name}'; attribution is not a diagnosis"
    if require_significant:
        message = why + " Attribution was not run."
        severity = "medium"
    else:
        message = why + (
            " evaluation.require_significant is off, so influence scores were still computed; "
            "they rank examples against noise and are not a diagnosis."
        )
        severity = "high"
    finding = Finding(
        id="attribution.gate_failed",
        category="attribution",
        severity=severity,
        title=title,
        message=message,
        evidence={
            "base": result.base,
            "tuned": result.tuned,
            "delta": result.delta,
            "ci_lo": lo,
            "ci_hi": hi,
            "ci_level": result.ci_level,
            "n_items": result.n_items,
            "n_flipped": result.n_flipped,
            "n_bootstrap": result.n_bootstrap,
            "require_significant": require_significant,
            "min_items": min_items,
        },
        example_ids=[],
        fix=fix,
    )
    return AttributionGate(allowed=not require_significant, gated=True, finding=finding)
