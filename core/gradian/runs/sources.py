"""Resolve a ``--run`` value to a RunRecord: a local directory, or a tracking-server run.

Remote sources register themselves under the ``gradian.run_sources`` entry-point group, each
pointing at a function ``(ref, cache_dir, **options) -> RunRecord`` with a ``matches(ref) -> bool``
beside it (options: ``trust_run_dataset``, ``dataset_given``; see ``gradian_mlflow.source``). The
MLflow integration registers ``mlflow`` this way, so the engine never imports mlflow.
Reports go back the same way, through the ``gradian.report_sinks`` group.
"""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path

from gradian.errors import RunRecordError
from gradian.runs.reader import read_run_dir
from gradian.runs.record import RunRecord

__all__ = ["resolve_run", "is_remote_run_ref", "publish_report"]

_REMOTE = re.compile(r"^(runs:/|mlflow:)|^[0-9a-f]{32}$")


def is_remote_run_ref(ref: str) -> bool:
    """``runs:/<id>``, ``mlflow:<id>`` or a bare 32-hex run id that is not a local folder."""
    return bool(_REMOTE.match(ref.strip())) and not Path(ref).exists()


def resolve_run(ref: str, cache_dir: str | Path = ".gradian", **options: bool) -> RunRecord:
    """Read ``ref``; ``options`` (e.g. ``trust_run_dataset``) go to a tracking-server reader as
    keywords, and only when given, so a reader that takes none keeps working."""
    if not is_remote_run_ref(ref):
        return read_run_dir(ref)
    sources = {ep.name: ep for ep in entry_points(group="gradian.run_sources")}
    if "mlflow" not in sources:
        raise RunRecordError(
            f"'{ref}' names a tracking-server run, but no run source is installed; "
            "install gradian-mlflow with its MLflow integration, or pass a local run directory"
        )
    reader = sources["mlflow"].load()
    return reader(ref, cache_dir=Path(cache_dir) / "mlflow", **options)


def publish_report(
    source: str | None,
    report: dict,
    kind: str,
    files: list[Path] | tuple = (),
    rankings: object = None,
) -> str | None:
    """Log ``report`` back to where the run came from; returns the new run id, or None.

    Only tracking-server runs (``source`` ``mlflow:<id>``) have somewhere to log to; a local run
    directory returns None. The sink is found through the ``gradian.report_sinks`` entry points.
    """
    if not source or not source.startswith("mlflow:"):
        return None
    sinks = {ep.name: ep for ep in entry_points(group="gradian.report_sinks")}
    if "mlflow" not in sinks:
        raise RunRecordError("no MLflow report sink is installed; pass --no-log or install gradian-mlflow")
    return sinks["mlflow"].load()(source, report, kind=kind, files=list(files), rankings=rankings)
