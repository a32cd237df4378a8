"""The report around the verdict: the decision worded, its findings added, the attribution finished.

``synthesize_verdict`` runs the decision (``gradian.report.decision.decide_verdict``), adds the
``attribution.*`` findings it raises and words the report's ``verdict`` block ({kind, summary,
hedges, accused_cluster, accused_set_n}) with ``gradian.report.verdict_prose``; ``build_report``
builds the typed ``Report`` around it (``gradian.report.schema``), ``assemble_report`` the same as a
report.json dict.

Beside an accused cluster, the attribution's ``accused`` set (``gradian.cluster.refine_accused``:
the rows inside the cluster whose harm stands out) is kept and named in the summary; an accused set
for any other cluster, or with no cluster accused, is dropped from the report with its spans.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Sequence, cast

from gradian.findings import EVAL_CONFLICT_ID, Finding, severity_rank
from gradian.report.decision import (
    AttributionInput,
    CapabilityInput,
    VerdictDecision,
    VerdictThresholds,
    as_finding,
    attribution_block,
    attribution_findings,
    capability_block,
    decide_verdict,
    matching_accused,
)
from gradian.report.schema import (
    Attribution,
    Capability,
    Lumpiness,
    Manifest,
    OtherManifest,
    Report,
    ReportFinding,
    SkippedCheckRow,
    Verdict,
)
from gradian.report.tables import AssignmentInput
from gradian.report.verdict_prose import render_hedge, render_verdict

if TYPE_CHECKING:
    from gradian.jsontypes import JsonObject
    from gradian.report.schema import SkippedCheckLike

__all__ = ["VerdictSynthesis", "assemble_report", "build_report", "synthesize_verdict", "verdict_block"]


@dataclass
class VerdictSynthesis:
    """The decision, the ``verdict`` block worded from it, and the ``attribution.*`` findings raised."""

    decision: VerdictDecision
    verdict: JsonObject
    findings: list[Finding]

    @property
    def accused_cluster(self) -> str | None:
        return self.decision.accused_cluster

    @property
    def offer_deletions(self) -> bool:
        return self.decision.offer_deletions

    @property
    def lumpiness(self) -> Lumpiness | None:
        return self.decision.lumpiness


def verdict_block(decision: VerdictDecision) -> JsonObject:
    """The report's ``verdict`` block (``gradian.report.schema.Verdict``) worded from ``decision``."""
    return {"kind": decision.kind, "summary": render_verdict(decision),
            "hedges": [render_hedge(h) for h in decision.hedges],
            "accused_cluster": decision.accused_cluster, "accused_set_n": decision.accused_set_n,
            "harm": cast("JsonObject", decision.harm.to_json()) if decision.harm is not None else None}


def synthesize_verdict(capability: CapabilityInput, findings: Sequence[Finding | Mapping[str, object]],
                       attribution: AttributionInput,
                       thresholds: VerdictThresholds | None = None,
                       assignment: AssignmentInput = None) -> VerdictSynthesis:
    """``decide_verdict``, the ``attribution.*`` findings it raises and the ``verdict`` block in words.

    Arguments as in ``decide_verdict``; ``assignment`` (a ``ClusterAssignment`` or ``{id: cluster}``)
    lets the defect overlap count every member of the accused cluster, not only the listed ones.
    """
    t = thresholds or VerdictThresholds()
    cap, attr = capability_block(capability), attribution_block(attribution)
    decision = decide_verdict(cap, findings, attr, t)
    given = [as_finding(f) for f in findings]
    raised = attribution_findings(decision, cap, given, attr, t, assignment)
    return VerdictSynthesis(decision=decision, verdict=verdict_block(decision), findings=raised)


def assemble_report(capability: CapabilityInput, findings: Sequence[Finding | Mapping[str, object]],
                    attribution: AttributionInput, manifest: Mapping[str, object] | None = None,
                    thresholds: VerdictThresholds | None = None, assignment: AssignmentInput = None,
                    skipped: Sequence[SkippedCheckLike | Mapping[str, object]] | None = None) -> dict[str, object]:
    """``build_report`` as a report.json dict, the manifest kept as given. For hand-built blocks
    (tests, notebooks); the commands build a typed ``Report`` with ``build_report``.

    When the verdict offers nothing for deletion, ``attribution.top_harmful`` is emptied and
    ``attribution.deletions_withheld`` says why (every score stays in the rankings table).
    """
    built = build_report(capability_block(capability), [as_finding(f) for f in findings],
                         attribution_block(attribution), OtherManifest(), thresholds, assignment, skipped)
    out = built.to_json()
    out["manifest"] = dict(manifest or {})
    return out


def build_report(capability: Capability | None, findings: Sequence[Finding], attribution: Attribution | None,
                 manifest: Manifest, thresholds: VerdictThresholds | None = None,
                 assignment: AssignmentInput = None,
                 skipped: Sequence[SkippedCheckLike | Mapping[str, object]] | None = None) -> Report:
    """The typed ``Report`` of an attribution run: the verdict decided over the blocks given, its
    ``attribution.*`` findings added, the attribution finished (lumpiness, the accused set only
    beside the cluster it refines, no deletion list when the verdict offers none)."""
    synthesis = synthesize_verdict(capability, findings, attribution, thresholds, assignment)
    attribution = _finish_attribution(attribution, synthesis)
    ordered, attribution = _join_eval_conflict(_ordered_findings(findings, synthesis), attribution)
    return Report(
        capability=capability,
        findings=[ReportFinding.of(f) for f in ordered],
        attribution=attribution,
        verdict=Verdict.from_json(synthesis.verdict, "verdict"),
        manifest=manifest,
        skipped=None if skipped is None else [
            SkippedCheckRow.of(s) for s in skipped],
    )


def _ordered_findings(findings: Sequence[Finding | Mapping[str, object]], synthesis: VerdictSynthesis
                      ) -> list[Finding]:
    """The lanes' findings and the verdict's, most severe first (stable: lanes keep their order)."""
    out = [as_finding(f) for f in findings] + synthesis.findings
    out.sort(key=lambda f: severity_rank(f.severity))
    return out


def _join_eval_conflict(findings: list[Finding], attribution: Attribution | None
                        ) -> tuple[list[Finding], Attribution | None]:
    """The rows that ask eval prompts with other answers (``data.train_eval_conflict``) against the
    accused set: how many of them it holds, on the set and in the finding."""
    accused = attribution.accused if attribution is not None else None
    conflict = next((f for f in findings if f.id == EVAL_CONFLICT_ID), None)
    if accused is None or attribution is None or conflict is None:
        return findings, attribution
    rows = [str(r) for r in conflict.evidence.get("row_ids") or []]
    held = len(set(rows) & set(accused.example_ids))
    joined = replace(conflict, evidence={**conflict.evidence, "in_accused_set": held},
                     message=f"{conflict.message} The accused set holds {held} of these {len(rows)} rows "
                             f"({held} of its {accused.n}).")
    findings = [joined if f is conflict else f for f in findings]
    return findings, replace(attribution, accused=replace(accused, eval_conflict_rows=len(rows),
                                                          eval_conflict_in_set=held))


def _finish_attribution(attribution: Attribution | None, synthesis: VerdictSynthesis) -> Attribution | None:
    """The attribution block as reported: its lumpiness, the accused set only beside the cluster
    it refines, and no deletion list when the verdict offers none."""
    if attribution is None:
        return None
    # the accused set exists only beside an accused cluster it refines
    accused = matching_accused(attribution, synthesis.accused_cluster)
    attr = replace(attribution, lumpiness=synthesis.lumpiness, accused=accused,
                   spans=attribution.spans if accused is not None else [])
    if not synthesis.offer_deletions and attr.top_harmful:
        attr.top_harmful = []
        attr.deletions_withheld = (
            "No cluster carries the harm at a distinctly higher rate"
            + (f" ({synthesis.lumpiness.reason})" if synthesis.lumpiness else "")
            + "; deleting the highest-scoring rows would not address the cause."
        )
        attr.clusters = [replace(c, top_examples=[]) for c in attr.clusters]
    return attr
