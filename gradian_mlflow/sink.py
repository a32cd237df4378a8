"""Log a diagnosis as a child run of the training run it diagnoses.

The child run sits in the source run's experiment with ``mlflow.parentRunId`` pointing at the
source, so the MLflow UI nests it under the training run and diagnoses can be compared side by
side. Inside ``mlflow run`` the project's own run becomes the child when it is in the source's
experiment; otherwise a fresh child is created there and the project run links to it.

A child run Gradian creates is named for what it is (``child_run_name``: ``diagnose``,
``attribute-<engine>-<capability>``, ``counterfactual-<what was dropped>-<capability>``,
``index-<index id>``) and starts when the work started (``work_started_ms``: the report's
``manifest.started_at``, else its ``manifest.seconds`` before now), so the UI shows how long the
diagnosis took rather than how long logging it did.

What is logged (artifact keys in ``ArtifactKeys``):
- tags ``gradian.source_run_id``, ``gradian.kind``, ``gradian.verdict``, ``gradian.index_id``,
  ``gradian.capability``; the summary as the run description; a back-link tag on the source run;
- metrics under ``capability.*``, ``attribution.*``, ``audit.*``, ``index.*``;
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

import json
import math
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from gradian.redact import redact
from gradian.report.schema import (
    AttributeManifest,
    CounterfactualManifest,
    DiagnoseManifest,
    IndexBuildManifest,
    IndexSummary,
    Manifest,
    Report,
)
from gradian.termination import sigterm_raises
from gradian_mlflow.client import TrackingError, call, get_client, parse_run_ref

__all__ = ["ArtifactKeys", "STALE_AFTER_HOURS", "child_run_name", "flatten_numbers", "log_diagnosis", "publish",
           "report_metrics", "stale_children", "work_started_ms"]

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


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


def flatten_numbers(data: Any, prefix: str = "", *, key: Callable[[str], str] = str,
                    max_list: int = 0) -> dict[str, float]:
    """Finite numbers (booleans as 0/1) in nested mappings, keyed by their dotted path.

    ``key`` rewrites each mapping key (e.g. into MLflow-safe characters); lists of at most
    ``max_list`` items are flattened by position, longer ones (and all, at 0) are skipped.
    """
    out: dict[str, float] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            name = key(str(k))
            out.update(flatten_numbers(v, f"{prefix}.{name}" if prefix else name, key=key, max_list=max_list))
    elif isinstance(data, list) and len(data) <= max_list:
        for i, v in enumerate(data):
            out.update(flatten_numbers(v, f"{prefix}.{i}", key=key, max_list=max_list))
    elif (number := _num(data)) is not None:
        out[prefix] = number
    return out


def report_metrics(report: "Report | Mapping[str, Any]") -> dict[str, float]:
    """Flat metric dict of a report (finite numbers only)."""
    report = Report.of(report)
    metrics: dict[str, float] = {}
    cap = report.capability
    if cap is not None:
        for key, value in (("base", cap.base), ("tuned", cap.tuned), ("delta", cap.delta), ("n_items", cap.n_items),
                           ("n_flipped", cap.n_flipped), ("n_base_failing", cap.n_base_failing)):
            _put(metrics, f"capability.{key}", value)
        ci = cap.ci or []
        if len(ci) == 2 and all(_num(v) is not None for v in ci):
            metrics["capability.ci_low"], metrics["capability.ci_high"] = float(ci[0]), float(ci[1])
        # a regression read from fewer items than evaluation.min_items is not one
        metrics["capability.regressed"] = float(cap.status == "regressed" and not cap.too_few_items)

    attribution = report.attribution
    if attribution is not None:
        _put(metrics, "attribution.engine_agreement_spearman", attribution.engine_agreement_spearman)
        # the report's ``gated`` means the gate failed and scores were computed anyway (gate off)
        metrics["attribution.gate_passed"] = float(not attribution.gated)
        clusters = attribution.clusters
        metrics["attribution.n_clusters"] = float(len(clusters))
        if clusters:
            top = max(clusters, key=lambda c: c.share_of_negative or 0.0)
            _put(metrics, "attribution.top_cluster_share_of_negative", top.share_of_negative)
        accused = attribution.accused
        if accused is not None:
            metrics["attribution.accused_n"] = float(accused.n)
            for key, value in (("share_of_negative", accused.share_of_negative),
                               ("share_of_cluster_harm", accused.share_of_cluster_harm),
                               ("estimated_harmful_share", accused.estimated_harmful_share)):
                _put(metrics, f"attribution.accused_{key}", value)
        if attribution.metrics is not None:
            for key, value in attribution.metrics.to_json().items():
                _put(metrics, f"attribution.{key}", value)

    metrics["audit.n_findings"] = float(len(report.findings))
    for severity in ("critical", "high", "medium", "low", "info"):
        metrics[f"audit.n_{severity}"] = float(sum(f.severity == severity for f in report.findings))

    counterfactual = report.counterfactual
    if counterfactual is not None:
        for key, value in counterfactual.capability.to_json().items():
            _put(metrics, f"counterfactual.{key}", value)
        for key, value in (counterfactual.predicted.to_json() if counterfactual.predicted else {}).items():
            _put(metrics, f"counterfactual.predicted.{key}", value)
        truth = counterfactual.ground_truth
        if truth is not None:
            _put(metrics, "counterfactual.removal_precision", truth.precision)
            _put(metrics, "counterfactual.removal_recall", truth.recall)
        _put(metrics, "counterfactual.n_removed", counterfactual.removal.n_removed)
        if counterfactual.seconds is not None:
            _put(metrics, "counterfactual.train_seconds", counterfactual.seconds.train)
            _put(metrics, "counterfactual.evaluate_seconds", counterfactual.seconds.evaluate)
    _put(metrics, "gradian.total_seconds", _seconds(report.manifest))

    index = _index(report.manifest)
    for key, value in (index.to_json() if index is not None else {}).items():
        _put(metrics, f"index.{key}", value)
    return metrics


def _put(metrics: dict[str, float], name: str, value: Any) -> None:
    """Set ``metrics[name]`` when ``value`` is a finite number (a boolean as 0/1)."""
    number = _num(value)
    if number is not None:
        metrics[name] = number


def _seconds(manifest: Manifest) -> float | None:
    """How long the work took, when the manifest records it."""
    if isinstance(manifest, (AttributeManifest, DiagnoseManifest, IndexBuildManifest, CounterfactualManifest)):
        return manifest.seconds
    return None


def _index(manifest: Manifest) -> IndexSummary | None:
    """The gradient index the work used or built, when the manifest names one."""
    if isinstance(manifest, (AttributeManifest, IndexBuildManifest)):
        return manifest.index
    return None


_NAME_PART = re.compile(r"[^A-Za-z0-9_.]+")
_EPOCH_2000_MS = 946_684_800_000


def _name_part(value: Any, limit: int = 40) -> str:
    """``value`` as one hyphen-free piece of a run name: other characters become ``_``."""
    return _NAME_PART.sub("_", str(value)).strip("_")[:limit] or "none"


def child_run_name(report: "Report | Mapping[str, Any]", kind: str) -> str:
    """The name of the child run that holds ``report``: short, deterministic, saying what it is.

    ``diagnose``; ``attribute-<engine>-<capability>`` (``attribute-<capability>`` when nothing was
    attributed); ``counterfactual-<dropped>-<capability>`` with ``accused``, ``cluster<name>`` or
    ``<n>ids`` for what was dropped; ``index-<first 12 of the index id>``; else ``<kind>``.
    """
    report = Report.of(report)
    inputs = report.inputs
    capability = (report.capability.name if report.capability is not None else None) \
        or (inputs.capability if inputs is not None else None)
    cap = [_name_part(capability)] if capability else []
    if kind == "attribute":
        engine = report.attribution.engine if report.attribution is not None else None
        return "-".join(["attribute", *([_name_part(engine)] if engine else []), *cap])
    if kind == "counterfactual":
        removal = report.counterfactual.removal if report.counterfactual is not None else None
        if removal is not None and removal.cluster is not None:
            dropped = f"cluster{_name_part(removal.cluster, 24)}"
        elif removal is not None and removal.reason.startswith("the report's accused set"):
            dropped = "accused"
        else:
            dropped = f"{removal.n_removed if removal is not None else 0}ids"
        return "-".join(["counterfactual", dropped, *cap])
    if kind == "index":
        index = _index(report.manifest)
        return f"index-{_name_part(index.index_id, 12)}" if index is not None and index.index_id else "index"
    return _name_part(kind)


def work_started_ms(report: "Report | Mapping[str, Any]", now_ms: int, started_at: float | None = None) -> int:
    """When the work behind ``report`` started, in ms since the epoch (the child run's start time).

    ``started_at`` (seconds since the epoch) when the caller knows it, else the manifest's
    ``started_at``, else ``now_ms`` minus the manifest's ``seconds``, else ``now_ms``. A time in the
    future or before 2000 is ignored.
    """
    manifest = Report.of(report).manifest
    recorded = manifest.started_at if isinstance(manifest, (DiagnoseManifest, IndexBuildManifest)) else None
    candidates = [number * 1000 for number in (_num(v) for v in (started_at, recorded) if not isinstance(v, bool))
                  if number is not None]
    seconds = _num(_seconds(manifest))
    if seconds is not None:
        candidates.append(now_ms - seconds * 1000)
    for ms in candidates:
        if _EPOCH_2000_MS <= ms <= now_ms:
            return int(ms)
    return now_ms


def _params(report: Report) -> dict[str, str]:
    """The child run's parameters: Gradian's version and config hash, the engines and the query,
    the engine's own settings as it describes them (``manifest.engine_state.params``), the metric."""
    manifest = report.manifest
    attribution = report.attribution
    state = manifest.engine_state if isinstance(manifest, AttributeManifest) else None
    raw: dict[str, Any] = {
        "gradian.version": manifest.gradian_version if isinstance(
            manifest, (AttributeManifest, DiagnoseManifest, CounterfactualManifest)) else None,
        "gradian.config_hash": manifest.config_hash if isinstance(
            manifest, (AttributeManifest, CounterfactualManifest)) else None,
        "engine": attribution.engine if attribution is not None else None,
        "cross_check": attribution.cross_check if attribution is not None else None,
        "query_signal": attribution.query_signal if attribution is not None else None,
        **(state.params if state is not None else {}),
        "metric": report.capability.metric if report.capability is not None else None,
    }
    return {k: str(v)[:500] for k, v in raw.items() if v is not None}


def _resolved_params(client: Any, run_id: str, params: dict[str, str]) -> dict[str, str]:
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


def _tags(report: Report, source_run_id: str, kind: str) -> dict[str, str]:
    tags = {
        "gradian.source_run_id": source_run_id,
        "gradian.kind": kind,
        "gradian.verdict": report.verdict.kind,
        "mlflow.note.content": report.verdict.summary,
    }
    index = _index(report.manifest)
    if index is not None and index.index_id:
        tags["gradian.index_id"] = index.index_id
    if report.capability is not None and report.capability.name:
        tags["gradian.capability"] = report.capability.name
    if report.counterfactual is not None and report.counterfactual.outcome:
        tags["gradian.counterfactual_outcome"] = report.counterfactual.outcome
    return tags


def _findings_table(report: Report) -> dict[str, list[Any]]:
    findings = report.findings
    return {
        "id": [f.id for f in findings],
        "severity": [f.severity for f in findings],
        "title": [f.title for f in findings],
        "n_examples": [len(f.example_ids) for f in findings],
        "evidence": [json.dumps(f.evidence, sort_keys=True, default=str) for f in findings],
        "fix": [f.fix for f in findings],
    }


def _clusters_table(report: Report) -> dict[str, list[Any]] | None:
    clusters = report.attribution.clusters if report.attribution is not None else []
    if not clusters:
        return None
    return {
        "cluster": [c.cluster for c in clusters],
        "label": [c.label for c in clusters],
        "n": [c.n for c in clusters],
        "signed_influence": [c.signed_influence for c in clusters],
        "share_of_negative": [c.share_of_negative for c in clusters],
        "mean_per_example": [c.mean_per_example for c in clusters],
    }


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


def stale_children(client: Any, source: Any, *, now_ms: int | None = None) -> list[tuple[Any, str]]:
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


def _close_stale_children(client: Any, source: Any) -> None:
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


def _open_child(client: Any, source: Any, tags: dict[str, str], into_run: str | None, *, run_name: str,
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
    report: "Report | Mapping[str, Any]",
    source_run: str,
    *,
    kind: str,
    files: Sequence[str | Path] = (),
    rankings: Any = None,
    client: Any = None,
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
    tags = _tags(report, source_id, kind)
    with sigterm_raises():
        run_id, created = _open_child(client, source, tags, into_run, run_name=child_run_name(report, kind),
                                      start_ms=work_started_ms(report, int(time.time() * 1000), started_at))
        try:
            _log_into(client, run_id, source_id, report, kind=kind, tags=tags, files=files,
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


def _close_failed(client: Any, run_id: str, *, attempts: int) -> str:
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


def _log_into(client: Any, run_id: str, source_id: str, report: Report, *, kind: str,
              tags: dict[str, str], files: Sequence[str | Path], rankings: Any, close: bool) -> None:
    """Everything the child run holds, then (``close``) FINISHED."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in sorted(report_metrics(report).items())]
    params = [Param(k, v) for k, v in sorted(_resolved_params(client, run_id, _params(report)).items())]
    tag_list = [RunTag(k, v) for k, v in tags.items()] + [RunTag("mlflow.parentRunId", source_id)]
    call("logging metrics", lambda: client.log_batch(run_id, metrics=metrics, params=params, tags=tag_list))
    datasets = dataset_inputs(report)
    if datasets:
        call("logging the datasets as the run's inputs", lambda: client.log_inputs(run_id, datasets=datasets))
    call("logging the manifest", lambda: client.log_dict(run_id, report.manifest.to_json(), ArtifactKeys.MANIFEST))
    call("logging the findings table", lambda: client.log_table(run_id, data=_findings_table(report), artifact_file=ArtifactKeys.FINDINGS_TABLE))
    clusters = _clusters_table(report)
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


#: the input tag MLflow reads a dataset's role from, and Gradian's two roles
DATA_CONTEXT_TAG = "mlflow.data.context"


def _file_digest(path: str) -> str:
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def dataset_inputs(report: Report) -> list[Any]:
    """The training data and the eval set the report analyzed, as MLflow dataset inputs (name,
    digest from the file's sha256, source path, row count as the profile; context ``training`` /
    ``evaluation``), so the child run's "Datasets" show what it read. A counterfactual's training
    data is the kept rows it retrained on."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = getattr(report.manifest, "inputs", None)
    training = getattr(inputs, "kept_dataset", None) or getattr(inputs, "dataset", None)
    out = []
    for ref, context in ((training, "training"), (getattr(inputs, "eval_dataset", None), "evaluation")):
        path = ref if isinstance(ref, str) else getattr(ref, "path", None)
        if not path:
            continue
        sha = (getattr(ref, "sha256", None) if not isinstance(ref, str) else None) or _file_digest(str(path))
        rows = None if isinstance(ref, str) else getattr(ref, "n_examples", None)
        dataset = Dataset(
            name=Path(str(path)).name,
            digest=sha[:16] or "unknown",
            source_type="local",
            source=json.dumps({"uri": str(path)}),
            profile=json.dumps({"num_rows": rows}) if rows is not None else None,
        )
        out.append(DatasetInput(dataset=dataset, tags=[InputTag(DATA_CONTEXT_TAG, context)]))
    return out


#: rows of rankings_top.csv
TOP_ROWS = 100


def top_rows_csv(rankings: Any, k: int = TOP_ROWS) -> bytes:
    """The ``k`` most harmful rows of a rankings frame (by ``harm_rank`` when it has one, else by
    ``score``), as UTF-8 CSV with a header."""
    order = "harm_rank" if "harm_rank" in rankings.columns else "score"
    return rankings.sort_values(order, kind="stable").head(k).to_csv(index=False).encode("utf-8")


def run_url(run_id: str) -> str | None:
    """The ``gradian.report_sinks`` link hook: where to see ``run_id`` (a child run ``publish``
    returned) in the MLflow UI's training view, or None when the store has no UI address."""
    from gradian_mlflow.experiment import run_url as training_run_url

    return training_run_url(run_id)


def publish(source: str, report: "Report | Mapping[str, Any]", *, kind: str, files: Sequence[str | Path] = (),
            rankings: Any = None, into_run: str | None = None, started_at: float | None = None) -> str:
    """The ``gradian.report_sinks`` entry point: ``source`` is ``mlflow:<run_id>``."""
    return log_diagnosis(report, source, kind=kind, files=files, rankings=rankings, into_run=into_run,
                         started_at=started_at)
