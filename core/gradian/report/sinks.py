"""Log a report back to where its run came from, through the report sink of the run's scheme.

A report sink is the ``gradian.report_sinks`` entry point named by the scheme of the run
reference (``mlflow`` for ``mlflow:<run id>``; see ``gradian.runs.sources`` for the registry). It
is a ``ReportSink``: called with the parsed ``RunRef`` of the run the report diagnoses and the
typed ``Report``, it logs them and returns the id of the run it logged into. A sink has the
report's tracker projection at hand (``gradian.report.tracker``), so it only makes its tracker's
calls. Its module may also have ``run_url(run_id) -> str | None``: where a user sees that run.

- ``publish_report(source, report, kind, files, rankings, into_run=)`` -> the logged run's id, or
  None for a local run or a scheme without a sink;
- ``report_link(source, run_id)`` -> the sink's link to that run, or None.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

from gradian.errors import RunRecordError
from gradian.report.schema import Report
from gradian.runs.ref import RunRef
from gradian.runs.sources import sink_plugin

if TYPE_CHECKING:
    from pandas import DataFrame

__all__ = ["ReportSink", "publish_report", "report_link"]


@runtime_checkable
class ReportSink(Protocol):
    """A ``gradian.report_sinks`` entry point (a function, or an object with this ``publish``).

    ``ref``: the run the report diagnoses (its scheme is the sink's). ``kind``: the command that
    wrote the report (``attribute``, ``diagnose``, ``counterfactual``, ``index``). ``files``: the
    report's files as written (report.json, .md, .html, plots, and the rankings tables written with
    it, to be logged as they are). ``rankings``: the rankings frame, for a sink that previews it.
    ``into_run``: a run already open for this work, to log into instead of creating one (passed
    only when given). Returns the id of the run the report went into.
    """

    def __call__(self, ref: RunRef, report: Report, *, kind: str, files: Sequence[Path],
                 rankings: DataFrame | None = None, into_run: str | None = None) -> str | None: ...


def publish_report(
    source: "str | RunRef | None",
    report: "Report | Mapping[str, object]",
    kind: str,
    files: Sequence[Path] = (),
    rankings: DataFrame | None = None,
    *,
    into_run: str | None = None,
) -> str | None:
    """Log ``report`` back to where the run ``source`` came from; returns the new run id, or None.

    ``source`` is a RunRecord's ``ref`` (or its spelling, ``mlflow:<id>``); a local run, or a scheme
    with no sink, returns None. ``into_run`` is a run already open for this work (the project run
    under ``mlflow run``) for the sink to log into instead of creating one.
    """
    found = sink_plugin(source)
    if found is None:
        return None
    ref, plugin = found
    loaded = plugin.load()
    sink = getattr(loaded, "publish", loaded)
    if not isinstance(sink, ReportSink):
        raise RunRecordError(f"the report sink for '{ref.scheme}:' ({plugin.entry_point.value}) is not callable; "
                             "fix or uninstall that package")
    extra = {"into_run": into_run} if into_run else {}
    return sink(ref, Report.of(report), kind=kind, files=list(files), rankings=rankings, **extra)


def report_link(source: "str | RunRef | None", run_id: str) -> str | None:
    """Where to see ``run_id`` (logged by the sink of ``source``'s scheme), when that sink's module
    has ``run_url``; None otherwise, or when the link cannot be made (it is only a convenience)."""
    found = sink_plugin(source)
    if found is None:
        return None
    module = importlib.import_module(found[1].entry_point.module)
    make = getattr(module, "run_url", None)
    if not callable(make):
        return None
    try:
        url = make(run_id)
    except Exception:  # noqa: BLE001 -- the report is already logged; a missing link is not an error
        return None
    return url if isinstance(url, str) and url else None
