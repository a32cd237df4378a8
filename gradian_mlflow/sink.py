"""Log a diagnosis as a child run of the training run it diagnoses.

The child run sits in the source run's experiment with ``mlflow.parentRunId`` pointing at the
source, so the MLflow UI nests it under the training run and diagnoses can be compared side by
side. Inside ``mlflow run`` the project's own run becomes the child when it is in the source's
experiment; otherwise a fresh child is created there and the project run links to it.

What a child run holds (its name, start time, metrics, params, tags and tables) is the report's
projection for every tracker, ``gradian.report.tracker.tracker_view``; this module makes the
MLflow calls. A child run Gradian creates is named for what it is (``diagnose``,
``attribute-<engine>-<capability>``, ``counterfactual-<what was dropped>-<capability>``,
``index-<index id>``) and starts when the work started (the report's ``manifest.started_at``, else
its ``manifest.seconds`` before now), so the UI shows how long the diagnosis took rather than how
long logging it did.

What is logged (artifact keys in ``ArtifactKeys``):
- tags ``gradian.source_run_id``, ``gradian.kind``, ``gradian.verdict``, ``gradian.index_id``,
  ``gradian.capability``; the summary as the run description; a back-link tag on the source run;
  ``gradian.training_data`` (``same`` / ``changed``) when the source run logged its training data,
  with ``gradian.training_data_note`` and a warning when it changed (``gradian_mlflow.lineage``);
- inputs: the training data and the eval set as datasets, and the source run's LoggedModel the
  adapter came from as a model input;
- metrics under ``capability.*`` (tied to that LoggedModel and the eval set when there is one, so
  they show on the model's page), ``attribution.*``, ``audit.*``, ``index.*``;
- the report files, ``manifest.json``, ``rankings.parquet`` (every example, ``accused`` marking the
  accused set), ``accused.parquet`` (the accused set's rows alone, when the verdict names one),
  ``rankings_top.csv`` (the most harmful rows, which the UI previews as a table), the clusters and
  findings tables through ``log_table`` (previewed and compared by the UI), PNG plots.

A child run Gradian creates is closed FAILED on every way out short of SIGKILL: an error (the
server's included, after its retries), Ctrl-C, or SIGTERM (turned into an exception while the run
is open, ``gradian.termination``). When the server itself is gone, closing it is retried once and
the error names the run that may stay RUNNING. Each created run carries ``gradian.host`` and
``gradian.pid``; before opening a new child, the source's RUNNING children whose process is gone
(same host) or that logging opened more than ``STALE_AFTER_HOURS`` ago are named in a warning, marked
FAILED and tagged ``gradian.stale=true``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from gradian.redact import redact
from gradian.report.schema import Report
from gradian.runs.ref import RunRef
from gradian.report.tracker import TrackerView, top_rows_csv, tracker_view, work_started_ms
from gradian.termination import sigterm_raises
from gradian_mlflow.client import TrackingError, call, get_client, parse_run_ref
from gradian_mlflow.lineage import analyzed_model, dataset_inputs, model_metrics, training_data_check

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from pandas import DataFrame

__all__ = ["ArtifactKeys", "STALE_AFTER_HOURS", "dataset_inputs", "log_diagnosis", "publish", "run_url",
           "stale_children"]

#: a RUNNING child older than this is stale whatever host it came from (logging one takes minutes)
STALE_AFTER_HOURS = 6.0
#: attempts at marking a child FAILED after an error, and the pause between them (seconds)
_CLOSE_ATTEMPTS = 2
_CLOSE_PAUSE_S = 2.0


class ArtifactKeys:
    """Artifact paths inside the child run, in one place."""

    ROOT = "gradian"
    MANIFEST = "gradian/manifest.json"
    RANKINGS = "gradian/rankings.parquet"
    ACCUSED = "gradian/accused.parquet"
    #: the most harmful rows as CSV: the artifact viewer previews CSV, not Parquet
    RANKINGS_TOP = "gradian/rankings_top.csv"
    CLUSTERS_TABLE = "gradian/clusters.json"
    FINDINGS_TABLE = "gradian/findings.json"
    PLOTS = "gradian/plots"


def _resolved_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> dict[str, str]:
    """``params`` minus what the run already holds; a differing value goes under ``<key>.resolved``.

    Under ``mlflow run`` the project's parameters are logged before Gradian starts, and MLflow
    refuses to change a logged value: a parameter left empty (``engine`` when the config decides)
    keeps its given value, and the value Gradian used is logged beside it.
    """
    existing = call(f"reading run {run_id}", lambda: client.get_run(run_id)).data.params
    out = {}
    for key, value in params.items():
        if key not in existing:
            out[key] = value
        elif existing[key] != value:
            out[f"{key}.resolved"] = value
    return out


def _tags(view: TrackerView) -> dict[str, str]:
    """The view's tags, with the verdict's summary as the run's description (MLflow's note tag)."""
    return {**view.tags, "mlflow.note.content": view.description}


def _warn(text: str) -> None:
    print(f"warning: {redact(text)}", file=sys.stderr, flush=True)


def _process_gone(host: str | None, pid: str | None) -> bool:
    """Whether ``pid`` on ``host`` is known to have exited (only this host's processes can be asked)."""
    if host != socket.gethostname() or pid is None or not pid.isdigit() or os.name == "nt":
        return False  # on Windows os.kill(pid, 0) would send Ctrl-C, not probe
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, someone else's
        return False
    return False


def stale_children(client: MlflowClient, source: Run, *, now_ms: int | None = None) -> list[tuple[Run, str]]:
    """(run, why) for each of the source run's RUNNING children that Gradian created and that
    nothing will close any more.

    Stale: the recorded process is gone (``gradian.host`` is this host, ``gradian.pid`` not alive)
    or logging opened it (``gradian.opened_ms``, else its start time) more than
    ``STALE_AFTER_HOURS`` ago. Runs without ``gradian.pid`` (the
    ``mlflow run`` project run Gradian adopts, anyone else's runs) are never stale here.
    """
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    source_id = source.info.run_id
    running = call(
        f"listing the running children of {source_id}",
        lambda: client.search_runs(
            [source.info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{source_id}' and attributes.status = 'RUNNING'",
            max_results=200,
        ),
    )
    stale = []
    for run in running:
        tags = run.data.tags
        if "gradian.pid" not in tags:
            continue
        # the start time is when the work began (possibly hours back); staleness counts from when
        # logging opened the run
        opened = tags.get("gradian.opened_ms", "")
        age_h = (now_ms - (int(opened) if opened.isdigit() else run.info.start_time or now_ms)) / 3.6e6
        if _process_gone(tags.get("gradian.host"), tags.get("gradian.pid")):
            stale.append((run, f"its process (pid {tags['gradian.pid']} on {tags['gradian.host']}) is gone"))
        elif age_h > STALE_AFTER_HOURS:
            stale.append((run, f"it started {age_h:.0f} h ago"))
    return stale


def _close_stale_children(client: MlflowClient, source: Run) -> None:
    """Warn about, mark FAILED and tag ``gradian.stale`` each stale child; never fails the new run."""
    try:
        stale = stale_children(client, source)
    except TrackingError:
        return  # a store that cannot search; the request that matters next reports a dead server
    for run, why in stale:
        run_id = run.info.run_id
        try:
            client.set_tag(run_id, "gradian.stale", "true")
            client.set_terminated(run_id, "FAILED")
            done = "marked it FAILED (tag gradian.stale=true)"
        except Exception:  # noqa: BLE001 -- best effort; the warning still names it
            done = "could not mark it FAILED"
        _warn(f"diagnosis run {run_id} ({run.data.tags.get('gradian.kind', '?')}) of source run "
              f"{source.info.run_id} was left RUNNING and {why}; {done}")


def _open_child(client: MlflowClient, source: Run, tags: dict[str, str], into_run: str | None, *, run_name: str,
                start_ms: int) -> tuple[str, bool]:
    """(run id, whether we created it). Reuses the project run inside ``mlflow run`` (which already
    spans the work, under the name ``mlflow run`` gave it); a created run is named ``run_name`` and
    starts at ``start_ms``."""
    _close_stale_children(client, source)
    project_run_id = into_run  # the project run under `mlflow run`, passed down from gradian_mlflow.entry
    # never adopt the project run when the source is its own child: the two would parent each other
    if project_run_id and source.data.tags.get("mlflow.parentRunId") == project_run_id:
        project_run_id = None
    if project_run_id and project_run_id != source.info.run_id:
        project = call("reading the project run", lambda: client.get_run(project_run_id))
        if project.info.experiment_id == source.info.experiment_id:
            call("tagging the project run", lambda: client.set_tag(project_run_id, "mlflow.parentRunId", source.info.run_id))
            return project_run_id, False
    run = call(
        "creating the diagnosis run",
        lambda: client.create_run(
            experiment_id=source.info.experiment_id,
            tags={"mlflow.parentRunId": source.info.run_id, **tags,
                  "gradian.host": socket.gethostname(), "gradian.pid": str(os.getpid()),
                  "gradian.opened_ms": str(int(time.time() * 1000))},
            run_name=run_name,
            start_time=start_ms,
        ),
    )
    if project_run_id and project_run_id != source.info.run_id:
        call("linking the project run", lambda: client.set_tag(project_run_id, "gradian.diagnosis_run_id", run.info.run_id))
    return run.info.run_id, True


def log_diagnosis(
    report: "Report | Mapping[str, object]",
    source_run: str,
    *,
    kind: str,
    files: Sequence[str | Path] = (),
    rankings: DataFrame | None = None,
    client: MlflowClient | None = None,
    started_at: float | None = None,
    into_run: str | None = None,
) -> str:
    """Log ``report`` (a ``Report`` or its report.json dict) and ``files`` as a child run; returns its run id.

    ``rankings`` is a pandas DataFrame with one row per training example, written as
    ``rankings.parquet`` (and its accused rows as ``accused.parquet``) unless ``files`` already
    holds a ``rankings.parquet``, which is then logged as it is. PNG files among ``files`` go under ``plots/``. ``started_at`` (seconds
    since the epoch) is when the work began, if the caller knows better than the report. ``into_run``: a run
    already open for this work (the ``mlflow run`` project run) that becomes the child instead of a
    new one, when it lives in the source's experiment.
    """
    report = Report.of(report)
    client = client or get_client(existing_store=True)
    source_id = parse_run_ref(source_run)
    source = call(f"reading source run {source_id}", lambda: client.get_run(source_id))
    from gradian_mlflow.experiment import mark_training_experiment

    mark_training_experiment(client, source.info.experiment_id)  # so the UI opens it where the runs are
    view = tracker_view(report, kind, source_id)
    tags = _tags(view)
    with sigterm_raises():
        run_id, created = _open_child(client, source, tags, into_run, run_name=view.run_name,
                                      start_ms=work_started_ms(report, int(time.time() * 1000), started_at))
        try:
            _log_into(client, run_id, source, report, view, kind=kind, tags=tags, files=files,
                      rankings=rankings, close=created)
        except TrackingError as err:  # the server failed or refused: retry closing while it may come back
            if not created:
                raise
            raise type(err)(f"{err}; {_close_failed(client, run_id, attempts=_CLOSE_ATTEMPTS)}") from None
        except BaseException:  # any other error, Ctrl-C, SIGTERM: one attempt, and say so
            if created:
                _warn(_close_failed(client, run_id, attempts=1))
            raise
    return run_id


def _close_failed(client: MlflowClient, run_id: str, *, attempts: int) -> str:
    """Mark ``run_id`` FAILED, retrying while the server may come back; the sentence to tell the user."""
    for attempt in range(attempts):
        try:
            client.set_terminated(run_id, "FAILED")
            return f"the diagnosis run {run_id} was marked FAILED"
        except Exception:  # noqa: BLE001 -- the server may be the thing that failed
            if attempt + 1 < attempts:
                time.sleep(_CLOSE_PAUSE_S)
    return (f"the diagnosis run {run_id} could not be marked FAILED and may show as RUNNING; the next "
            "gradian run logged under the same source run marks it FAILED")


def _log_into(client: MlflowClient, run_id: str, source: Run, report: Report, view: TrackerView, *, kind: str,
              tags: dict[str, str], files: Sequence[str | Path], rankings: DataFrame | None, close: bool) -> None:
    """Everything the child run holds, then (``close``) FINISHED."""
    from mlflow.entities import LoggedModelInput, Metric, Param, RunTag

    now = int(time.time() * 1000)
    datasets = dataset_inputs(report)
    source_id = source.info.run_id
    model_id = analyzed_model(client, source, report)
    evaluation = next((d for d in datasets if d.tags and d.tags[0].value == "evaluation"), None)
    metrics = model_metrics([Metric(k, v, now, 0) for k, v in sorted(view.metrics.items())], model_id, evaluation)
    params = [Param(k, v) for k, v in sorted(_resolved_params(client, run_id, view.params).items())]
    tag_list = [RunTag(k, v) for k, v in tags.items()] + [RunTag("mlflow.parentRunId", source_id)]
    check = training_data_check(source, report)
    if check is not None:
        tag_list.append(RunTag("gradian.training_data", check.status))
        if check.status == "changed":
            tag_list.append(RunTag("gradian.training_data_note", check.message[:5000]))
            _warn(check.message)
    call("logging metrics", lambda: client.log_batch(run_id, metrics=metrics, params=params, tags=tag_list))
    models = [LoggedModelInput(model_id)] if model_id is not None else []
    if datasets or models:
        call("logging the datasets and the model as the run's inputs",
             lambda: client.log_inputs(run_id, datasets=datasets, models=models))
    call("logging the manifest", lambda: client.log_dict(run_id, report.manifest.to_json(), ArtifactKeys.MANIFEST))
    call("logging the findings table", lambda: client.log_table(run_id, data=view.findings, artifact_file=ArtifactKeys.FINDINGS_TABLE))
    clusters = view.clusters
    if clusters:
        call("logging the clusters table", lambda: client.log_table(run_id, data=clusters, artifact_file=ArtifactKeys.CLUSTERS_TABLE))
    for path in map(Path, files):
        dest = ArtifactKeys.PLOTS if path.suffix == ".png" else ArtifactKeys.ROOT
        call(f"logging {path.name}", lambda: client.log_artifact(run_id, str(path), artifact_path=dest))
    logged = {Path(f).name for f in files}
    if rankings is not None and "rankings.parquet" not in logged:  # tables written with the report go as they are
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / "rankings.parquet"
            rankings.to_parquet(target, index=False)
            call("logging rankings.parquet", lambda: client.log_artifact(run_id, str(target), artifact_path=ArtifactKeys.ROOT))
            if "accused" in rankings.columns and bool(rankings["accused"].any()):
                accused_rows = Path(tmp) / "accused.parquet"
                rankings[rankings["accused"]].sort_values("score").to_parquet(accused_rows, index=False)
                call("logging accused.parquet", lambda: client.log_artifact(run_id, str(accused_rows), artifact_path=ArtifactKeys.ROOT))
    table = rankings
    if table is None:
        given = next((Path(f) for f in files if Path(f).name == "rankings.parquet"), None)
        if given is not None:
            import pandas as pd

            table = pd.read_parquet(given)
    if table is not None and len(table):
        with tempfile.TemporaryDirectory() as tmp:
            top = Path(tmp) / Path(ArtifactKeys.RANKINGS_TOP).name
            top.write_bytes(top_rows_csv(table))
            call("logging rankings_top.csv", lambda: client.log_artifact(run_id, str(top), artifact_path=ArtifactKeys.ROOT))
    call("tagging the source run", lambda: client.set_tag(source_id, "gradian.diagnosis_run_id", run_id))
    call("tagging the source run", lambda: client.set_tag(source_id, f"gradian.diagnosis.{kind}", run_id))
    if close:
        call("closing the diagnosis run", lambda: client.set_terminated(run_id, "FINISHED"))


def run_url(run_id: str) -> str | None:
    """The ``gradian.report_sinks`` link hook: where to see ``run_id`` (a child run ``publish``
    returned) in the MLflow UI's training view, or None when the store has no UI address."""
    from gradian_mlflow.experiment import run_url as training_run_url

    return training_run_url(run_id)


def publish(ref: RunRef, report: Report, *, kind: str, files: Sequence[Path] = (),
            rankings: DataFrame | None = None, into_run: str | None = None) -> str:
    """The ``gradian.report_sinks`` entry point (a ``gradian.report.sinks.ReportSink``): ``ref`` is
    the ``mlflow:`` (or ``runs:``) reference of the run the report diagnoses."""
    return log_diagnosis(report, str(ref), kind=kind, files=files, rankings=rankings, into_run=into_run)
