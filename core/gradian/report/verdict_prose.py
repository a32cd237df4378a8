"""The verdict in words: ``render_verdict(decision)`` and ``render_hedge(hedge)``.

Reads a ``gradian.report.decision.VerdictDecision`` and decides nothing: every kind, cluster,
figure and hedge it words is already on the decision. Changing a sentence here never changes a
verdict, and a test of the decision never depends on a sentence.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

from gradian.report.decision import ratio_text, share_text

if TYPE_CHECKING:
    from gradian.report.schema import Accused, Harm
    from gradian.report.decision import CapabilityFigures, Hedge, VerdictDecision

__all__ = ["render_hedge", "render_verdict", "share_text", "ratio_text"]


def _ids(ids: Sequence[str]) -> str:
    return ", ".join(ids)


def _fmt(x: object, digits: int = 4) -> str:
    return f"{x:+.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _capability_sentence(cap: "CapabilityFigures") -> str:
    lo, hi = cap.ci
    text = (
        f"'{cap.name}' ({cap.metric}) went {cap.base:.4f} -> {cap.tuned:.4f} (delta {_fmt(cap.delta)}, "
        f"95% CI [{_fmt(lo)}, {_fmt(hi)}]) over {cap.n_items} items"
    )
    if not cap.proxy_used and cap.n_flipped is not None:
        text += f"; {cap.n_flipped} flipped from right to wrong"
    return text + "."


def _loss(x: float, unit: str) -> str:
    return f"{x:.3g} {unit}"


def _accused_text(accused: "Accused", harm: "Harm | None") -> str:
    """One sentence on the accused set: how many rows, how much of the harm, what is left out; with a
    measured query loss, what removing them should give back, in its units."""
    n, total = accused.n_in_cluster, int(accused.cluster_n)
    elsewhere = (f" It also holds {accused.n_outside_cluster} row(s) from other clusters whose gradient nearly "
                 "copies an accused row's." if accused.n_outside_cluster else "")
    if n >= total:
        text = (f"The whole cluster is the accused set ({total} rows, an estimated "
                f"{accused.estimated_harmful_share:.0%} of them harmful).")
    else:
        rest = accused.left_out_mean_per_example
        rest_text = (f" (their mean score {rest:.3g} against {accused.mean_per_example:.3g} for the set)"
                     if isinstance(rest, (int, float)) else "")
        text = (f"Inside it, the accused set is {n} of its {total} rows: they carry "
                f"{accused.share_of_cluster_harm:.0%} of the cluster's harm, an estimated "
                f"{accused.estimated_harmful_share:.0%} of them harmful; the other {total - n} rows{rest_text} "
                "are left out.")
    text += elsewhere
    if harm is not None and harm.accused_loss is not None and harm.accused_share is not None:
        text += (f" Removing the accused set should lower that loss by about {_loss(harm.accused_loss, harm.unit)} "
                 f"(its {harm.accused_share:.0%} share of the rise)")
        first = harm.accused_first_order
        if first is not None and harm.accused_loss > 0:
            ratio = -first / harm.accused_loss
            if 0.5 <= ratio <= 2:
                text += f"; the first-order estimate, {_loss(-first, harm.unit)}, agrees"
            elif ratio > 2:
                text += (f"; the first-order estimate, {_loss(-first, harm.unit)}, is {ratio:.0f}x that, as a "
                         "linear estimate of removing many rows at once overshoots")
        text += "."
    return text


def _cluster_text(d: "VerdictDecision") -> str:
    lump = d.lumpiness
    if d.accused_cluster is None or lump is None:
        return ""
    label = f" ({lump.label})" if lump.label else ""
    text = f"Cluster {d.accused_cluster}{label} carries {share_text(lump)}: {lump.n} examples, "
    text += ("and the rest of the data is net helpful." if lump.rate_ratio is None or math.isinf(lump.rate_ratio)
             else f"each {lump.rate_ratio:.0f}x as harmful as the rest on average.")
    harm = d.harm
    if harm is not None:
        text += (f" The regressed items' query loss rose {_loss(harm.rise, harm.unit)} from base to tuned")
        text += (f"; by its share, about {_loss(harm.cluster_loss, harm.unit)} of that is this cluster's."
                 if harm.cluster_loss is not None else ".")
    if d.accused_set is not None:
        text += " " + _accused_text(d.accused_set, harm)
    return text


def _reason(d: "VerdictDecision", default: str = "") -> str:
    return str(d.lumpiness.reason) if d.lumpiness else default


def render_verdict(d: "VerdictDecision") -> str:
    """The verdict's ``summary``: what was measured, which rule decided and on what evidence."""
    cap_text = _capability_sentence(d.capability) if d.capability is not None else ""
    cluster_text = _cluster_text(d)
    if d.rule == "critical":
        summary = (f"{len(d.critical_ids)} critical issue(s) invalidate or dominate this run and must be fixed "
                   f"before anything else is read: {_ids(d.critical_ids)}.")
        if cap_text:
            summary += " " + cap_text
        if cluster_text:
            summary += " Beyond that, " + cluster_text[0].lower() + cluster_text[1:]
        elif d.attributed:
            summary += " No cluster stands out in the influence scores; nothing is offered for deletion."
    elif d.rule == "no_target":
        summary = "No capability was measured, so nothing is attributed to the data. " if d.attribution_ran else ""
        summary += (f"The audit names {len(d.serious_ids)} high-severity cause(s): {_ids(d.serious_ids)}."
                    if d.serious_ids else "No high or critical audit finding explains a regression.")
    elif d.rule == "no_regression":
        cap = d.capability
        what = "improved" if cap is not None and cap.status == "improved" else "did not change significantly"
        summary = f"'{cap.name if cap else None}' {what}: {cap_text} There is no regression to attribute."
        if d.serious_ids:
            summary += f" The audit still raised: {_ids(d.serious_ids)}."
    elif d.rule == "not_attributed":
        summary = f"{cap_text} Attribution did not run" + (f" ({d.gate_title}); " if d.gate_title else "; ")
        summary += (f"the audit names {_ids(d.serious_ids)}." if d.serious_ids
                    else "no high or critical audit finding explains the change.")
    elif d.rule == "lumpy":
        summary = f"{cap_text} {cluster_text}"
        if d.high_config_ids:
            summary += f" The training setup is also at fault: {_ids(d.high_config_ids)}."
    elif d.rule == "flat_config":
        lead, rest = d.config_ids[0], d.config_ids[1:]
        summary = (f"{cap_text} The harm is spread flatly over the data ({_reason(d)}), which is how a "
                   "training-setting fault looks, not bad rows; no examples are offered for deletion. The "
                   f"audit names the cause: {lead} ({d.lead_config_title})"
                   + (f", with {_ids(rest)}" if rest else "") + ".")
    elif d.rule == "flat_data":
        summary = (f"{cap_text} No cluster stands out ({_reason(d)}), but the audit found data defects: "
                   f"{_ids(d.data_high_ids)}. Fix those rows first.")
    else:  # unexplained
        summary = (f"{cap_text} No cluster stands out ({_reason(d, 'no clusters')}) and no audit finding "
                   "explains the regression.")
    if d.engine_agreement is not None:
        e = d.engine_agreement
        summary += f" Engine agreement (Spearman, {e.engine} vs {e.cross_check}): {e.spearman:.3f}."
    return summary.strip()


def _base_failing(n_base_failing: int, n_items: int | None) -> str:
    return (f"{n_base_failing} of {n_items} eval items fail on the base model too; no training "
            "example can be blamed for those, and they are counted apart.")


def _repeated_items(n_repeats: int, n_items: int) -> str:
    return (f"{n_repeats} of {n_repeats + n_items} eval items repeat an earlier item (the same prompt and "
            f"answer) and count once: the measurement rests on {n_items} distinct items.")


def _low_base(base: float) -> str:
    return (f"The base model scored only {base:.4g} before training: the capability was mostly absent "
            "to begin with, so a data explanation accounts for little.")


def _weakly_held(n_weakly_held: int, n_flipped: int | None, mean_base_margin: float | None = None) -> str:
    margin_text = (f", mean margin {mean_base_margin:+.2f} nats"
                   if isinstance(mean_base_margin, (int, float)) else "")
    return (f"The base model barely preferred the right answer on {n_weakly_held} of the "
            f"{n_flipped} flipped items{margin_text}: such items tip under almost any fine-tune, so "
            "the data may have triggered the loss rather than caused it.")


def _proxy_metric(metric: str | None) -> str:
    return (f"'{metric}' scores likelihood, not correctness: a fine-tune that teaches the answer format "
            "can raise it while answers get worse, so read its direction with care.")


def _engine_disagreement(spearman: float) -> str:
    return (f"The two engines agree only at Spearman {spearman:.3f}: treat the ranking as a hypothesis "
            "and confirm it by retraining without the accused examples.")


def _no_cross_check() -> str:
    return "No second engine cross-checked this ranking, so nothing confirms it."


def _gated() -> str:
    return ("The capability change did not clear the significance gate: the influence scores rank examples "
            "against noise and are not a diagnosis.")


def _no_target() -> str:
    return ("No capability was named (no eval set): the scores point at the first training examples instead "
            "of a measured loss, so this is a smoke test, not a diagnosis.")


def _checks_skipped(n_skipped: int, n_checks: int) -> str:
    return (f"{n_skipped} of {n_checks} checks were skipped (missing inputs or values); `skipped` "
            "says why.")


#: each hedge code's wording, called with the hedge's figures as keyword arguments
_HEDGE_WORDS: dict[str, Callable[..., str]] = {
    "repeated_items": _repeated_items,
    "base_failing": _base_failing,
    "low_base": _low_base,
    "weakly_held": _weakly_held,
    "proxy_metric": _proxy_metric,
    "engine_disagreement": _engine_disagreement,
    "no_cross_check": _no_cross_check,
    "gated": _gated,
    "no_target": _no_target,
    "checks_skipped": _checks_skipped,
}


def render_hedge(h: "Hedge") -> str:
    """One qualifier in words; ``h.code`` says which, ``h.figures`` holds what it cites."""
    words = _HEDGE_WORDS.get(h.code)
    if words is None:
        raise ValueError(f"no wording for hedge code {h.code!r}; add it to render_hedge")
    return words(**h.figures)
