"""The ``diagnose`` report: ``diagnose.json`` in the report.json shape, and ``diagnose.md``.

Only ``findings``, ``verdict`` and ``manifest`` are filled (``capability`` and ``attribution`` are
null: the audit measures nothing and attributes nothing); ``skipped`` lists each check that did not
run and why. Both files are written atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from gradian.audit.runner import AuditResult
from gradian.report.schema import Report

if TYPE_CHECKING:
    from gradian.config.verdict import VerdictConfig
    from gradian.jsontypes import JsonValue

__all__ = ["build_diagnosis_report", "render_diagnosis_markdown", "write_diagnosis"]


def build_diagnosis_report(result: AuditResult, inputs: Mapping[str, object] | None = None,
                           audit_config: Mapping[str, JsonValue] | None = None,
                           started_at: float | None = None, thresholds: VerdictConfig | None = None) -> Report:
    """The typed report: ``inputs`` (paths, base model, max_seq_length) go to the manifest;
    ``started_at`` (seconds since the epoch) dates the work and gives its duration."""
    import time

    from gradian import __version__
    from gradian.report.schema import AnalysisInputs, DiagnoseManifest, ReportFinding, SkippedCheckRow, Verdict

    return Report(
        capability=None,
        findings=[ReportFinding.of(f) for f in result.findings],
        attribution=None,
        verdict=Verdict.from_json(result.verdict(thresholds), "verdict"),
        skipped=[SkippedCheckRow.of(s) for s in result.skipped],
        manifest=DiagnoseManifest(
            gradian_version=__version__,
            inputs=AnalysisInputs.from_json(dict(inputs or {}), "manifest.inputs"),
            checks_run=list(result.ran),
            counts=result.counts(),
            audit_config=dict(audit_config or {}),
            started_at=started_at,
            seconds=round(time.time() - started_at, 3) if started_at is not None else None,
        ),
    )


def render_diagnosis_markdown(report: Report | Mapping[str, object]) -> str:
    """``diagnose.md``: the shared report renderer, which knows a diagnose-only report."""
    from gradian.report import render_markdown

    return render_markdown(report)


def write_diagnosis(report: Report | Mapping[str, object], out_dir: str | Path) -> tuple[Path, Path, Path]:
    """Write ``diagnose.json``, ``diagnose.md`` and ``diagnose.html`` into ``out_dir``, all three or
    none, through the one report writer (``gradian.report.write``)."""
    from gradian.report.write import write_report

    json_path, md_path, html_path = write_report(report, out_dir, stem="diagnose", figures=False)
    return json_path, md_path, html_path
