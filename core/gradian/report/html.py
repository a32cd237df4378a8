"""report.html: one self-contained page (inline CSS, figures as base64 PNG, no scripts, no links out).

Every piece of user text (example excerpts, cluster labels, finding messages, manifest values) is
HTML-escaped. Sections, each with an ``id`` a test or a reader can jump to: ``verdict``,
``capability``, ``clusters``, ``accused``, ``scores``, ``training``, ``findings``, ``top-harmful``,
``top-helpful``, ``skipped``, ``provenance``. A section whose data is missing is left out.
"""

from __future__ import annotations

import base64
import json
from html import escape
from typing import Mapping, Sequence

from gradian.report.markdown import provenance
from gradian.report.tables import item_prompts, items_hurt_text, query_loss_text
from gradian.report.schema import (
    Accused,
    Attribution,
    Capability,
    ExampleRow,
    Report,
    ReportFinding,
    Span,
    Verdict,
)

__all__ = ["render_html"]

_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1f2933}
main{max-width:1040px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:1.6em;margin:0 0 12px}h2{font-size:1.2em;margin:28px 0 10px;border-bottom:1px solid #d5dae1;padding-bottom:4px}
section{background:#fff;border:1px solid #e1e5ea;border-radius:6px;padding:4px 18px 14px;margin:14px 0}
table{border-collapse:collapse;width:100%;font-size:.88em;margin:8px 0}
th,td{border-bottom:1px solid #e6e9ed;padding:5px 7px;text-align:left;vertical-align:top}
th{background:#f0f2f5}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code{font-family:Menlo,Consolas,monospace;font-size:.92em;background:#f0f2f5;padding:1px 3px;border-radius:3px}
pre{background:#f0f2f5;padding:10px;overflow-x:auto;font-size:.82em}
img{max-width:100%;height:auto;display:block;margin:8px 0}
.verdict{border-left:6px solid #7b8794}.verdict.data{border-left-color:#c0392b}.verdict.config{border-left-color:#d68910}
.verdict.mixed{border-left-color:#8e44ad}.verdict.no_regression{border-left-color:#27ae60}
.kind{display:inline-block;font-weight:700;text-transform:uppercase;letter-spacing:.05em;font-size:.8em;padding:2px 8px;border-radius:10px;background:#e4e7eb}
.sev{font-weight:700;text-transform:uppercase;font-size:.75em;padding:1px 6px;border-radius:8px;color:#fff;background:#7b8794}
.sev-critical{background:#a93226}.sev-high{background:#d35400}.sev-medium{background:#b7950b}.sev-low{background:#2e86c1}
tr.accused td{background:#fdecea;font-weight:600}
details{margin:4px 0}summary{cursor:pointer}
.muted{color:#616e7c}
.span{white-space:pre-wrap}.span mark{padding:0 1px;border-radius:2px}
mark.harmful{background:#f5b7b1;font-weight:600}
"""


def _e(x: object) -> str:
    return escape("" if x is None else str(x), quote=True)


def _num(x: object, spec: str = ".4g") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _img(name: str, png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img id="plot-{_e(name)}" alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _verdict(verdict: Verdict) -> str:
    kind = str(verdict.kind)
    out = [f'<section id="verdict" class="verdict {_e(kind)}"><h2>Verdict</h2>',
           f'<p><span class="kind" id="verdict-kind">{_e(kind)}</span></p>',
           f'<p id="verdict-summary">{_e(verdict.summary)}</p>']
    if verdict.hedges:
        out.append('<p class="muted">What this verdict does not establish:</p><ul id="hedges">')
        out += [f"<li>{_e(h)}</li>" for h in verdict.hedges]
        out.append("</ul>")
    return "".join(out) + "</section>"


def _capability(cap: Capability, plot: bytes | None) -> str:
    lo, hi = cap.ci_bounds()
    row = "".join(f"<td{' class=num' if n else ''}>{v}</td>" for v, n in (
        (_e(cap.name), False), (f"<code>{_e(cap.metric)}</code>", False),
        (_num(cap.base, ".4f"), True), (_num(cap.tuned, ".4f"), True),
        (f"<b>{_num(cap.delta, '+.4f')}</b>", True),
        (f"[{_num(lo, '+.4f')}, {_num(hi, '+.4f')}]", True), (_e(cap.n_items), True),
        (_e(cap.n_flipped), True), (_e(cap.n_base_failing), True),
        (f"<b>{_e(cap.status)}</b>" + (
            f" (too few items: {_e(cap.n_items)}, fewer than evaluation.min_items={_e(cap.min_items)})"
            if cap.too_few_items else ""), False)))
    out = ['<section id="capability"><h2>Capability: base vs tuned</h2><table><tr>'
           "<th>capability</th><th>metric</th><th>base</th><th>tuned</th><th>delta</th><th>95% CI</th>"
           "<th>items</th><th>flipped</th><th>base failing</th><th>status</th></tr>",
           f"<tr>{row}</tr></table>"]
    if cap.proxy_used:
        out.append('<p class="muted">This metric is a likelihood proxy, not a correctness score.</p>')
    if plot:
        out.append(_img("capability", plot, "capability base vs tuned with the interval"))
    return "".join(out) + "</section>"


def _example_rows(rows: Sequence[ExampleRow], prompts: Mapping[str, str]) -> str:
    hurt = any(r.items_hurt for r in rows)
    head = ("<table><tr><th>example</th><th>cluster</th><th>score</th><th>predicted Δloss if removed</th>"
            + ("<th>items it hurts most</th>" if hurt else "") + "<th>row</th></tr>")
    body = "".join(
        f"<tr><td><code>{_e(r.example_id)}</code></td><td>{_e(r.cluster)}</td>"
        f"<td class=num>{_num(r.score)}</td><td class=num>{_num(r.predicted_loss_delta_if_removed)}</td>"
        + (f"<td>{_e(items_hurt_text(r, prompts))}</td>" if hurt else "")
        + f"<td>{_e(r.excerpt)}</td></tr>" for r in rows)
    return head + body + "</table>"


def _attribution(attr: Attribution, accused: str | None, plots: Mapping[str, bytes],
                 prompts: Mapping[str, str]) -> str:
    rho = attr.engine_agreement_spearman
    out = ['<section id="clusters"><h2>Influence by cluster</h2>',
           f'<p>Engine <code>{_e(attr.engine)}</code>, cross-check <code>{_e(attr.cross_check)}</code>; '
           f'engine agreement (Spearman): <b id="engine-agreement">{_num(rho, ".3f")}</b>. '
           f'Query signal: {_e(attr.query_signal)}. Significance gate: {"failed, scores computed anyway" if attr.gated else "passed"}.</p>',
           '<p class="muted">A positive score reinforced the capability; a negative one degraded it. '
           "Predicted Δloss if removed = score / n.</p>"]
    if attr.query_loss is not None:
        out.append(f'<p id="query-loss">Measured: {_e(query_loss_text(attr.query_loss))}.</p>')
    if attr.clusters:
        out.append('<table id="cluster-table"><tr><th>cluster</th><th>label</th><th>n</th><th>signed influence</th>'
                   "<th>share of negative</th><th>mean per example</th></tr>")
        for c in attr.clusters:
            cls = ' class="accused"' if str(c.cluster) == accused else ""
            out.append(f"<tr{cls}><td>{_e(c.cluster)}</td><td>{_e(c.label)}</td>"
                       f"<td class=num>{_e(c.n)}</td><td class=num>{_num(c.signed_influence)}</td>"
                       f"<td class=num>{c.share_of_negative:.1%}</td>"
                       f"<td class=num>{_num(c.mean_per_example)}</td></tr>")
        out.append("</table>")
        for c in attr.clusters:
            if c.top_examples:
                out.append(f"<details><summary>Cluster {_e(c.cluster)}: top examples</summary>"
                           f"{_example_rows(c.top_examples, prompts)}</details>")
    if plots.get("clusters"):
        out.append(_img("clusters", plots["clusters"], "signed influence by cluster"))
    out.append("</section>")
    if attr.accused is not None:
        out.append(_accused(attr.accused, attr.spans))
    if plots.get("scores"):
        out.append('<section id="scores"><h2>Per-example scores</h2>'
                   + _img("scores", plots["scores"], "per-example score distribution") + "</section>")
    out.append('<section id="top-harmful"><h2>Top harmful examples</h2>')
    if attr.deletions_withheld:
        out.append(f'<p id="deletions-withheld">None offered: {_e(attr.deletions_withheld)}</p>')
    elif attr.top_harmful:
        out.append(_example_rows(attr.top_harmful, prompts))
    else:
        out.append("<p>No example has a negative score.</p>")
    out.append("</section>")
    if attr.top_helpful:
        out.append('<section id="top-helpful"><h2>Top helpful examples</h2>'
                   + _example_rows(attr.top_helpful, prompts) + "</section>")
    return "".join(out)


def _accused(acc: Accused, spans: Sequence[Span]) -> str:
    """The accused set beside its topic cluster; each top accused example with its harmful span marked."""
    out = ['<section id="accused"><h2>Accused set: the rows to act on</h2>',
           '<table id="accused-table"><tr><th></th><th>topic cluster</th><th>accused set</th><th>left out</th></tr>',
           f"<tr><td>rows</td><td class=num>{_e(acc.cluster_n)} (cluster {_e(acc.cluster)}: "
           f"{_e(acc.cluster_label)})</td><td class=num id=accused-n><b>{_e(acc.n)}</b></td>"
           f"<td class=num>{_e(acc.n_left_out)}</td></tr>",
           f"<tr><td>share of the cluster's harm</td><td class=num>100%</td>"
           f"<td class=num><b>{acc.share_of_cluster_harm:.1%}</b></td>"
           f"<td class=num>{1 - acc.share_of_cluster_harm:.1%}</td></tr>",
           f"<tr><td>mean per example</td><td></td><td class=num>{_num(acc.mean_per_example)}</td>"
           f"<td class=num>{_num(acc.left_out_mean_per_example)}</td></tr>",
           f"<tr><td>estimated share harmful</td><td></td><td class=num>{acc.estimated_harmful_share:.0%}</td>"
           "<td></td></tr>"
           + (f"<tr><td>of them from other clusters (gradient siblings)</td><td></td>"
              f"<td class=num>{_e(acc.n_outside_cluster)}</td><td></td></tr>" if acc.n_outside_cluster else "")
           + (f"<tr><td>of them already answered so by the base model</td><td></td><td></td>"
              f"<td class=num>{_e(len(acc.known_to_base))}</td></tr>" if acc.known_to_base else "")
           + (f"<tr><td>rows asking an eval prompt with another answer</td><td class=num>{_e(acc.eval_conflict_rows)}"
              f"</td><td class=num><b>{_e(acc.eval_conflict_in_set)}</b></td><td class=num>"
              f"{_e(acc.eval_conflict_rows - (acc.eval_conflict_in_set or 0))}</td></tr>"
              if acc.eval_conflict_rows is not None else "")
           + "</table>",
           f'<p class="muted">Split by <code>{_e(acc.method)}</code>: {_e(acc.reason)}. The set is the '
           "<code>accused</code> column of rankings.parquet; <code>gradian counterfactual --drop accused</code> "
           "retrains without it.</p>"]
    if spans:
        out.append('<h3>Harmful span of the top accused examples</h3><table id="accused-spans">'
                   "<tr><th>example</th><th>query item</th><th>text (harmful span marked)</th></tr>")
        for sp in spans:
            out.append(f"<tr><td><code>{_e(sp.example_id)}</code></td><td>{_e(sp.item_id)}</td>"
                       f'<td class="span">{_marked(sp)}</td></tr>')
        out.append("</table>")
    return "".join(out) + "</section>"


def _marked(span: Span) -> str:
    """The example's text with each word shaded by its harm and the harmful span marked."""
    text = span.text
    start, end = span.span_start, span.span_end
    words = span.words
    peak = max([-float(w.score) for w in words if float(w.score) < 0] or [0.0])
    pieces, cursor = [], 0
    for w in sorted(words, key=lambda w: w.start):
        a, b = w.start, w.end
        if a < cursor or b > len(text):
            continue
        pieces.append(_e(text[cursor:a]))
        harm = -float(w.score)
        inside = isinstance(start, int) and isinstance(end, int) and start <= a and b <= end
        alpha = 0.15 + 0.6 * harm / peak if peak > 0 and harm > 0 else 0.0
        style = f' style="background:rgba(192,57,43,{alpha:.2f})"' if alpha > 0 else ""
        cls = ' class="harmful"' if inside else ""
        pieces.append(f"<mark{cls}{style}>{_e(text[a:b])}</mark>" if (inside or alpha > 0) else _e(text[a:b]))
        cursor = b
    pieces.append(_e(text[cursor:]))
    return "".join(pieces)


def _findings(findings: Sequence[ReportFinding]) -> str:
    out = ['<section id="findings"><h2>Findings</h2>']
    if not findings:
        return "".join(out) + "<p>No check fired.</p></section>"
    out.append('<table id="findings-table"><tr><th>severity</th><th>check</th><th>finding</th></tr>')
    for f in findings:
        sev = _e(f.severity)
        ids = f.example_ids or []
        extra = []
        if f.message:
            extra.append(f"<p>{_e(f.message)}</p>")
        if f.fix:
            extra.append(f"<p><b>Fix:</b> {_e(f.fix)}</p>")
        if f.evidence:
            extra.append(f"<pre>{_e(json.dumps(f.evidence, sort_keys=True, default=str))}</pre>")
        if ids:
            extra.append("<p>Examples: " + ", ".join(f"<code>{_e(e)}</code>" for e in ids[:20])
                         + (f" and {len(ids) - 20} more" if len(ids) > 20 else "") + "</p>")
        out.append(f'<tr class="finding sev-row-{sev}"><td><span class="sev sev-{sev}">{sev}</span></td>'
                   f"<td><code>{_e(f.id)}</code></td><td><details><summary>{_e(f.title)}</summary>"
                   + "".join(extra) + "</details></td></tr>")
    return "".join(out) + "</table></section>"


def render_html(report: Report | Mapping[str, object], plots: Mapping[str, bytes] | None = None) -> str:
    """The whole page; ``plots`` maps figure names (``gradian.report.plots``) to PNG bytes."""
    plots = plots or {}
    report = Report.of(report)
    verdict, cap, attr = report.verdict, report.capability, report.attribution
    diagnose = report.kind == "diagnose" or (attr is None and cap is None)
    title = "Gradian diagnosis" if diagnose else "Gradian report"
    if cap is not None and cap.name:
        title += f": {cap.name}"
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
             f"<meta name=viewport content='width=device-width, initial-scale=1'><style>{_CSS}</style></head>"
             f"<body><main><h1>{_e(title)}</h1>", _verdict(verdict)]
    if cap is not None:
        parts.append(_capability(cap, plots.get("capability")))
    if attr is not None:
        parts.append(_attribution(attr, verdict.accused_cluster, plots, item_prompts(report)))
    if plots.get("training"):
        parts.append('<section id="training"><h2>Training curves</h2>'
                     + _img("training", plots["training"], "loss and grad-norm curves with flagged steps")
                     + "</section>")
    parts.append(_findings(report.findings))
    if report.skipped:
        parts.append('<section id="skipped"><h2>Skipped checks</h2><table><tr><th>check</th><th>why</th></tr>'
                     + "".join(f"<tr><td><code>{_e(s.id)}</code></td><td>{_e(s.reason)}</td></tr>"
                               for s in report.skipped) + "</table></section>")
    manifest, config_hash = provenance(report.manifest)
    parts.append('<section id="provenance"><h2>Provenance</h2>')
    parts.append(f'<p>Config hash: <code id="config-hash">{_e("not recorded" if config_hash is None else config_hash)}</code></p>')
    parts.append(f"<pre>{_e(json.dumps(manifest, indent=2, sort_keys=True, default=str))}</pre></section>")
    parts.append("</main></body></html>\n")
    return "".join(parts)
