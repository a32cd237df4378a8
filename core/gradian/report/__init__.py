"""The report stage: the tables, the verdict and the three renderings people read.

Interface:

- ``cluster_table(scores, example_ids, assignment, examples, top_examples_per_cluster)`` and
  ``top_examples(scores, example_ids, assignment, examples, k, harmful)``: the attribution tables.
  Sign: a positive score reinforced the queried behaviour, a negative one degraded it;
  ``predicted_loss_delta_if_removed = score / n``.
- ``decide_verdict(capability, findings, attribution, thresholds) -> VerdictDecision``: the verdict
  as data (kind, rule, accused cluster, cited figures, hedges as codes), with every threshold in
  ``VerdictThresholds``; ``render_verdict(decision)`` words it. ``synthesize_verdict(...,
  assignment) -> VerdictSynthesis`` adds the ``verdict`` block and the ``attribution.*`` findings
  it raises; ``build_report(...)`` builds the typed ``Report``
  (``gradian.report.schema``: the report.json contract, ``SCHEMA_VERSION``, its JSON Schema) and
  ``assemble_report(...)`` the same dict from plain dicts.
- ``write_report(report, out_dir, rankings, logs, extra_files) -> list[Path]`` (a ``Report`` or its dict):
  report.json, report.md, report.html, plots/*.png and the extra files, all or none;
  ``render_markdown`` and ``render_html`` alone, ``draw_plots``.
"""

from gradian.report.html import render_html
from gradian.report.markdown import render_markdown
from gradian.report.plots import draw_plots, flagged_steps
from gradian.report.schema import SCHEMA_VERSION, Report
from gradian.report.tables import cluster_table, excerpt_of, top_examples
from gradian.report.decision import VerdictDecision, VerdictThresholds, assess_lumpiness, decide_verdict
from gradian.report.verdict import VerdictSynthesis, assemble_report, build_report, synthesize_verdict
from gradian.report.verdict_prose import render_verdict
from gradian.report.write import REPORT_FILES, write_report

__all__ = [
    "REPORT_FILES",
    "Report",
    "SCHEMA_VERSION",
    "VerdictDecision",
    "VerdictSynthesis",
    "VerdictThresholds",
    "assemble_report",
    "assess_lumpiness",
    "build_report",
    "cluster_table",
    "decide_verdict",
    "draw_plots",
    "excerpt_of",
    "flagged_steps",
    "render_html",
    "render_markdown",
    "render_verdict",
    "synthesize_verdict",
    "top_examples",
    "write_report",
]
