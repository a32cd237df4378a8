"""The significance gate: attribution is a diagnosis only when the capability really regressed.

A regression clears the gate when its bootstrap interval lies wholly below zero (status
``regressed``). Anything else fails it: an interval containing zero is indistinguishable from
noise, and an improvement has nothing to explain. With ``require_significant`` (the default) a
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


def gate_attribution(result: CapabilityResult, require_significant: bool = True) -> AttributionGate:
    """Decide whether ``result`` supports attributing its change to training data."""
    if result.status == "regressed":
        return AttributionGate(allowed=True, gated=False)
    lo, hi = result.ci
    level = f"{result.ci_level:.0%}"
    if result.status == "improved":
        why = (
            f"'{result.name}' improved ({result.metric} {result.base:.4f} -> {result.tuned:.4f}, "
            f"delta {result.delta:+.4f}, {level} interval [{lo:+.4f}, {hi:+.4f}]): there is no "
            "regression to attribute."
        )
        fix = "If a capability did get worse, describe it with its own eval set and metric."
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
        title=f"No significant regression in '{result.name}'; attribution is not a diagnosis",
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
        },
        example_ids=[],
        fix=fix,
    )
    return AttributionGate(allowed=not require_significant, gated=True, finding=finding)
