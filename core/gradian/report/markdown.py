"""report.md: the report as Markdown, for a terminal, a pull request or the MLflow artifact view.

``render_markdown(report, plots=())`` renders any report in the report.json shape, including a
``diagnose`` report that holds only ``findings``, ``verdict`` (and ``skipped``): missing sections
are left out rather than printed empty. ``plots`` names figures saved under ``plots/`` beside it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

__all__ = ["render_markdown"]

_PLOT_TITLES = {
    "capability": "Capability, base vs tuned",
    "clusters": "Influence by cluster",
    "scores": "Per-example score distribution",
    "training": "Training curves",
}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("`", "'")


def _num(x: Any, spec: str = ".4g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _too_few(cap: Mapping[str, Any]) -> str:
    """The status cell's qualifier when too few items were measured to call a change significant."""
    if not cap.get("too_few_items"):
        return ""
    return f" (too few items: {cap.get('n_items')}, fewer than evaluation.min_items={cap.get('min_items')})"


def _capability(cap: Mapping[str, Any]) -> list[str]:
    lo, hi = (cap.get("ci") or [None, None])[:2]
    lines = ["## Capability", "",
             "| capability | metric | base | tuned | delta | 95% CI | items | flipped | base failing | status |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| {_cell(cap.get('name'))} | `{_cell(cap.get('metric'))}` | {_num(cap.get('base'), '.4f')} | "
             f"{_num(cap.get('tuned'), '.4f')} | **{_num(cap.get('delta'), '+.4f')}** | "
             f"[{_num(lo, '+.4f')}, {_num(hi, '+.4f')}] | {cap.get('n_items')} | {cap.get('n_flipped')} | "
             f"{cap.get('n_base_failing')} | **{_cell(cap.get('status'))}**{_too_few(cap)} |", ""]
    if cap.get("proxy_used"):
        lines += [f"`{_cell(cap.get('metric'))}` is a likelihood proxy, not a correctness score.", ""]
    return lines


def _items_hurt(row: Mapping[str, Any]) -> str:
    """The query items a row hurts most, with their share of its harm (``items_hurt``)."""
    return ", ".join(f"{i['item_id']} ({i['share']:.0%})" for i in row.get("items_hurt") or [])


def _examples_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    hurt = any(r.get("items_hurt") for r in rows)
    lines = ["| example | cluster | score | predicted Δloss if removed |" + (" items it hurts most |" if hurt else "")
             + " row |", "|---|---|---|---|" + ("---|" if hurt else "") + "---|"]
    lines += [f"| `{_cell(r['example_id'])}` | {_cell(r.get('cluster'))} | {_num(r['score'])} | "
              f"{_num(r['predicted_loss_delta_if_removed'])} |" + (f" {_cell(_items_hurt(r))} |" if hurt else "")
              + f" {_cell(r.get('excerpt', ''))} |" for r in rows]
    return lines + [""]


def _attribution(attr: Mapping[str, Any], accused: str | None) -> list[str]:
    rho = attr.get("engine_agreement_spearman")
    lines = ["## Attribution", "",
             f"- Engine: `{_cell(attr.get('engine'))}`; cross-check: `{_cell(attr.get('cross_check'))}`; "
             f"engine agreement (Spearman): **{_num(rho, '.3f')}**",
             f"- Query signal: {_cell(attr.get('query_signal'))}; significance gate: {'failed, scores computed anyway' if attr.get('gated') else 'passed'}",
             "- Sign: a positive score reinforced the capability, a negative one degraded it; "
             "predicted Δloss if removed = score / n.", ""]
    clusters = attr.get("clusters") or []
    if clusters:
        lines += ["### Influence by cluster", "",
                  "| cluster | label | n | signed influence | share of negative | mean per example |",
                  "|---|---|---|---|---|---|"]
        for c in clusters:
            mark = "**" if str(c["cluster"]) == accused else ""
            lines.append(f"| {mark}{_cell(c['cluster'])}{mark} | {_cell(c.get('label', ''))} | {c['n']} | "
                         f"{_num(c['signed_influence'])} | {c['share_of_negative']:.1%} | "
                         f"{_num(c['mean_per_example'])} |")
        lines.append("")
    if attr.get("accused"):
        lines += _accused(attr["accused"], attr.get("spans") or [])
    if attr.get("deletions_withheld"):
        lines += ["### Top harmful examples", "", f"None offered: {attr['deletions_withheld']}", ""]
    elif attr.get("top_harmful"):
        lines += ["### Top harmful examples", ""] + _examples_table(attr["top_harmful"])
    if attr.get("top_helpful"):
        lines += ["### Top helpful examples", ""] + _examples_table(attr["top_helpful"])
    return lines


def _accused(acc: Mapping[str, Any], spans: Sequence[Mapping[str, Any]]) -> list[str]:
    """The accused set beside its topic cluster, and the harmful span of its top examples."""
    rest = acc.get("left_out_mean_per_example")
    lines = ["### Accused set: the rows to act on", "",
             "| | topic cluster | accused set | left out |", "|---|---|---|---|",
             f"| rows | {acc['cluster_n']} (cluster {_cell(acc['cluster'])}: {_cell(acc.get('cluster_label', ''))}) | "
             f"**{acc['n']}** | {acc['n_left_out']} |",
             f"| share of the cluster's harm | 100% | **{acc['share_of_cluster_harm']:.1%}** | "
             f"{1 - acc['share_of_cluster_harm']:.1%} |",
             f"| mean per example | | {_num(acc['mean_per_example'])} | {_num(rest)} |",
             f"| estimated share harmful | | {acc['estimated_harmful_share']:.0%} | |", "",
             f"Split by `{_cell(acc['method'])}`: {_cell(acc['reason'])}. The accused set is the "
             "`accused` column of rankings.parquet; `gradian counterfactual --drop accused` retrains without it.", ""]
    if spans:
        lines += ["#### Harmful span of the top accused examples", "",
                  "| example | query item | span (bold) |", "|---|---|---|"]
        for sp in spans:
            lines.append(f"| `{_cell(sp['example_id'])}` | {_cell(sp.get('item_id', ''))} | "
                         f"{_cell(_bold_span(sp.get('text', ''), sp.get('span_start'), sp.get('span_end')))} |")
        lines.append("")
    return lines


def _bold_span(text: str, start: Any, end: Any) -> str:
    if not isinstance(start, int) or not isinstance(end, int) or not 0 <= start < end <= len(text):
        return text
    inner = text[start:end].strip()
    lead = text[start:end][: len(text[start:end]) - len(text[start:end].lstrip())]
    return f"{text[:start]}{lead}**{inner}**{text[end:]}" if inner else text


def _findings(findings: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Findings", ""]
    if not findings:
        return lines + ["No check fired.", ""]
    lines += ["| severity | check | finding |", "|---|---|---|"]
    lines += [f"| {f['severity']} | `{f['id']}` | {_cell(f['title'])} |" for f in findings]
    lines.append("")
    for f in findings:
        lines += [f"### {f['severity'].upper()} `{f['id']}`: {_cell(f['title'])}", "", str(f.get("message", "")), ""]
        if f.get("fix"):
            lines += [f"**Fix:** {f['fix']}", ""]
        if f.get("evidence"):
            lines += ["Evidence: `" + json.dumps(f["evidence"], sort_keys=True, default=str).replace("`", "'") + "`", ""]
        ids = f.get("example_ids") or []
        if ids:
            more = len(ids) - 10
            lines += ["Examples: " + ", ".join(f"`{e}`" for e in ids[:10]) + (f" and {more} more" if more > 0 else ""), ""]
    return lines


def render_markdown(report: Mapping[str, Any], plots: Sequence[str] = ()) -> str:
    """The report as Markdown; ``plots`` lists figure names saved as ``plots/<name>.png``."""
    manifest = report.get("manifest") or {}
    verdict = report.get("verdict") or {}
    title = "Gradian diagnosis" if manifest.get("kind") == "diagnose" or report.get("attribution") is None \
        and report.get("capability") is None else "Gradian report"
    lines = [f"# {title}", ""]
    if verdict:
        lines += [f"**Verdict ({verdict.get('kind')}):** {verdict.get('summary', '')}", ""]
        hedges = verdict.get("hedges") or []
        if hedges:
            lines += ["What this verdict does not establish:", ""] + [f"- {h}" for h in hedges] + [""]
    if report.get("capability"):
        lines += _capability(report["capability"])
    if report.get("attribution"):
        lines += _attribution(report["attribution"], verdict.get("accused_cluster"))
    lines += _findings(report.get("findings") or [])
    skipped = report.get("skipped") or []
    if skipped:
        lines += ["## Skipped checks", "", "| check | why |", "|---|---|"]
        lines += [f"| `{s['id']}` | {_cell(s['reason'])} |" for s in skipped] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{_PLOT_TITLES.get(p, p)}](plots/{p}.png)" for p in plots] + [""]
    if manifest:
        lines += ["## Provenance", ""]
        if manifest.get("config_hash"):
            lines += [f"Config hash: `{manifest['config_hash']}`", ""]
        lines += ["```json", json.dumps(manifest, indent=2, sort_keys=True, default=str), "```", ""]
    return "\n".join(lines)
