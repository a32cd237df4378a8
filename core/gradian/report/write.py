"""``write_report``: report.json, report.md, report.html and plots/*.png into one folder.

Every file is written atomically. The returned paths are what the MLflow sink logs as artifacts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from gradian.atomic import write_bytes_atomic, write_text_atomic
from gradian.report.html import render_html
from gradian.report.markdown import render_markdown
from gradian.report.plots import draw_plots
from gradian.report.schema import Report

__all__ = ["REPORT_FILES", "write_report"]

#: file names inside the output folder
REPORT_FILES = {"json": "report.json", "markdown": "report.md", "html": "report.html", "plots": "plots"}


def _jsonable(value: Any) -> Any:
    """Non-finite floats become null: strict JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_report(report: Report | Mapping[str, Any], out_dir: str | Path, rankings: Any = None,
                 logs: Any = None) -> list[Path]:
    """Write the report in all three forms plus its figures; returns every path written.

    ``report`` is a ``Report`` (written through ``to_json()``) or a dict of its shape.

    ``rankings``: a DataFrame with ``score`` (and ``cluster``) per example, for the score
    distribution; ``logs``: a ``gradian.runs.TrainingLogs`` for the training curves. Either may be
    None, and the report may lack ``capability``/``attribution`` (a diagnose report).
    """
    if isinstance(report, Report):
        report = report.to_json()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = draw_plots(report, rankings, logs)
    written: list[Path] = []
    for name, png in plots.items():
        path = out / REPORT_FILES["plots"] / f"{name}.png"
        write_bytes_atomic(path, png)
        written.append(path)
    json_path = out / REPORT_FILES["json"]
    write_text_atomic(json_path, json.dumps(_jsonable(report), indent=2, default=str, allow_nan=False) + "\n")
    md_path = out / REPORT_FILES["markdown"]
    write_text_atomic(md_path, render_markdown(report, plots=list(plots)))
    html_path = out / REPORT_FILES["html"]
    write_text_atomic(html_path, render_html(report, plots))
    return [json_path, md_path, html_path] + written
