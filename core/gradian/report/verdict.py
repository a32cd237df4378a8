"""Verdict synthesis: join the audit, the capability measurement and the attribution into one call.

``synthesize_verdict(capability, findings, attribution, thresholds)`` returns the report's
``verdict`` ({kind, summary, hedges, accused_cluster, accused_set_n}) and the ``attribution.*`` findings it
raises. ``build_report`` builds the typed ``Report`` around it (``gradian.report.schema``);
``assemble_report`` the same from plain dicts.

The kinds, decided in this order:

1. a critical audit finding exists: it leads and must be fixed first. The kind follows the
   categories of the critical findings (``data``, ``config``, or ``mixed`` for both, or when the
   attribution also accuses a cluster beside a config-only critical finding).
2. no capability target (``capability`` is None): the audit's high/critical findings decide
   (``config``/``data``/``mixed``), else ``inconclusive``; influence scores without a target are a
   smoke test, never a verdict.
3. the capability did not regress significantly: ``no_regression``.
4. it regressed but attribution did not run (or ran ungated): the audit decides as in 2.
5. it regressed and attribution ran: a *lumpy* distribution (``VerdictThresholds``: one cluster
   carries most of the harm at a much higher per-example rate, and is not most of the dataset)
   is ``data`` (``mixed`` beside a high config finding) naming the cluster; a flat distribution
   beside config or dynamics findings is ``config`` and offers nothing for deletion; a flat one
   beside high data findings is ``data`` (the audit's rows, not a cluster); otherwise
   ``inconclusive``.

Beside an accused cluster, the attribution's ``accused`` set (``gradian.cluster.refine_accused``:
the rows inside the cluster whose harm stands out) is kept and named in the summary; an accused set
for any other cluster, or with no cluster accused, is dropped from the report with its spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gradian.findings import Finding, severity_rank

if TYPE_CHECKING:
    from gradian.report.schema import Attribution, Capability, Manifest, Report

__all__ = ["VerdictSynthesis", "VerdictThresholds", "assemble_report", "assess_lumpiness", "build_report",
           "synthesize_verdict"]

_CONFIG_CATEGORIES = ("config", "dynamics")


@dataclass(frozen=True)
class VerdictThresholds:
    """Every number the verdict depends on, with its default and why."""

    data_min_share: float = field(default=0.5, metadata={"help": (
        "The accused cluster must carry at least this share of the harm: the larger of its share of "
        "all negative scores and its share of the net harm of the net-harmful clusters")})
    data_min_rate_ratio: float = field(default=5.0, metadata={"help": (
        "Its mean score per example must be at least this many times the rest's (infinite when the "
        "rest is net helpful); a cluster that wins only on size is not lumpy")})
    data_max_cluster_fraction: float = field(default=0.5, metadata={"help": (
        "A cluster holding more than this share of the dataset is the dataset, not a subset to blame")})
    engine_agreement_moderate: float = field(default=0.8, metadata={"help": (
        "Cross-check Spearman below this raises attribution.engine_disagreement (medium) and a hedge")})
    engine_agreement_low: float = field(default=0.5, metadata={"help": (
        "Below this the engine disagreement finding is high: at least one engine's approximation fails")})
    low_base_score: float = field(default=0.5, metadata={"help": (
        "Pass/fail metrics: a base score below this means the capability was mostly absent before "
        "training (used when the capability block carries no low_base_score flag)")})
    config_min_severity: str = field(default="medium", metadata={"help": (
        "Config/dynamics findings at least this severe make a flat distribution a config verdict")})
    mixed_config_min_severity: str = field(default="high", metadata={"help": (
        "Config/dynamics findings at least this severe turn a lumpy data verdict into mixed")})
    overlap_top_k: int = field(default=5, metadata={"help": (
        "How many top harmful examples are compared with the data findings' rows")})

    def __post_init__(self) -> None:
        for name in ("data_min_share", "data_max_cluster_fraction"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"VerdictThresholds.{name}={value!r} must lie in (0, 1]")
        if self.data_min_rate_ratio < 1.0:
            raise ValueError(f"VerdictThresholds.data_min_rate_ratio={self.data_min_rate_ratio!r} must be >= 1")
        if not self.engine_agreement_low <= self.engine_agreement_moderate:
            raise ValueError("VerdictThresholds.engine_agreement_low must not exceed engine_agreement_moderate")
        severity_rank(self.config_min_severity)
        severity_rank(self.mixed_config_min_severity)


@dataclass
class VerdictSynthesis:
    """The ``verdict`` block, the ``attribution.*`` findings raised, and what the report may offer."""

    verdict: dict[str, Any]
    findings: list[Finding]
    accused_cluster: str | None = None
    offer_deletions: bool = False
    lumpiness: dict[str, Any] | None = None


# -- small readers ------------------------------------------------------------------------------


def _finding(f: Finding | Mapping[str, Any]) -> Finding:
    return f if isinstance(f, Finding) else Finding.from_dict(dict(f))


def _capability_dict(capability: Any) -> dict[str, Any] | None:
    if capability is None:
        return None
    if hasattr(capability, "to_full_dict"):
        return capability.to_full_dict()
    return dict(capability)


def _ids(findings: Sequence[Finding]) -> str:
    return ", ".join(dict.fromkeys(f.id for f in findings))


def _fmt(x: Any, digits: int = 4) -> str:
    return f"{x:+.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _capability_sentence(cap: Mapping[str, Any]) -> str:
    lo, hi = (cap.get("ci") or [float("nan"), float("nan")])[:2]
    text = (
        f"'{cap.get('name')}' ({cap.get('metric')}) went {cap.get('base', float('nan')):.4f} -> "
        f"{cap.get('tuned', float('nan')):.4f} (delta {_fmt(cap.get('delta'))}, 95% CI "
        f"[{_fmt(lo)}, {_fmt(hi)}]) over {cap.get('n_items')} items"
    )
    if not cap.get("proxy_used") and cap.get("n_flipped") is not None:
        text += f"; {cap.get('n_flipped')} flipped from right to wrong"
    return text + "."


def _ratio_text(ratio: float | None) -> str:
    """``ratio`` None or infinite: the rest of the data is net helpful."""
    return "with the rest net helpful" if ratio is None or math.isinf(ratio) else f"{ratio:.0f}x the rest's rate"


# -- lumpiness ----------------------------------------------------------------------------------


def assess_lumpiness(clusters: Sequence[Mapping[str, Any]], thresholds: VerdictThresholds) -> dict[str, Any]:
    """Is the harm concentrated in one cluster? Returns the candidate and the numbers behind the call.

    The candidate is the cluster (HDBSCAN noise excluded: it is no group) with the largest share of
    negative influence among those with a negative mean. ``lumpy`` when its harm share, its
    per-example rate against the rest's and its size all pass ``thresholds``.
    """
    from gradian.cluster import NOISE

    clusters = list(clusters)
    total_n = sum(int(c["n"]) for c in clusters)
    total_signed = sum(float(c["signed_influence"]) for c in clusters)
    net_harm = sum(float(c["signed_influence"]) for c in clusters if c["signed_influence"] < 0)
    candidates = [c for c in clusters if c["mean_per_example"] < 0 and str(c["cluster"]) != NOISE]
    out: dict[str, Any] = {"lumpy": False, "cluster": None, "n_clusters": len(clusters), "n_examples": total_n}
    if not candidates or total_n == 0:
        out["reason"] = "no cluster has a negative mean score: nothing in the data degraded the capability"
        return out
    top = max(candidates, key=lambda c: (c["share_of_negative"], -c["mean_per_example"]))
    n = int(top["n"])
    rest_n = total_n - n
    net_share = float(top["signed_influence"]) / net_harm if net_harm < 0 else 0.0
    share = max(float(top["share_of_negative"]), net_share)
    rest_mean = (total_signed - float(top["signed_influence"])) / rest_n if rest_n else None
    if rest_mean is None:
        ratio = 1.0
    elif rest_mean >= 0:
        ratio = math.inf
    else:
        ratio = float(top["mean_per_example"]) / rest_mean
    fraction = n / total_n
    out.update(cluster=str(top["cluster"]), label=top.get("label", ""), n=n, share=share,
               share_of_negative=float(top["share_of_negative"]), net_harm_share=net_share,
               mean_per_example=float(top["mean_per_example"]), rest_mean_per_example=rest_mean,
               rate_ratio=None if math.isinf(ratio) else ratio, rest_net_helpful=math.isinf(ratio),
               fraction_of_dataset=fraction)
    if rest_n == 0:
        out["reason"] = f"one cluster holds all {total_n} examples, so no subset stands out"
    elif fraction > thresholds.data_max_cluster_fraction:
        out["reason"] = (f"cluster {top['cluster']} holds {fraction:.0%} of the dataset: it is most of "
                         "the data, not a subset")
    elif share < thresholds.data_min_share:
        out["reason"] = f"the most harmful cluster ({top['cluster']}) carries only {share:.0%} of the harm"
    elif ratio < thresholds.data_min_rate_ratio:
        out["reason"] = (f"cluster {top['cluster']} harms at {ratio:.1f}x the rest's per-example rate, "
                         f"below {thresholds.data_min_rate_ratio:g}x: it wins on size, not on rate")
    else:
        out["lumpy"] = True
        out["reason"] = (f"cluster {top['cluster']} carries {_share_text(out)} at "
                         f"{top['mean_per_example']:.4g} per example ({_ratio_text(ratio)})")
    return out


def _share_text(lump: Mapping[str, Any]) -> str:
    """Both views of the harm share, named: per-example negatives, and net cluster sums."""
    text = f"{lump['share_of_negative']:.0%} of the negative influence"
    if lump.get("net_harm_share") and abs(lump["net_harm_share"] - lump["share_of_negative"]) >= 0.005:
        text += f" ({lump['net_harm_share']:.0%} of the net harm of harmful clusters)"
    return text


def _matching_accused(attribution: Mapping[str, Any] | None, cluster: str | None) -> Mapping[str, Any] | None:
    """The attribution's accused set when it refines the cluster the verdict accuses."""
    accused = (attribution or {}).get("accused")
    if cluster is None or not accused or str(accused.get("cluster")) != str(cluster):
        return None
    return accused


def _accused_text(accused: Mapping[str, Any]) -> str:
    """One sentence on the accused set: how many rows, how much of the harm, what is left out."""
    n, total = int(accused["n"]), int(accused["cluster_n"])
    if n >= total:
        return (f"The whole cluster is the accused set ({total} rows, an estimated "
                f"{accused['estimated_harmful_share']:.0%} of them harmful).")
    rest = accused.get("left_out_mean_per_example")
    rest_text = f" (mean {rest:.4g})" if isinstance(rest, (int, float)) else ""
    return (f"Inside it, the accused set is {n} of its {total} rows: they carry "
            f"{accused['share_of_cluster_harm']:.0%} of the cluster's harm at {accused['mean_per_example']:.4g} "
            f"per example, an estimated {accused['estimated_harmful_share']:.0%} of them harmful; the other "
            f"{total - n} rows{rest_text} are left out.")


# -- attribution findings -----------------------------------------------------------------------


def _members(cluster: str, attribution: Mapping[str, Any], assignment: Any) -> set[str] | None:
    if assignment is not None:
        labels = assignment.labels if hasattr(assignment, "labels") else assignment
        return {eid for eid, key in labels.items() if str(key) == cluster}
    return None


def _defect_overlap(cluster: str, attribution: Mapping[str, Any], data_findings: Sequence[Finding],
                    assignment: Any, thresholds: VerdictThresholds) -> Finding | None:
    members = _members(cluster, attribution, assignment)
    top = [r["example_id"] for r in (attribution.get("top_harmful") or [])][: thresholds.overlap_top_k]
    listed = {r["example_id"] for r in attribution.get("top_harmful") or [] if str(r.get("cluster")) == cluster}
    listed |= {r["example_id"] for c in attribution.get("clusters") or []
               if str(c["cluster"]) == cluster for r in c.get("top_examples") or []}
    accused = members if members is not None else listed
    hits = []
    for f in data_findings:
        rows = set(f.example_ids)
        in_cluster = sorted(rows & accused)
        in_top = [e for e in top if e in rows]
        if in_cluster or in_top:
            hits.append((f, in_cluster, in_top))
    if not hits:
        return None
    parts, fixes = [], []
    for f, in_cluster, in_top in hits:
        where = f"{len(in_cluster)} of the cluster's examples" if members is not None else \
            f"{len(in_cluster)} of its listed examples"
        parts.append(f"{where} and {len(in_top)} of the top {len(top)} harmful examples also trip "
                     f"{f.id} ({f.title})")
        if f.fix:
            fixes.append(f"{f.id}: {f.fix}")
    ids = sorted({e for _, c, t in hits for e in list(c) + list(t)})
    return Finding(
        id="attribution.cluster_matches_data_defect",
        category="attribution",
        severity="medium",
        title=f"The accused cluster {cluster} overlaps the {_ids([h[0] for h in hits])} finding",
        message=(
            "; ".join(parts) + ". Two independent signals point at the same rows. Those rows carry a "
            "mechanical defect on top of whatever the cluster teaches: repairing the defect (the "
            "audit's fix) and removing or rewriting the cluster's content (the attribution's fix) "
            "are different changes, and the second may still be needed after the first."
        ),
        evidence={"cluster": cluster, "findings": [h[0].id for h in hits],
                  "n_in_cluster": {h[0].id: len(h[1]) for h in hits},
                  "n_in_top_harmful": {h[0].id: len(h[2]) for h in hits}, "top_k": len(top)},
        example_ids=ids[:50],
        fix=" ".join(fixes) or "Fix the mechanical defect first, retrain, and attribute again.",
    )


def _engine_finding(attribution: Mapping[str, Any], thresholds: VerdictThresholds) -> Finding | None:
    rho = attribution.get("engine_agreement_spearman")
    if rho is None or not isinstance(rho, (int, float)) or math.isnan(rho):
        return None
    if rho >= thresholds.engine_agreement_moderate:
        return None
    low = rho < thresholds.engine_agreement_low
    engine, other = attribution.get("engine", "the engine"), attribution.get("cross_check", "the cross-check")
    return Finding(
        id="attribution.engine_disagreement",
        category="attribution",
        severity="high" if low else "medium",
        title=f"{engine} and {other} rank the examples {'differently' if low else 'only moderately alike'} "
              f"(Spearman {rho:.3f})",
        message=(
            f"The second engine ({other}) scored the same run and its ranking agrees with {engine}'s at "
            f"Spearman {rho:.3f}, below {thresholds.engine_agreement_moderate:g}. When two approximations "
            "of the same influence disagree, at least one does not hold on this run; the ranking is "
            "indicative, not settled."
        ),
        evidence={"spearman": rho, "engine": engine, "cross_check": other,
                  "moderate_threshold": thresholds.engine_agreement_moderate,
                  "low_threshold": thresholds.engine_agreement_low},
        fix="Confirm by retraining without the accused examples before deleting data; a larger "
            "projection dimension or more damping can bring the engines closer.",
    )


def _is_low_base(cap: Mapping[str, Any], thresholds: VerdictThresholds) -> bool:
    if "low_base_score" in cap:
        return bool(cap["low_base_score"])
    return (not cap.get("proxy_used")) and isinstance(cap.get("base"), (int, float)) \
        and cap["base"] < thresholds.low_base_score


def _hedges(cap: Mapping[str, Any] | None, attribution: Mapping[str, Any] | None,
            thresholds: VerdictThresholds) -> list[str]:
    out: list[str] = []
    if cap is not None:
        if cap.get("n_base_failing"):
            out.append(
                f"{cap['n_base_failing']} of {cap.get('n_items')} eval items fail on the base model too; "
                "no training example can be blamed for those, and they are counted apart."
            )
        if _is_low_base(cap, thresholds):
            out.append(
                f"The base model scored only {cap.get('base', float('nan')):.4g} before training: the "
                "capability was mostly absent to begin with, so a data explanation accounts for little."
            )
        if cap.get("n_weakly_held"):
            margin = cap.get("mean_base_margin")
            margin_text = f", mean margin {margin:+.2f} nats" if isinstance(margin, (int, float)) else ""
            out.append(
                f"The base model barely preferred the right answer on {cap['n_weakly_held']} of the "
                f"{cap.get('n_flipped')} flipped items{margin_text}: such items tip under almost any "
                "fine-tune, so the data may have triggered the loss rather than caused it."
            )
        if cap.get("proxy_used"):
            out.append(
                f"'{cap.get('metric')}' scores likelihood, not correctness: a fine-tune that teaches the "
                "answer format can raise it while answers get worse, so read its direction with care."
            )
    if attribution is not None:
        rho = attribution.get("engine_agreement_spearman")
        if isinstance(rho, (int, float)) and not math.isnan(rho):
            if rho < thresholds.engine_agreement_moderate:
                out.append(
                    f"The two engines agree only at Spearman {rho:.3f}: treat the ranking as a "
                    "hypothesis and confirm it by retraining without the accused examples."
                )
        else:
            out.append("No second engine cross-checked this ranking, so nothing confirms it.")
        if attribution.get("gated"):
            out.append(
                "The capability change did not clear the significance gate: the influence scores rank "
                "examples against noise and are not a diagnosis."
            )
        if cap is None:
            out.append(
                "No capability was named (no eval set): the scores point at the first training examples "
                "instead of a measured loss, so this is a smoke test, not a diagnosis."
            )
    return out


# -- the verdict --------------------------------------------------------------------------------


def _kind_of(findings: Sequence[Finding]) -> str | None:
    kinds = {"data" if f.category == "data" else "config" for f in findings}
    return "mixed" if len(kinds) > 1 else (kinds.pop() if kinds else None)


def synthesize_verdict(capability: Any, findings: Sequence[Finding | Mapping[str, Any]],
                       attribution: Mapping[str, Any] | None,
                       thresholds: VerdictThresholds | None = None,
                       assignment: Any = None) -> VerdictSynthesis:
    """Decide the verdict (see the module docstring) and raise the ``attribution.*`` findings.

    ``capability`` is the report's capability block (``CapabilityResult.to_full_dict()`` gives the
    hedging flags; ``to_dict()`` works with fewer hedges) or a ``CapabilityResult``; ``findings`` the
    audit's (and the gate's) findings; ``attribution`` the report's attribution block, or None when
    attribution did not run. ``assignment`` (a ``ClusterAssignment`` or ``{id: cluster}``) lets the
    defect overlap count every member of the accused cluster, not only the listed ones.
    """
    t = thresholds or VerdictThresholds()
    cap = _capability_dict(capability)
    given = [_finding(f) for f in findings]
    given_ids = {f.id for f in given}
    audit = [f for f in given if f.category != "attribution"]
    critical = [f for f in audit if f.severity == "critical"]
    serious = [f for f in audit if f.at_least("high")]
    config_findings = [f for f in audit if f.category in _CONFIG_CATEGORIES and f.at_least(t.config_min_severity)]
    high_config = [f for f in audit if f.category in _CONFIG_CATEGORIES and f.at_least(t.mixed_config_min_severity)]
    data_high = [f for f in audit if f.category == "data" and f.at_least("high")]
    data_rows = [f for f in audit if f.category == "data" and f.example_ids]

    raised: list[Finding] = []
    status = cap.get("status") if cap else None
    gated = bool(attribution.get("gated")) if attribution is not None else False
    if attribution is not None:
        if cap is None and "attribution.no_capability_target" not in given_ids:
            raised.append(Finding(
                id="attribution.no_capability_target", category="attribution", severity="medium",
                title="No capability target: attribution ran against training examples, not a regression",
                message="No eval set named the capability, so the query was built from the first few "
                        "training examples. The scores show which rows resemble those, not which rows "
                        "broke anything.",
                fix="Pass --eval-dataset with items the base model answers right and the tuned model "
                    "gets wrong, and --capability to name them.",
            ))
        if gated and "attribution.gate_failed" not in given_ids:
            raised.append(Finding(
                id="attribution.gate_failed", category="attribution", severity="high",
                title="Attribution ran without a significant regression",
                message="The capability change did not clear the significance gate, but influence scores "
                        "were computed anyway; they are not a diagnosis.",
                evidence={"status": status},
                fix="Add eval items or use a metric that measures correctness, then attribute again.",
            ))
        engine = _engine_finding(attribution, t)
        if engine is not None:
            raised.append(engine)

    usable = attribution is not None and not gated and cap is not None and status == "regressed"
    lump = assess_lumpiness(attribution.get("clusters") or [], t) if attribution is not None else None
    lumpy = bool(usable and lump and lump["lumpy"])
    accused = lump["cluster"] if lumpy else None

    if usable and cap is not None and _is_low_base(cap, t) and "attribution.low_base_score" not in given_ids:
        raised.append(Finding(
            id="attribution.low_base_score", category="attribution", severity="high",
            title=f"The base model scored only {cap.get('base', float('nan')):.4g} on '{cap.get('name')}'",
            message="The capability was largely absent before the fine-tune, so what the data ranking "
                    "explains is small; findings about the training setup carry more weight here.",
            evidence={"base": cap.get("base"), "metric": cap.get("metric")},
            fix="Describe the capability with items the base model already gets right.",
        ))
    if accused is not None and data_rows:
        overlap = _defect_overlap(accused, attribution or {}, data_rows, assignment, t)
        if overlap is not None:
            raised.append(overlap)

    cap_text = _capability_sentence(cap) if cap else ""
    cluster_text = ""
    if lumpy and lump:
        label = f" ({lump['label']})" if lump.get("label") else ""
        rest = lump["rest_mean_per_example"]
        cluster_text = (
            f"Cluster {accused}{label} carries {_share_text(lump)}: "
            f"{lump['n']} examples at {lump['mean_per_example']:.4g} per example against "
            f"{rest:.4g} for the rest ({_ratio_text(lump['rate_ratio'])})."
        )
        accused_set = _matching_accused(attribution, accused)
        if accused_set is not None:
            cluster_text += " " + _accused_text(accused_set)
    rho = attribution.get("engine_agreement_spearman") if attribution else None
    engine_text = (f" Engine agreement (Spearman, {attribution.get('engine')} vs "
                   f"{attribution.get('cross_check')}): {rho:.3f}." if isinstance(rho, (int, float)) else "")
    offer = lumpy

    if critical:
        kind = _kind_of(critical) or "config"
        if lumpy and kind == "config":
            kind = "mixed"
        summary = (f"{len(critical)} critical issue(s) invalidate or dominate this run and must be fixed "
                   f"before anything else is read: {_ids(critical)}.")
        if cap_text:
            summary += " " + cap_text
        if cluster_text:
            summary += " Beyond that, " + cluster_text[0].lower() + cluster_text[1:]
        elif usable:
            summary += " No cluster stands out in the influence scores; nothing is offered for deletion."
    elif cap is None:
        kind = _kind_of(serious) or "inconclusive"
        summary = ("No capability was measured, so nothing is attributed to the data. " if attribution is not None
                   else "")
        summary += (f"The audit names {len(serious)} high-severity cause(s): {_ids(serious)}." if serious
                    else "No high or critical audit finding explains a regression.")
    elif status != "regressed":
        kind = "no_regression"
        what = "improved" if status == "improved" else "did not change significantly"
        summary = f"'{cap.get('name')}' {what}: {cap_text} There is no regression to attribute."
        if serious:
            summary += f" The audit still raised: {_ids(serious)}."
    elif attribution is None:
        kind = _kind_of(serious) or "inconclusive"
        gate = next((f for f in given if f.id == "attribution.gate_failed"), None)
        summary = f"{cap_text} Attribution did not run" + (f" ({gate.title}); " if gate is not None else "; ")
        summary += (f"the audit names {_ids(serious)}." if serious
                    else "no high or critical audit finding explains the change.")
    elif lumpy:
        kind = "mixed" if high_config else "data"
        summary = f"{cap_text} {cluster_text}"
        if high_config:
            summary += f" The training setup is also at fault: {_ids(high_config)}."
    elif config_findings:
        kind = "config"
        lead = sorted(config_findings, key=lambda f: severity_rank(f.severity))[0]
        summary = (f"{cap_text} The harm is spread flatly over the data ({lump['reason'] if lump else ''}), "
                   "which is how a training-setting fault looks, not bad rows; no examples are offered for "
                   f"deletion. The audit names the cause: {lead.id} ({lead.title})"
                   + (f", with {_ids([f for f in config_findings if f is not lead])}" if len(config_findings) > 1 else "")
                   + ".")
    elif data_high:
        kind = "data"
        summary = (f"{cap_text} No cluster stands out ({lump['reason'] if lump else ''}), but the audit "
                   f"found data defects: {_ids(data_high)}. Fix those rows first.")
    else:
        kind = "inconclusive"
        summary = (f"{cap_text} No cluster stands out ({lump['reason'] if lump else 'no clusters'}) and no "
                   "audit finding explains the regression.")
    summary = (summary + engine_text).strip()

    accused_set = _matching_accused(attribution, accused)
    verdict = {"kind": kind, "summary": summary, "hedges": _hedges(cap, attribution, t),
               "accused_cluster": accused,
               "accused_set_n": int(accused_set["n"]) if accused_set is not None else None}
    return VerdictSynthesis(verdict=verdict, findings=raised, accused_cluster=accused,
                            offer_deletions=offer, lumpiness=lump)


def assemble_report(capability: Any, findings: Sequence[Finding | Mapping[str, Any]],
                    attribution: Mapping[str, Any] | None, manifest: Mapping[str, Any] | None = None,
                    thresholds: VerdictThresholds | None = None, assignment: Any = None,
                    skipped: Sequence[Any] | None = None) -> dict[str, Any]:
    """The report.json dict from plain dicts: capability, findings (most severe first), attribution,
    verdict, manifest. For hand-built blocks (tests, notebooks); the commands build a typed
    ``Report`` with ``build_report``, which shares the steps below.

    When the verdict offers nothing for deletion, ``attribution.top_harmful`` is emptied and
    ``attribution.deletions_withheld`` says why (every score stays in the rankings table).
    """
    synthesis = synthesize_verdict(capability, findings, attribution, thresholds, assignment)
    report: dict[str, Any] = {
        "capability": _capability_dict(capability),
        "findings": [f.to_dict() for f in _ordered_findings(findings, synthesis)],
        "attribution": _finish_attribution(attribution, synthesis),
        "verdict": synthesis.verdict,
        "manifest": dict(manifest or {}),
    }
    if skipped is not None:
        report["skipped"] = [s.to_dict() if hasattr(s, "to_dict") else dict(s) for s in skipped]
    return report


def build_report(capability: "Capability | None", findings: Sequence[Finding], attribution: "Attribution | None",
                 manifest: "Manifest", thresholds: VerdictThresholds | None = None, assignment: Any = None,
                 skipped: Sequence[Any] | None = None) -> "Report":
    """The typed ``Report`` of an attribution run: the verdict decided over the blocks given, its
    ``attribution.*`` findings added, the attribution finished as in ``assemble_report``."""
    from gradian.report.schema import Attribution, Report, ReportFinding, SkippedCheckRow, Verdict

    cap = capability.to_json() if capability is not None else None
    attr = attribution.to_json() if attribution is not None else None
    synthesis = synthesize_verdict(cap, findings, attr, thresholds, assignment)
    finished = _finish_attribution(attr, synthesis)
    return Report(
        capability=capability,
        findings=[ReportFinding.of(f) for f in _ordered_findings(findings, synthesis)],
        attribution=Attribution.from_json(finished, "attribution") if finished is not None else None,
        verdict=Verdict.from_json(synthesis.verdict, "verdict"),
        manifest=manifest,
        skipped=None if skipped is None else [
            SkippedCheckRow.from_json(s.to_dict() if hasattr(s, "to_dict") else dict(s), "skipped[]") for s in skipped],
    )


def _ordered_findings(findings: Sequence[Finding | Mapping[str, Any]], synthesis: VerdictSynthesis) -> list[Finding]:
    """The lanes' findings and the verdict's, most severe first (stable: lanes keep their order)."""
    out = [_finding(f) for f in findings] + synthesis.findings
    out.sort(key=lambda f: severity_rank(f.severity))
    return out


def _finish_attribution(attribution: Mapping[str, Any] | None, synthesis: VerdictSynthesis) -> dict[str, Any] | None:
    """The attribution block as reported: its lumpiness, the accused set only beside the cluster
    it refines, and no deletion list when the verdict offers none."""
    if attribution is None:
        return None
    attr = dict(attribution)
    attr["lumpiness"] = synthesis.lumpiness
    # the accused set exists only beside an accused cluster it refines
    attr["accused"] = _matching_accused(attr, synthesis.accused_cluster)
    if attr["accused"] is None:
        attr["spans"] = []
    if not synthesis.offer_deletions and attr.get("top_harmful"):
        attr["top_harmful"] = []
        attr["deletions_withheld"] = (
            "No cluster carries the harm at a distinctly higher rate"
            + (f" ({synthesis.lumpiness['reason']})" if synthesis.lumpiness else "")
            + "; deleting the highest-scoring rows would not address the cause."
        )
        for c in attr.get("clusters") or []:
            c["top_examples"] = []
    return attr
