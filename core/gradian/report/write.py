"""``write_report``: report.json, report.md, report.html and plots/*.png into one folder.

Everything is rendered first and then written all or nothing (``write_report_files``): a disk
that fills up part way leaves none of this report's files, never a report.json without its html
or its rankings, and stops with one line (``DiskFullError``, exit code 3). The returned paths are
what the MLflow sink logs as artifacts.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from gradian.atomic import write_files_atomic
from gradian.sizes import format_size
from gradian.errors import DiskFullError
from gradian.report.html import render_html
from gradian.report.markdown import render_markdown
from gradian.report.plots import draw_plots
from gradian.report.schema import Report

if TYPE_CHECKING:
    import pandas as pd

    from gradian.runs import TrainingLogs

__all__ = ["REPORT_FILES", "write_report", "write_report_files"]

#: file names inside the output folder
REPORT_FILES = {"json": "report.json", "markdown": "report.md", "html": "report.html", "plots": "plots"}


def _jsonable(value: object) -> object:
    """Non-finite floats become null: strict JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_report(report: Report | Mapping[str, object], out_dir: str | Path, rankings: pd.DataFrame | None = None,
                 logs: TrainingLogs | None = None, extra_files: Mapping[str, bytes] | None = None) -> list[Path]:
    """Write the report in all three forms plus its figures; returns every path written.

    ``report`` is a ``Report`` (written through ``to_json()``) or a dict of its shape.

    ``rankings``: a DataFrame with ``score`` (and ``cluster``) per example, for the score
    distribution; ``logs``: a ``gradian.runs.TrainingLogs`` for the training curves. Either may be
    None, and the report may lack ``capability``/``attribution`` (a diagnose report).
    ``extra_files`` (``{name: bytes}``, e.g. rankings.parquet) are written with the report, in the
    same all-or-nothing write, and returned after it.
    """
    typed = Report.of(report)
    document = report.to_json() if isinstance(report, Report) else report
    plots = draw_plots(typed, rankings, logs)
    files = {
        REPORT_FILES["json"]: (json.dumps(_jsonable(document), indent=2, default=str, allow_nan=False) + "\n").encode("utf-8"),
        REPORT_FILES["markdown"]: render_markdown(typed, plots=list(plots)).encode("utf-8"),
        REPORT_FILES["html"]: render_html(typed, plots).encode("utf-8"),
    }
    files.update({f"{REPORT_FILES['plots']}/{name}.png": png for name, png in plots.items()})
    files.update(extra_files or {})
    return write_report_files(out_dir, files)


def write_report_files(out_dir: str | Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write ``files`` (``{name: bytes}``) into ``out_dir``, every one or none; returns their paths.

    A full disk (or quota) raises ``DiskFullError`` naming the folder, the bytes and the fix; the
    folder keeps what it held before (and is removed again when this call created it).
    """
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return write_files_atomic(out, files)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if created:
            shutil.rmtree(out, ignore_errors=True)

        existing = out
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        raise DiskFullError(
            f"the disk under {out} filled up while the report was written ({len(files)} files, "
            f"{format_size(sum(len(data) for data in files.values()))}; {format_size(free)} free): none of this "
            "report's files were written; free space or pass another --out, then run the command again"
        ) from None
