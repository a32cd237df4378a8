"""report.md: the report as Markdown, for a terminal, a pull request or the MLflow artifact view.

``render_markdown(report, plots=())`` renders any report in the report.json shape, including a
``diagnose`` report that holds only ``findings``, ``verdict`` (and ``skipped``): missing sections
are left out rather than printed empty. ``plots`` names figures saved under ``plots/`` beside it.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

from gradian.report.tables import item_prompts, items_hurt_text, query_loss_text
from gradian.report.schema import (
    Accused,
    AttributeManifest,
    Attribution,
    Capability,
    CounterfactualManifest,
    CounterfactualRound,
    ExampleRow,
    Manifest,
    OtherManifest,
    Report,
    ReportFinding,
    Span,
)

__all__ = ["provenance", "render_markdown"]

_PLOT_TITLES = {
    "capability": "Capability, base vs tuned",
    "clusters": "Influence by cluster",
    "scores": "Per-example score distribution",
    "training": "Training curves",
}


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("`", "'")


def _num(x: object, spec: str = ".4g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _too_few(cap: Capability) -> str:
    """The status cell's qualifier when too few items were measured to call a change significant."""
    if not cap.too_few_items:
        return ""
    return f" (too few items: {cap.n_items}, fewer than evaluation.min_items={cap.min_items})"


def _capability(cap: Capability) -> list[str]:
    lo, hi = cap.ci_bounds()
    lines = ["## Capability", "",
             "| capability | metric | base | tuned | delta | 95% CI | items | flipped | base failing | status |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| {_cell(cap.name)} | `{_cell(cap.metric)}` | {_num(cap.base, '.4f')} | "
             f"{_num(cap.tuned, '.4f')} | **{_num(cap.delta, '+.4f')}** | "
             f"[{_num(lo, '+.4f')}, {_num(hi, '+.4f')}] | {cap.n_items} | {cap.n_flipped} | "
             f"{cap.n_base_failing} | **{_cell(cap.status)}**{_too_few(cap)} |", ""]
    if cap.proxy_used:
        lines += [f"`{_cell(cap.metric)}` is a likelihood proxy, not a correctness score.", ""]
    return lines


def _examples_table(rows: Sequence[ExampleRow], prompts: Mapping[str, str]) -> list[str]:
    hurt = any(r.items_hurt for r in rows)
    lines = ["| example | cluster | score | predicted Δloss if removed |" + (" items it hurts most |" if hurt else "")
             + " row |", "|---|---|---|---|" + ("---|" if hurt else "") + "---|"]
    lines += [f"| `{_cell(r.example_id)}` | {_cell(r.cluster)} | {_num(r.score)} | "
              f"{_num(r.predicted_loss_delta_if_removed)} |" + (f" {_cell(items_hurt_text(r, prompts))} |" if hurt else "")
              + f" {_cell(r.excerpt)} |" for r in rows]
    return lines + [""]


def _attribution(attr: Attribution, accused: str | None, prompts: Mapping[str, str]) -> list[str]:
    rho = attr.engine_agreement_spearman
    lines = ["## Attribution", "",
             f"- Engine: `{_cell(attr.engine)}`; cross-check: `{_cell(attr.cross_check)}`; "
             f"engine agreement (Spearman): **{_num(rho, '.3f')}**",
             f"- Query signal: {_cell(attr.query_signal)}; significance gate: {'failed, scores computed anyway' if attr.gated else 'passed'}",
             "- Sign: a positive score reinforced the capability, a negative one degraded it; "
             "predicted Δloss if removed = score / n."]
    if attr.query_loss is not None:
        lines.append(f"- Measured: {_cell(query_loss_text(attr.query_loss))}")
    lines.append("")
    if attr.clusters:
        lines += ["### Influence by cluster", "",
                  "| cluster | label | n | signed influence | share of negative | mean per example |",
                  "|---|---|---|---|---|---|"]
        for c in attr.clusters:
            mark = "**" if str(c.cluster) == accused else ""
            lines.append(f"| {mark}{_cell(c.cluster)}{mark} | {_cell(c.label)} | {c.n} | "
                         f"{_num(c.signed_influence)} | {c.share_of_negative:.1%} | "
                         f"{_num(c.mean_per_example)} |")
        lines.append("")
    if attr.accused is not None:
        lines += _accused(attr.accused, attr.spans)
    if attr.deletions_withheld:
        lines += ["### Top harmful examples", "", f"None offered: {attr.deletions_withheld}", ""]
    elif attr.top_harmful:
        lines += ["### Top harmful examples", ""] + _examples_table(attr.top_harmful, prompts)
    if attr.top_helpful:
        lines += ["### Top helpful examples", ""] + _examples_table(attr.top_helpful, prompts)
    return lines


def _accused(acc: Accused, spans: Sequence[Span]) -> list[str]:
    """The accused set beside its topic cluster, and the harmful span of its top examples."""
    lines = ["### Accused set: the rows to act on", "",
             "| | topic cluster | accused set | left out |", "|---|---|---|---|",
             f"| rows | {acc.cluster_n} (cluster {_cell(acc.cluster)}: {_cell(acc.cluster_label)}) | "
             f"**{acc.n}** | {acc.n_left_out} |",
             f"| share of the cluster's harm | 100% | **{acc.share_of_cluster_harm:.1%}** | "
             f"{1 - acc.share_of_cluster_harm:.1%} |",
             f"| mean per example | | {_num(acc.mean_per_example)} | {_num(acc.left_out_mean_per_example)} |",
             f"| estimated share harmful | | {acc.estimated_harmful_share:.0%} | |",
             *([f"| of them from other clusters (gradient siblings) | | {acc.n_outside_cluster} | |"]
               if acc.n_outside_cluster else []),
             *([f"| of them already answered so by the base model | | | {len(acc.known_to_base)} |"]
               if acc.known_to_base else []),
             *([f"| rows asking an eval prompt with another answer | {acc.eval_conflict_rows} | "
                f"**{acc.eval_conflict_in_set}** | {acc.eval_conflict_rows - (acc.eval_conflict_in_set or 0)} |"]
               if acc.eval_conflict_rows is not None else []), "",
             f"Split by `{_cell(acc.method)}`: {_cell(acc.reason)}. The accused set is the "
             "`accused` column of rankings.parquet; `gradian counterfactual --drop accused` retrains without it.", "",
             "Its ids, to save as a file for `gradian counterfactual --drop-ids @FILE`:", "", "```",
             ",".join(acc.example_ids), "```", ""]
    if spans:
        lines += ["#### Harmful span of the top accused examples", "",
                  "| example | query item | span (bold) |", "|---|---|---|"]
        for sp in spans:
            lines.append(f"| `{_cell(sp.example_id)}` | {_cell(sp.item_id)} | "
                         f"{_cell(_bold_span(sp.text, sp.span_start, sp.span_end))} |")
        lines.append("")
    return lines


def _bold_span(text: str, start: int | None, end: int | None) -> str:
    if not isinstance(start, int) or not isinstance(end, int) or not 0 <= start < end <= len(text):
        return text
    inner = text[start:end].strip()
    lead = text[start:end][: len(text[start:end]) - len(text[start:end].lstrip())]
    return f"{text[:start]}{lead}**{inner}**{text[end:]}" if inner else text


def _rounds(rounds: Sequence[CounterfactualRound]) -> list[str]:
    """``--until-recovered``: one line per retrain, the rows each attribution added, and the stop."""
    truth = any(r.precision is not None for r in rounds)
    lines = ["## Rounds", "", "| round | rows removed | outcome | capability after | loss recovered | "
             + ("precision | recall | " if truth else "") + "accused next | report |",
             "|---|---|---|---|---|" + ("---|---|" if truth else "") + "---|---|"]
    for r in rounds:
        recovered = "" if r.recovered_fraction is None else f"{r.recovered_fraction:.0%}"
        scored = f"{_num(r.precision, '.2f')} | {_num(r.recall, '.2f')} | " if truth else ""
        lines.append(f"| {r.round} | {r.n_removed} | {_cell(r.outcome.replace('_', ' '))} | {_num(r.after)} | "
                     f"{recovered} | {scored}{len(r.added) if r.added else ''} | `{_cell(r.report)}` |")
    stop = next((r.stopped for r in reversed(rounds) if r.stopped), None)
    return lines + ([""] + [f"Stopped at {_cell(stop)}."] if stop else []) + [""]


def _findings(findings: Sequence[ReportFinding]) -> list[str]:
    lines = ["## Findings", ""]
    if not findings:
        return lines + ["No check fired.", ""]
    lines += ["| severity | check | finding |", "|---|---|---|"]
    lines += [f"| {f.severity} | `{f.id}` | {_cell(f.title)} |" for f in findings]
    lines.append("")
    for f in findings:
        lines += [f"### {f.severity.upper()} `{f.id}`: {_cell(f.title)}", "", str(f.message), ""]
        if f.fix:
            lines += [f"**Fix:** {f.fix}", ""]
        if f.evidence:
            lines += ["Evidence: `" + json.dumps(f.evidence, sort_keys=True, default=str).replace("`", "'") + "`", ""]
        ids = f.example_ids or []
        if ids:
            more = len(ids) - 10
            lines += ["Examples: " + ", ".join(f"`{e}`" for e in ids[:10]) + (f" and {more} more" if more > 0 else ""), ""]
    return lines


def provenance(manifest: Manifest) -> tuple[dict[str, object], str | None]:
    """The manifest as report.json holds it (empty when the report has none) and its config hash
    (None for a kind that records none)."""
    recorded = {} if manifest == OtherManifest() else manifest.to_json()
    config_hash = manifest.config_hash if isinstance(manifest, (AttributeManifest, CounterfactualManifest)) else None
    return recorded, config_hash


def render_markdown(report: Report | Mapping[str, object], plots: Sequence[str] = ()) -> str:
    """The report as Markdown; ``plots`` lists figure names saved as ``plots/<name>.png``."""
    report = Report.of(report)
    verdict = report.verdict
    title = "Gradian diagnosis" if report.kind == "diagnose" or report.attribution is None \
        and report.capability is None else "Gradian report"
    lines = [f"# {title}", "", f"**Verdict ({verdict.kind}):** {verdict.summary}", ""]
    if verdict.hedges:
        lines += ["What this verdict does not establish:", ""] + [f"- {h}" for h in verdict.hedges] + [""]
    if report.capability is not None:
        lines += _capability(report.capability)
    if report.attribution is not None:
        lines += _attribution(report.attribution, verdict.accused_cluster, item_prompts(report))
    if report.counterfactual is not None and report.counterfactual.rounds:
        lines += _rounds(report.counterfactual.rounds)
    lines += _findings(report.findings)
    if report.skipped:
        lines += ["## Skipped checks", "", "| check | why |", "|---|---|"]
        lines += [f"| `{s.id}` | {_cell(s.reason)} |" for s in report.skipped] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{_PLOT_TITLES.get(p, p)}](plots/{p}.png)" for p in plots] + [""]
    manifest, config_hash = provenance(report.manifest)
    if manifest:
        lines += ["## Provenance", ""]
        if config_hash:
            lines += [f"Config hash: `{config_hash}`", ""]
        lines += ["```json", json.dumps(manifest, indent=2, sort_keys=True, default=str), "```", ""]
    return "\n".join(lines)
