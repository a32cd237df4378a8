"""The verdict as data: which kind, by which rule, on what evidence (no words but the figures').

``decide_verdict(capability, findings, attribution, thresholds)`` is the decision, a pure function
over the typed blocks (``gradian.report.schema``; a report.json dict or a ``CapabilityResult`` is
parsed once on entry) returning a ``VerdictDecision``: the kind, the rule that decided it, the
accused cluster and set, the figures the prose cites and the hedges as codes with their figures.
``attribution_findings`` are the ``attribution.*`` findings a decision raises. The prose that words
a decision is ``gradian.report.verdict_prose``; the report assembled around both is
``gradian.report.verdict``. The audit alone (``gradian.audit.audit_verdict``) is decided by the
same function with no capability and no attribution.

The rules (``VerdictDecision.rule``), decided in this order:

1. ``critical``: a critical audit finding exists: it leads and must be fixed first. The kind follows
   the categories of the critical findings (``data``, ``config``, or ``mixed`` for both, or when the
   attribution also accuses a cluster beside a config-only critical finding).
2. ``no_target``: no capability target (``capability`` is None): the audit's high/critical findings
   decide (``config``/``data``/``mixed``), else ``inconclusive``; influence scores without a target
   are a smoke test, never a verdict.
3. ``no_regression``: the capability did not regress significantly.
4. ``not_attributed``: it regressed but attribution did not run: the audit decides as in 2.
5. it regressed and attribution ran: a *lumpy* distribution (``VerdictThresholds``: one cluster
   carries most of the harm at a much higher per-example rate, and is not most of the dataset)
   is ``lumpy``, kind ``data`` (``mixed`` beside a high config finding) naming the cluster; a flat
   distribution beside config or dynamics findings is ``flat_config``, kind ``config``, and offers
   nothing for deletion; a flat one beside high data findings is ``flat_data``, kind ``data`` (the
   audit's rows, not a cluster); otherwise ``unexplained``, kind ``inconclusive``. Scores that did
   not clear the significance gate never accuse a cluster.

Beside an accused cluster, the attribution's ``accused`` set (``gradian.cluster.refine_accused``:
the rows inside the cluster whose harm stands out) is kept and named in the summary; an accused set
for any other cluster, or with no cluster accused, is dropped from the report with its spans.

The low-base flag is the capability's own (``low_base_score``, set by the evaluate lane against
``gradian.evaluate.LOW_BASE_SCORE``); the gate's finding is the evaluate lane's
(``gradian.evaluate.gate_attribution``). Neither is recomputed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence, Union

from gradian.config.verdict import VerdictConfig as VerdictThresholds
from gradian.findings import Finding, severity_rank
from gradian.report.schema import (
    Accused,
    Attribution,
    Capability,
    ClusterRow,
    Harm,
    Lumpiness,
)
from gradian.report.tables import AssignmentInput

if TYPE_CHECKING:
    from gradian.evaluate.result import CapabilityResult

__all__ = ["AttributionInput", "CapabilityFigures", "CapabilityInput", "EngineAgreement", "Hedge", "VerdictDecision",
           "VerdictKind", "VerdictRule", "VerdictThresholds", "as_finding", "assess_lumpiness", "attribution_block",
           "attribution_findings", "capability_block", "decide_verdict", "harm_of", "lumpiness_of", "matching_accused",
           "ranked_lumpiness",
           "ratio_text", "share_text"]

#: what the verdict takes as the capability: the typed block, the evaluate lane's result, or report.json's dict
CapabilityInput = Union[Capability, "CapabilityResult", Mapping[str, object], None]
#: what it takes as the attribution: the typed block or report.json's dict
AttributionInput = Union[Attribution, Mapping[str, object], None]

VerdictKind = Literal["data", "config", "mixed", "inconclusive", "no_regression"]
VerdictRule = Literal["critical", "no_target", "no_regression", "not_attributed", "lumpy", "flat_config",
                      "flat_data", "unexplained"]

_CONFIG_CATEGORIES = ("config", "dynamics")


# -- the decision, as data ---------------------------------------------------------------------


@dataclass(frozen=True)
class Hedge:
    """A qualifier on the verdict: ``code`` names it, ``figures`` are the numbers it cites.

    Codes: ``repeated_items``, ``base_failing``, ``low_base``, ``weakly_held``, ``proxy_metric`` (from the capability),
    ``engine_disagreement``, ``no_cross_check``, ``gated``, ``no_target`` (from the attribution),
    ``checks_skipped`` (from the audit).
    """

    code: str
    figures: Mapping[str, float | str | None] = field(default_factory=dict)


@dataclass(frozen=True)
class CapabilityFigures:
    """What the prose cites of the measured capability: the scores before and after, in the metric's units."""

    name: str | None
    metric: str | None
    base: float
    tuned: float
    delta: float | None
    ci: tuple[float, float]
    n_items: int | None
    n_flipped: int | None
    proxy_used: bool
    status: str | None

    @classmethod
    def of(cls, cap: Capability) -> "CapabilityFigures":
        nan = float("nan")
        lo, hi = (list(cap.ci or []) + [nan, nan])[:2]
        return cls(name=cap.name, metric=cap.metric, base=_number(cap.base), tuned=_number(cap.tuned),
                   delta=cap.delta, ci=(lo, hi), n_items=cap.n_items, n_flipped=cap.n_flipped,
                   proxy_used=bool(cap.proxy_used), status=cap.status)


@dataclass(frozen=True)
class EngineAgreement:
    """The cross-check: Spearman rank correlation of the two engines' scores, in [-1, 1]."""

    engine: str | None
    cross_check: str | None
    spearman: float


@dataclass(frozen=True)
class VerdictDecision:
    """The verdict as data: which kind, by which rule, on what evidence; ``render_verdict`` words it."""

    kind: VerdictKind
    rule: VerdictRule
    accused_cluster: str | None = None
    accused_set_n: int | None = None
    offer_deletions: bool = False
    attribution_ran: bool = False
    attributed: bool = field(default=False, metadata={"help": (
        "attribution ran on a significant regression with a capability target: its clusters can accuse")})
    critical_ids: tuple[str, ...] = ()
    serious_ids: tuple[str, ...] = field(default=(), metadata={"help": "audit findings at high or critical"})
    config_ids: tuple[str, ...] = field(default=(), metadata={"help": (
        "config/dynamics findings at thresholds.config_min_severity, the most severe (the lead) first")})
    lead_config_title: str | None = None
    high_config_ids: tuple[str, ...] = ()
    data_high_ids: tuple[str, ...] = ()
    gate_title: str | None = None
    capability: CapabilityFigures | None = None
    lumpiness: Lumpiness | None = None
    accused_set: Accused | None = None
    engine_agreement: EngineAgreement | None = None
    low_base: bool = False
    hedges: tuple[Hedge, ...] = ()
    harm: Harm | None = field(default=None, metadata={"help": (
        "the accused cluster's and set's harm in the query loss's units (harm_of)")})


# -- small readers ------------------------------------------------------------------------------


def _number(x: object) -> float:
    return float(x) if isinstance(x, (int, float)) else float("nan")


def as_finding(f: Finding | Mapping[str, object]) -> Finding:
    return f if isinstance(f, Finding) else Finding.from_dict(dict(f))


def capability_block(capability: CapabilityInput) -> Capability | None:
    """The typed capability block: as given, parsed from report.json's dict, or from a
    ``CapabilityResult`` (``to_full_dict()``, with the hedging flags)."""
    if capability is None or isinstance(capability, Capability):
        return capability
    if isinstance(capability, Mapping):
        return Capability.from_json(capability, "capability")
    return Capability.of(capability)


def attribution_block(attribution: AttributionInput) -> Attribution | None:
    """The typed attribution block: as given, or parsed from report.json's dict."""
    if attribution is None or isinstance(attribution, Attribution):
        return attribution
    return Attribution.from_json(attribution, "attribution")


def _ids(findings: Sequence[Finding]) -> str:
    return ", ".join(_id_tuple(findings))


def _id_tuple(findings: Sequence[Finding]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f.id for f in findings))


def _spearman(attribution: Attribution | None) -> float | None:
    """The cross-check's Spearman, None when there was none (or it could not be computed)."""
    rho = attribution.engine_agreement_spearman if attribution is not None else None
    if not isinstance(rho, (int, float)) or math.isnan(rho):
        return None
    return float(rho)


# -- lumpiness ----------------------------------------------------------------------------------


def assess_lumpiness(clusters: Sequence[ClusterRow | Mapping[str, object]], thresholds: VerdictThresholds
                     ) -> dict[str, Any]:
    """``lumpiness_of`` over a cluster table (``cluster_table`` rows or ``ClusterRow`` blocks), as
    the report's ``lumpiness`` dict."""
    rows = [c if isinstance(c, ClusterRow) else ClusterRow.from_json(c, f"clusters[{i}]")
            for i, c in enumerate(clusters)]
    return lumpiness_of(rows, thresholds).to_json()


def lumpiness_of(clusters: Sequence[ClusterRow], thresholds: VerdictThresholds) -> Lumpiness:
    """Is the harm concentrated in one cluster? Returns the candidate and the numbers behind the call.

    The candidate is the cluster (HDBSCAN noise excluded: it is no group) with the largest share of
    negative influence among those with a negative mean. ``lumpy`` when its harm share, its
    per-example rate against the rest's and its size all pass ``thresholds``.
    """
    from gradian.cluster import NOISE

    clusters = list(clusters)
    total_n = sum(int(c.n) for c in clusters)
    total_signed = sum(float(c.signed_influence) for c in clusters)
    net_harm = sum(float(c.signed_influence) for c in clusters if c.signed_influence < 0)
    candidates = [c for c in clusters if c.mean_per_example < 0 and str(c.cluster) != NOISE]
    if not candidates or total_n == 0:
        return Lumpiness(lumpy=False, cluster=None, n_clusters=len(clusters), n_examples=total_n,
                         reason="no cluster has a negative mean score: nothing in the data degraded the capability")
    top = max(candidates, key=lambda c: (c.share_of_negative, -c.mean_per_example))
    n = int(top.n)
    rest_n = total_n - n
    net_share = float(top.signed_influence) / net_harm if net_harm < 0 else 0.0
    share = max(float(top.share_of_negative), net_share)
    rest_mean = (total_signed - float(top.signed_influence)) / rest_n if rest_n else None
    if rest_mean is None:
        ratio = 1.0
    elif rest_mean >= 0:
        ratio = math.inf
    else:
        ratio = float(top.mean_per_example) / rest_mean
    fraction = n / total_n
    out = Lumpiness(lumpy=False, cluster=str(top.cluster), n_clusters=len(clusters), n_examples=total_n,
                    label=top.label, n=n, share=share, share_of_negative=float(top.share_of_negative),
                    net_harm_share=net_share, mean_per_example=float(top.mean_per_example),
                    rest_mean_per_example=rest_mean, rate_ratio=None if math.isinf(ratio) else ratio,
                    rest_net_helpful=math.isinf(ratio), fraction_of_dataset=fraction)
    if rest_n == 0:
        out.reason = f"one cluster holds all {total_n} examples, so no subset stands out"
    elif fraction > thresholds.data_max_cluster_fraction:
        out.reason = (f"cluster {top.cluster} holds {fraction:.0%} of the dataset: it is most of "
                      "the data, not a subset")
    elif share < thresholds.data_min_share:
        out.reason = f"the most harmful cluster ({top.cluster}) carries only {share:.0%} of the harm"
    elif float(top.share_of_negative) < thresholds.data_min_negative_share:
        out.reason = (f"cluster {top.cluster} is the most net-harmful but carries only "
                      f"{float(top.share_of_negative):.1%} of all negative scores, below "
                      f"verdict.data_min_negative_share ({thresholds.data_min_negative_share:g}): the harmful "
                      "rows sit in clusters that are net helpful")
    elif ratio < thresholds.data_min_rate_ratio:
        out.reason = (f"cluster {top.cluster} harms at {ratio:.1f}x the rest's per-example rate, "
                      f"below {thresholds.data_min_rate_ratio:g}x: it wins on size, not on rate")
    else:
        out.lumpy = True
        out.reason = (f"cluster {top.cluster} carries {share_text(out)} at "
                      f"{top.mean_per_example:.4g} per example ({ratio_text(ratio)})")
    return out


def ranked_lumpiness(attribution: Attribution, loss: Lumpiness, thresholds: VerdictThresholds) -> Lumpiness:
    """The lumpiness of ``attribution.ranked_clusters`` when it is lumpy where ``loss`` (the loss-unit
    table's) is not, else ``loss``. A few rows with large gradients can outweigh a topic's harm in
    loss units (clean rows the query leans on, in the topic of the rows that broke it); the ranking's
    units discount them. The reason says which units decided, and ``share_of_negative`` stays the
    loss-unit one, so the harm stated in nats is still a share of the measured loss rise."""
    ranked = lumpiness_of(attribution.ranked_clusters or [], thresholds)
    if not ranked.lumpy:
        return loss
    row = next((c for c in attribution.clusters if str(c.cluster) == ranked.cluster), None)
    ranked.reason = (f"in the ranking's units (each row's influence over the square root of its self-influence), "
                     f"{ranked.reason}; in loss units {loss.reason}")
    ranked.share_of_negative = float(row.share_of_negative) if row is not None else None
    return ranked


def matching_accused(attribution: Attribution | None, cluster: str | None) -> Accused | None:
    """The attribution's accused set when it refines the cluster the verdict accuses."""
    accused = attribution.accused if attribution is not None else None
    if cluster is None or accused is None or str(accused.cluster) != str(cluster):
        return None
    return accused


# -- attribution findings -----------------------------------------------------------------------


def _members(cluster: str, assignment: AssignmentInput) -> set[str] | None:
    if assignment is not None:
        labels = assignment.labels if hasattr(assignment, "labels") else assignment
        return {eid for eid, key in labels.items() if str(key) == cluster}
    return None


def _defect_overlap(cluster: str, attribution: Attribution, data_findings: Sequence[Finding],
                    assignment: AssignmentInput, thresholds: VerdictThresholds) -> Finding | None:
    members = _members(cluster, assignment)
    top = [r.example_id for r in attribution.top_harmful][: thresholds.overlap_top_k]
    listed = {r.example_id for r in attribution.top_harmful if str(r.cluster) == cluster}
    listed |= {r.example_id for c in attribution.clusters if str(c.cluster) == cluster for r in c.top_examples}
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


def _engine_finding(attribution: Attribution, thresholds: VerdictThresholds) -> Finding | None:
    rho = _spearman(attribution)
    if rho is None or rho >= thresholds.engine_agreement_moderate:
        return None
    low = rho < thresholds.engine_agreement_low
    engine, other = attribution.engine, attribution.cross_check
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


# -- the decision -------------------------------------------------------------------------------


def _kind_of(findings: Sequence[Finding]) -> VerdictKind | None:
    kinds = {"data" if f.category == "data" else "config" for f in findings}
    if len(kinds) > 1:
        return "mixed"
    return ("data" if "data" in kinds else "config") if kinds else None


def _hedges(cap: Capability | None, attribution: Attribution | None,
            thresholds: VerdictThresholds) -> tuple[Hedge, ...]:
    out: list[Hedge] = []
    if cap is not None:
        if cap.n_repeats:
            out.append(Hedge("repeated_items", {"n_repeats": cap.n_repeats, "n_items": cap.n_items}))
        if cap.n_base_failing:
            out.append(Hedge("base_failing", {"n_base_failing": cap.n_base_failing, "n_items": cap.n_items}))
        if cap.low_base_score:
            out.append(Hedge("low_base", {"base": cap.base}))
        if cap.n_weakly_held:
            out.append(Hedge("weakly_held", {"n_weakly_held": cap.n_weakly_held, "n_flipped": cap.n_flipped,
                                             "mean_base_margin": cap.mean_base_margin}))
        if cap.proxy_used:
            out.append(Hedge("proxy_metric", {"metric": cap.metric}))
    if attribution is not None:
        rho = _spearman(attribution)
        if rho is None:
            out.append(Hedge("no_cross_check"))
        elif rho < thresholds.engine_agreement_moderate:
            out.append(Hedge("engine_disagreement", {"spearman": rho}))
        if attribution.gated:
            out.append(Hedge("gated"))
        if cap is None:
            out.append(Hedge("no_target"))
    return tuple(out)


def decide_verdict(capability: CapabilityInput, findings: Sequence[Finding | Mapping[str, object]],
                   attribution: AttributionInput,
                   thresholds: VerdictThresholds | None = None) -> VerdictDecision:
    """The verdict by the rules of the module docstring; pure (reads its arguments, changes nothing).

    ``capability`` is the report's capability block (a ``Capability``, its report.json dict, or a
    ``CapabilityResult``), or None when no capability was measured; ``findings`` the audit's (and
    the gate's) findings; ``attribution`` the report's attribution block (an ``Attribution`` or its
    dict), or None when attribution did not run.
    """
    t = thresholds or VerdictThresholds()
    cap = capability_block(capability)
    attr = attribution_block(attribution)
    given = [as_finding(f) for f in findings]
    audit = [f for f in given if f.category != "attribution"]
    critical = [f for f in audit if f.severity == "critical"]
    serious = [f for f in audit if f.at_least("high")]
    config_findings = sorted((f for f in audit if f.category in _CONFIG_CATEGORIES and f.at_least(t.config_min_severity)),
                             key=lambda f: severity_rank(f.severity))
    high_config = [f for f in audit if f.category in _CONFIG_CATEGORIES and f.at_least(t.mixed_config_min_severity)]
    data_high = [f for f in audit if f.category == "data" and f.at_least("high")]
    gate = next((f for f in given if f.id == "attribution.gate_failed"), None)

    status = cap.status if cap is not None else None
    gated = attr.gated if attr is not None else False
    attributed = attr is not None and not gated and cap is not None and status == "regressed"
    lump = lumpiness_of(attr.clusters, t) if attr is not None else None
    if attr is not None and attr.ranked_clusters and lump is not None and not lump.lumpy:
        lump = ranked_lumpiness(attr, lump, t)
    lumpy = bool(attributed and lump is not None and lump.lumpy)
    accused = lump.cluster if lumpy and lump is not None else None
    accused_set = matching_accused(attr, accused)

    kind: VerdictKind
    rule: VerdictRule
    if critical:
        rule, kind = "critical", _kind_of(critical) or "config"
        if lumpy and kind == "config":
            kind = "mixed"
    elif cap is None:
        rule, kind = "no_target", _kind_of(serious) or "inconclusive"
    elif status != "regressed":
        rule, kind = "no_regression", "no_regression"
    elif attr is None:
        rule, kind = "not_attributed", _kind_of(serious) or "inconclusive"
    elif lumpy:
        rule, kind = "lumpy", "mixed" if high_config else "data"
    elif config_findings:
        rule, kind = "flat_config", "config"
    elif data_high:
        rule, kind = "flat_data", "data"
    else:
        rule, kind = "unexplained", "inconclusive"

    rho = _spearman(attr)
    return VerdictDecision(
        kind=kind, rule=rule, accused_cluster=accused,
        accused_set_n=accused_set.n if accused_set is not None else None,
        offer_deletions=lumpy, attribution_ran=attr is not None, attributed=attributed,
        critical_ids=_id_tuple(critical), serious_ids=_id_tuple(serious), config_ids=_id_tuple(config_findings),
        lead_config_title=config_findings[0].title if config_findings else None,
        high_config_ids=_id_tuple(high_config), data_high_ids=_id_tuple(data_high),
        gate_title=gate.title if gate is not None else None,
        capability=CapabilityFigures.of(cap) if cap is not None else None,
        lumpiness=lump, accused_set=accused_set,
        engine_agreement=None if rho is None or attr is None else EngineAgreement(attr.engine, attr.cross_check, rho),
        low_base=bool(cap is not None and cap.low_base_score),
        hedges=_hedges(cap, attr, t),
        harm=harm_of(attr, lump, accused_set) if lumpy else None,
    )


def harm_of(attribution: Attribution | None, lump: Lumpiness | None, accused: Accused | None) -> Harm | None:
    """The accused cluster's and set's share of the negative influence applied to the measured rise
    of the query loss (``attribution.query_loss``), with the set's first-order estimate (the sum of
    score / n over its rows). None without a measured rise above zero or without an accused cluster."""
    q = attribution.query_loss if attribution is not None else None
    if q is None or lump is None or lump.cluster is None or not math.isfinite(q.rise) or q.rise <= 0:
        return None
    cluster_share = lump.share_of_negative
    accused_share = accused.share_of_negative if accused is not None else None
    first_order = None
    if accused is not None and attribution is not None and attribution.n_examples \
            and math.isfinite(accused.mean_per_example):
        first_order = accused.mean_per_example * accused.n / attribution.n_examples
    return Harm(unit=q.unit, rise=q.rise, cluster_share=cluster_share,
                cluster_loss=None if cluster_share is None else cluster_share * q.rise,
                accused_share=accused_share, accused_loss=None if accused_share is None else accused_share * q.rise,
                accused_first_order=first_order)


# -- the findings the decision raises -----------------------------------------------------------


def attribution_findings(decision: VerdictDecision, cap: Capability | None, given: Sequence[Finding],
                          attribution: Attribution | None, thresholds: VerdictThresholds,
                          assignment: AssignmentInput) -> list[Finding]:
    given_ids = {f.id for f in given}
    raised: list[Finding] = []
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
        engine = _engine_finding(attribution, thresholds)
        if engine is not None:
            raised.append(engine)
    if decision.attributed and cap is not None and decision.low_base \
            and "attribution.low_base_score" not in given_ids:
        raised.append(Finding(
            id="attribution.low_base_score", category="attribution", severity="high",
            title=f"The base model scored only {cap.base:.4g} on '{cap.name}'",
            message="The capability was largely absent before the fine-tune, so what the data ranking "
                    "explains is small; findings about the training setup carry more weight here.",
            evidence={"base": cap.base, "metric": cap.metric},
            fix="Describe the capability with items the base model already gets right.",
        ))
    data_rows = [f for f in given if f.category == "data" and f.example_ids]
    if decision.accused_cluster is not None and attribution is not None and data_rows:
        overlap = _defect_overlap(decision.accused_cluster, attribution, data_rows, assignment, thresholds)
        if overlap is not None:
            raised.append(overlap)
    return raised


def ratio_text(ratio: float | None) -> str:
    """``ratio`` None or infinite: the rest of the data is net helpful."""
    return "with the rest net helpful" if ratio is None or math.isinf(ratio) else f"{ratio:.0f}x the rest's rate"


def share_text(lump: Lumpiness) -> str:
    """Both views of the harm share, named: per-example negatives, and net cluster sums."""
    share, net = lump.share_of_negative, lump.net_harm_share
    text = f"{share:.0%} of the negative influence"
    if net and share is not None and abs(net - share) >= 0.005:
        text += f" ({net:.0%} of the net harm of harmful clusters)"
    return text
