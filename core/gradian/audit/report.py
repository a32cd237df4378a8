"""The ``diagnose`` report: ``diagnose.json`` in the report.json shape, and ``diagnose.md``.

Only ``findings``, ``verdict`` and ``manifest`` are filled (``capability`` and ``attribution`` are
null: the audit measures nothing and attributes nothing); ``skipped`` lists each check that did not
run and why. Both files are written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from gradian.atomic import write_text_atomic
from gradian.audit.runner import AuditResult

__all__ = ["diagnosis_report", "render_diagnosis_markdown", "write_diagnosis"]


def diagnosis_report(result: AuditResult, inputs: Mapping[str, Any] | None = None,
                     audit_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report dict: ``inputs`` (paths, base model, max_seq_length) go to the manifest."""
    from gradian import __version__

    return {
        "capability": None,
        "findings": [f.to_dict() for f in result.findings],
        "attribution": None,
        "verdict": result.verdict(),
        "skipped": [s.to_dict() for s in result.skipped],
        "manifest": {
            "kind": "diagnose",
            "gradian_version": __version__,
            "inputs": dict(inputs or {}),
            "checks_run": list(result.ran),
            "counts": result.counts(),
            "audit_config": dict(audit_config or {}),
        },
    }


def render_diagnosis_markdown(report: Mapping[str, Any]) -> str:
    """``diagnose.md``: the shared report renderer, which knows a diagnose-only report."""
    from gradian.report import render_markdown

    return render_markdown(report)


def write_diagnosis(report: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path, Path]:
    """Write ``diagnose.json``, ``diagnose.md`` and ``diagnose.html`` into ``out_dir``."""
    from gradian.report import render_html

    out = Path(out_dir)
    json_path, md_path, html_path = out / "diagnose.json", out / "diagnose.md", out / "diagnose.html"
    write_text_atomic(json_path, json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    write_text_atomic(md_path, render_diagnosis_markdown(report))
    write_text_atomic(html_path, render_html(report))
    return json_path, md_path, html_path
