"""A report as an experiment tracker holds it: run name, start time, metrics, params, tags, tables.

Every report sink logs the same projection of a ``Report``, whatever tracker it writes to, so it
is computed here, in the core, and the sink only makes the tracker's calls (the MLflow sink,
``gradian_mlflow.sink``, is one):

- ``tracker_view(report, kind, source_id)`` -> ``TrackerView``: all of it at once;
- ``child_run_name(report, kind)``: ``diagnose``, ``attribute-<engine>-<capability>``,
  ``counterfactual-<what was dropped>-<capability>``, ``index-<index id>``;
- ``work_started_ms(report, now_ms, started_at)``: when the work began, so a tracker shows how long
  the diagnosis took rather than how long logging it did;
- ``report_metrics(report)``: finite numbers under ``capability.*``, ``attribution.*``, ``audit.*``,
  ``counterfactual.*``, ``index.*``, ``gradian.total_seconds``;
- ``run_params(report)``: Gradian's version and config hash, the engines, the query, the engine's own
  settings as it describes them (``manifest.engine_state.params``), the metric;
- ``run_tags(report, source_id, kind)``: ``gradian.*`` tags (source, kind, verdict, index, capability,
  counterfactual outcome); the verdict's summary is ``TrackerView.description``;
- ``findings_table``, ``clusters_table`` (column -> values) and ``top_rows_csv`` (the most harmful
  rows, for trackers that preview CSV but not Parquet);
- ``flatten_numbers(data)``: the dotted-path flattening the metrics use, for other JSON figures.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from gradian.report.schema import (
    AttributeManifest,
    CounterfactualManifest,
    DiagnoseManifest,
    IndexBuildManifest,
    IndexSummary,
    Manifest,
    Report,
)

if TYPE_CHECKING:
    from pandas import DataFrame

__all__ = ["TOP_ROWS", "TrackerView", "child_run_name", "clusters_table", "findings_table", "flatten_numbers",
           "report_metrics", "run_params", "run_tags", "top_rows_csv", "tracker_view", "work_started_ms"]

#: rows of the most-harmful-rows CSV
TOP_ROWS = 100
#: a tracker param value longer than this is cut (MLflow's limit is 6000; a param is a label)
PARAM_CHARS = 500

#: one column of a table: its values, row by row
Column = list[object]


@dataclass
class TrackerView:
    """What a sink logs for one report (see the module doc)."""

    run_name: str
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    #: the verdict's summary, the run's description
    description: str
    findings: dict[str, Column]
    #: None when the report has no cluster table
    clusters: dict[str, Column] | None = None


def tracker_view(report: Report, kind: str, source_id: str) -> TrackerView:
    """The whole projection of ``report`` (written by the ``kind`` command about run ``source_id``)."""
    return TrackerView(
        run_name=child_run_name(report, kind),
        metrics=report_metrics(report),
        params=run_params(report),
        tags=run_tags(report, source_id, kind),
        description=report.verdict.summary,
        findings=findings_table(report),
        clusters=clusters_table(report),
    )


def _num(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(float(value)):
        return float(value)
    return None


def flatten_numbers(data: object, prefix: str = "", *, key: Callable[[str], str] = str,
                    max_list: int = 0) -> dict[str, float]:
    """Finite numbers (booleans as 0/1) in nested mappings, keyed by their dotted path.

    ``key`` rewrites each mapping key (e.g. into a tracker's safe characters); lists of at most
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


def report_metrics(report: "Report | Mapping[str, object]") -> dict[str, float]:
    """Flat metric dict of a report (finite numbers only)."""
    report = Report.of(report)
    metrics: dict[str, float] = {}
    cap = report.capability
    if cap is not None:
        for key, value in (("base", cap.base), ("tuned", cap.tuned), ("delta", cap.delta), ("n_items", cap.n_items),
                           ("n_flipped", cap.n_flipped), ("n_base_failing", cap.n_base_failing)):
            _put(metrics, f"capability.{key}", value)
        ci = cap.ci or []
        low, high = (_num(v) for v in ci) if len(ci) == 2 else (None, None)
        if low is not None and high is not None:
            metrics["capability.ci_low"], metrics["capability.ci_high"] = low, high
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
            metrics["attribution.accused_known_to_base_n"] = float(len(accused.known_to_base))
            for key, value in (("share_of_negative", accused.share_of_negative),
                               ("share_of_cluster_harm", accused.share_of_cluster_harm),
                               ("estimated_harmful_share", accused.estimated_harmful_share)):
                _put(metrics, f"attribution.accused_{key}", value)
        if attribution.metrics is not None:
            for key, figure in attribution.metrics.to_json().items():
                _put(metrics, f"attribution.{key}", figure)
        query_loss = attribution.query_loss
        if query_loss is not None:
            for key, value in (("base", query_loss.base), ("tuned", query_loss.tuned), ("rise", query_loss.rise)):
                _put(metrics, f"attribution.query_loss_{key}", value)
    harm = report.verdict.harm
    if harm is not None:
        for name, figure in (("cluster_loss", harm.cluster_loss), ("accused_loss", harm.accused_loss),
                             ("accused_first_order", harm.accused_first_order)):
            _put(metrics, f"attribution.harm_{name}", figure)

    metrics["audit.n_findings"] = float(len(report.findings))
    for severity in ("critical", "high", "medium", "low", "info"):
        metrics[f"audit.n_{severity}"] = float(sum(f.severity == severity for f in report.findings))

    counterfactual = report.counterfactual
    if counterfactual is not None:
        for key, figure in counterfactual.capability.to_json().items():
            _put(metrics, f"counterfactual.{key}", figure)
        for key, figure in (counterfactual.predicted.to_json() if counterfactual.predicted else {}).items():
            _put(metrics, f"counterfactual.predicted.{key}", figure)
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
    for key, figure in (index.to_json() if index is not None else {}).items():
        _put(metrics, f"index.{key}", figure)
    return metrics


def _put(metrics: dict[str, float], name: str, value: object) -> None:
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


def _name_part(value: object, limit: int = 40) -> str:
    """``value`` as one hyphen-free piece of a run name: other characters become ``_``."""
    return _NAME_PART.sub("_", str(value)).strip("_")[:limit] or "none"


def child_run_name(report: "Report | Mapping[str, object]", kind: str) -> str:
    """The name of the run that holds ``report``: short, deterministic, saying what it is.

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


def work_started_ms(report: "Report | Mapping[str, object]", now_ms: int, started_at: float | None = None) -> int:
    """When the work behind ``report`` started, in ms since the epoch (the run's start time).

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


def run_params(report: Report) -> dict[str, str]:
    """The run's parameters: Gradian's version and config hash, the engines and the query, the
    engine's own settings as it describes them (``manifest.engine_state.params``), the metric, and
    the base's quantization when it was not the full-precision one."""
    manifest = report.manifest
    attribution = report.attribution
    state = manifest.engine_state if isinstance(manifest, AttributeManifest) else None
    raw: dict[str, object] = {
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
    config = manifest.config if isinstance(manifest, (AttributeManifest, CounterfactualManifest)) else {}
    quantization = config.get("quantization")
    if quantization not in (None, "none"):  # the base the scores were computed on
        raw["quantization"] = quantization
    return {k: str(v)[:PARAM_CHARS] for k, v in raw.items() if v is not None}


def run_tags(report: Report, source_id: str, kind: str) -> dict[str, str]:
    """The ``gradian.*`` tags of the run holding ``report``."""
    tags = {
        "gradian.source_run_id": source_id,
        "gradian.kind": kind,
        "gradian.verdict": report.verdict.kind,
    }
    index = _index(report.manifest)
    if index is not None and index.index_id:
        tags["gradian.index_id"] = index.index_id
    if report.capability is not None and report.capability.name:
        tags["gradian.capability"] = report.capability.name
    if report.counterfactual is not None and report.counterfactual.outcome:
        tags["gradian.counterfactual_outcome"] = report.counterfactual.outcome
    return tags


def findings_table(report: Report) -> dict[str, Column]:
    """One row per finding: id, severity, title, rows named, evidence (JSON), fix."""
    findings = report.findings
    return {
        "id": [f.id for f in findings],
        "severity": [f.severity for f in findings],
        "title": [f.title for f in findings],
        "n_examples": [len(f.example_ids) for f in findings],
        "evidence": [json.dumps(f.evidence, sort_keys=True, default=str) for f in findings],
        "fix": [f.fix for f in findings],
    }


def clusters_table(report: Report) -> dict[str, Column] | None:
    """One row per cluster of the attribution; None without one."""
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


def top_rows_csv(rankings: DataFrame, k: int = TOP_ROWS) -> bytes:
    """The ``k`` most harmful rows of a rankings frame (by ``harm_rank`` when it has one, else by
    ``score``), as UTF-8 CSV with a header."""
    order = "harm_rank" if "harm_rank" in rankings.columns else "score"
    return rankings.sort_values(order, kind="stable").head(k).to_csv(index=False).encode("utf-8")
