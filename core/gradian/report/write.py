"""``write_report``: one writer for every command's report, from one table of renderers.

``RENDERERS`` lists the forms a report is written in (``json``, ``markdown``, ``html``: the file
suffix and the function that renders it); ``write_report(report, out_dir, stem=...)`` renders
every one of them (``report.*`` for attribute and counterfactual, ``diagnose.*`` for diagnose),
the figures under ``plots/`` when asked, and the tables handed in, and writes them all or
nothing (``write_report_files``): a disk that fills up part way leaves none of this report's
files, never a report.json without its html or its rankings, and stops with one line
(``DiskFullError``, exit code 3). The JSON form goes through the NaN guard (a non-finite number
is written as null: strict JSON has none). The returned paths are what a report sink logs.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

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

__all__ = ["REPORT_FILES", "RENDERERS", "Renderer", "write_report", "write_report_files"]


def _jsonable(value: object) -> object:
    """Non-finite floats become null: strict JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True)
class Renderer:
    """One form of a report: its file suffix, and how a typed report (with the names of the plots
    beside it, which may be none) becomes that file's text."""

    suffix: str
    render: Callable[[Report, Mapping[str, bytes]], str]


def _json(report: Report, plots: Mapping[str, bytes]) -> str:
    return json.dumps(_jsonable(report.to_json()), indent=2, default=str, allow_nan=False) + "\n"


def _markdown(report: Report, plots: Mapping[str, bytes]) -> str:
    return render_markdown(report, plots=list(plots))


def _html(report: Report, plots: Mapping[str, bytes]) -> str:
    return render_html(report, plots)


#: every form a report is written in, by name; a new renderer is one line here
RENDERERS: dict[str, Renderer] = {
    "json": Renderer(".json", _json),
    "markdown": Renderer(".md", _markdown),
    "html": Renderer(".html", _html),
}
#: the folder the figures go in
PLOTS_DIR = "plots"
#: file names inside the output folder of an attribute or counterfactual report
REPORT_FILES = {**{name: f"report{r.suffix}" for name, r in RENDERERS.items()}, "plots": PLOTS_DIR}


def write_report(report: Report | Mapping[str, object], out_dir: str | Path, rankings: pd.DataFrame | None = None,
                 logs: TrainingLogs | None = None, extra_files: Mapping[str, bytes] | None = None, *,
                 stem: str = "report", figures: bool = True) -> list[Path]:
    """Write the report in every form of ``RENDERERS`` (``<stem>.json``, ``.md``, ``.html``) plus
    its figures; returns every path written, the forms first in the table's order.

    ``report`` is a ``Report`` or a dict of its shape. ``figures``: draw ``plots/*.png`` (a
    diagnose report has none): ``rankings``, a DataFrame with ``score`` (and ``cluster``) per
    example, for the score distribution; ``logs``, a ``gradian.runs.TrainingLogs`` for the training
    curves. Either may be None, and the report may lack ``capability``/``attribution``.
    ``extra_files`` (``{name: bytes}``, e.g. rankings.parquet) are written with the report, in the
    same all-or-nothing write, and returned after it.
    """
    typed = Report.of(report)
    plots = draw_plots(typed, rankings, logs) if figures else {}
    files = {f"{stem}{r.suffix}": r.render(typed, plots).encode("utf-8") for r in RENDERERS.values()}
    files.update({f"{PLOTS_DIR}/{name}.png": png for name, png in plots.items()})
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
