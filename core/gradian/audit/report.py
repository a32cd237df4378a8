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


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_diagnosis_markdown(report: Mapping[str, Any]) -> str:
    verdict = report["verdict"]
    findings = report["findings"]
    lines = ["# Gradian diagnosis", "", f"**Verdict ({verdict['kind']}):** {verdict['summary']}", ""]
    for hedge in verdict.get("hedges", []):
        lines.append(f"- {hedge}")
    if verdict.get("hedges"):
        lines.append("")
    lines += ["## Findings", ""]
    if not findings:
        lines += ["No check fired.", ""]
    else:
        lines += ["| Severity | Check | Finding |", "|---|---|---|"]
        lines += [f"| {f['severity']} | `{f['id']}` | {_cell(f['title'])} |" for f in findings]
        lines.append("")
        for f in findings:
            lines += [f"### {f['severity'].upper()} `{f['id']}`: {f['title']}", "", f["message"], "",
                      f"**Fix:** {f['fix']}", ""]
            if f.get("evidence"):
                lines += ["Evidence: `" + json.dumps(f["evidence"], sort_keys=True, default=str) + "`", ""]
            if f.get("example_ids"):
                shown = ", ".join(f"`{e}`" for e in f["example_ids"][:10])
                more = len(f["example_ids"]) - 10
                lines += [f"Examples: {shown}" + (f" and {more} more" if more > 0 else ""), ""]
    skipped = report.get("skipped") or []
    if skipped:
        lines += ["## Skipped checks", "", "| Check | Why |", "|---|---|"]
        lines += [f"| `{s['id']}` | {_cell(s['reason'])} |" for s in skipped]
        lines.append("")
    return "\n".join(lines)


def write_diagnosis(report: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``diagnose.json`` and ``diagnose.md`` into ``out_dir``; returns both paths."""
    out = Path(out_dir)
    json_path, md_path = out / "diagnose.json", out / "diagnose.md"
    write_text_atomic(json_path, json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    write_text_atomic(md_path, render_diagnosis_markdown(report))
    return json_path, md_path
