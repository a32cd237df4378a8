"""What a diagnosis read, as MLflow 3 lineage on its child run.

- ``dataset_inputs(report)``: the training data and the eval set as MLflow dataset inputs (name,
  digest, source, row count; context ``training`` / ``evaluation``).
- ``analyzed_model(client, source, report)``: the LoggedModel of the source run that the
  attribution read its adapter from (the HF callback logs checkpoints as LoggedModels), found
  through the download record Gradian keeps beside every adapter it fetched; None for an adapter
  from a local folder, which no LoggedModel can be shown to hold.
- ``model_metrics(metrics, model_id, evaluation)``: the ``capability.*`` metrics tied to that model
  and to the eval set, so they show on the model's page too.
- ``training_data_check(source, report)``: whether the training data read now is the data the
  source run logged as its training input (``DataCheck``); a mismatch means the file changed
  since training, or was logged from another reading of its rows.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Sequence

from gradian.report.schema import Report
from gradian_mlflow.client import call

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import DatasetInput, Metric, Run

__all__ = ["DATA_CONTEXT_TAG", "DOWNLOAD_RECORD", "DataCheck", "analyzed_model", "dataset_inputs", "model_metrics",
           "source_model_ids", "training_data_check"]

#: the input tag MLflow reads a dataset's role from
DATA_CONTEXT_TAG = "mlflow.data.context"
#: the file beside a downloaded folder that records where it came from (``{"uri": ..., "files": ...}``)
DOWNLOAD_RECORD = ".gradian-download.json"
#: the tag on a run trained through Gradian (train_and_log, GradianCallback): its data file's sha256
DATASET_SHA_TAG = "gradian.dataset_sha256"
_TRAINING_CONTEXTS = (None, "train", "training")


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def _path_of(ref: object) -> str | None:
    path = ref if isinstance(ref, str) else getattr(ref, "path", None)
    return str(path) if path else None


def _sha_of(ref: object) -> str:
    """The sha256 the report recorded for ``ref``, else the file's own (empty when unreadable)."""
    path = _path_of(ref)
    recorded = None if isinstance(ref, str) else getattr(ref, "sha256", None)
    return str(recorded or (_file_digest(path) if path else ""))


def _training_ref(report: Report) -> object:
    inputs = getattr(report.manifest, "inputs", None)
    return getattr(inputs, "kept_dataset", None) or getattr(inputs, "dataset", None)


def _evaluation_ref(report: Report) -> object:
    return getattr(getattr(report.manifest, "inputs", None), "eval_dataset", None)


def dataset_inputs(report: Report) -> list[DatasetInput]:
    """The training data and the eval set the report analyzed, as MLflow dataset inputs (name,
    digest from the file's sha256, source path, row count as the profile; context ``training`` /
    ``evaluation``), so the child run's "Datasets" show what it read. A counterfactual's training
    data is the kept rows it retrained on."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    out = []
    for ref, context in ((_training_ref(report), "training"), (_evaluation_ref(report), "evaluation")):
        path = _path_of(ref)
        if not path:
            continue
        rows = None if isinstance(ref, str) else getattr(ref, "n_examples", None)
        dataset = Dataset(
            name=Path(path).name,
            digest=_sha_of(ref)[:16] or "unknown",
            source_type="local",
            source=json.dumps({"uri": path}),
            profile=json.dumps({"num_rows": rows}) if rows is not None else None,
        )
        out.append(DatasetInput(dataset=dataset, tags=[InputTag(DATA_CONTEXT_TAG, context)]))
    return out


def _adapter_origin(report: Report) -> str | None:
    """The artifact URI the analyzed adapter was downloaded from, read from its download record."""
    inputs = getattr(report.manifest, "inputs", None)
    adapter = getattr(inputs, "adapter", None) or getattr(inputs, "adapter_before", None)
    if not adapter:
        return None
    record = Path(str(adapter)) / DOWNLOAD_RECORD
    try:
        uri = json.loads(record.read_text(encoding="utf-8")).get("uri")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return str(uri) if uri else None


def source_model_ids(client: MlflowClient, source: Run) -> list[str]:
    """The ids of the LoggedModels ``source`` produced: its model outputs, else a search by source run."""
    ids = [out.model_id for out in getattr(getattr(source, "outputs", None), "model_outputs", None) or []]
    if ids:
        return list(dict.fromkeys(ids))
    found = call(f"searching the logged models of run {source.info.run_id}", lambda: client.search_logged_models(
        experiment_ids=[source.info.experiment_id], filter_string=f"source_run_id = '{source.info.run_id}'"))
    return [m.model_id for m in found]


def analyzed_model(client: MlflowClient, source: Run, report: Report) -> str | None:
    """The id of the source run's LoggedModel that holds the adapter the report analyzed, or None."""
    origin = _adapter_origin(report)
    if origin is None:
        return None
    if origin.startswith("models:/"):  # models:/<model id>/<path>
        model_id = origin[len("models:/"):].split("/")[0]
        return model_id or None
    for model_id in source_model_ids(client, source):
        model = call(f"reading logged model {model_id}", lambda: client.get_logged_model(model_id))
        base = str(model.artifact_location or "").rstrip("/")
        if base and (origin == base or origin.startswith(base + "/")):
            return model_id
    return None


def model_metrics(metrics: Sequence[Metric], model_id: str | None, evaluation: DatasetInput | None) -> list[Metric]:
    """``metrics`` with each ``capability.*`` one tied to ``model_id`` and the eval dataset (the
    others as they are); unchanged without a model."""
    from mlflow.entities import Metric

    if model_id is None:
        return list(metrics)
    name = evaluation.dataset.name if evaluation is not None else None
    digest = evaluation.dataset.digest if evaluation is not None else None
    return [Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id, dataset_name=name, dataset_digest=digest)
            if m.key.startswith("capability.") else m for m in metrics]


@dataclass(frozen=True)
class DataCheck:
    """The training data read now against the source run's logged training input."""

    status: Literal["same", "changed", "unverified"]
    message: str


def _pandas_digests(path: str) -> set[str]:
    """The digests MLflow gives the rows of ``path`` read as a pandas frame, as Gradian's own runs
    log them (every value as text) and as they are."""
    import pandas as pd

    import mlflow

    suffix = Path(path).suffix.lower()
    try:
        frame = pd.read_parquet(path) if suffix == ".parquet" else pd.read_json(path, lines=suffix == ".jsonl")
    except (OSError, ValueError):
        return set()
    out = set()
    for candidate in (frame.astype(str), frame):
        try:
            with warnings.catch_warnings():  # MLflow's hashing of a frame warns about pandas' future, not ours
                warnings.simplefilter("ignore")
                out.add(str(mlflow.data.from_pandas(candidate).digest))
        except Exception:  # noqa: BLE001 -- a frame MLflow cannot hash (nested values) gives no digest
            continue
    return out


def training_data_check(source: Run, report: Report) -> DataCheck | None:
    """Whether the training data the report read is what ``source`` logged as its training data.

    A run trained through Gradian records the file's sha256 (``gradian.dataset_sha256``), which
    settles it. Otherwise the run's training dataset inputs are compared with the digests MLflow
    gives this file's rows; when none matches the data changed since training, or the run logged
    it from another reading of the rows. None when the run logged nothing to compare with, or the
    report names no training data."""
    ref = getattr(getattr(report.manifest, "inputs", None), "dataset", None)
    path = _path_of(ref)
    if not path:
        return None
    name = Path(path).name
    sha = _sha_of(ref)
    logged_sha = source.data.tags.get(DATASET_SHA_TAG)
    if logged_sha and sha:
        if logged_sha == sha:
            return DataCheck("same", f"{name} has the sha256 the training run recorded")
        return DataCheck("changed", f"the training data read here ({path}, sha256 {sha[:16]}) is not the file the "
                                    f"training run {source.info.run_id} recorded (sha256 {logged_sha[:16]}): it "
                                    "changed since training, so rows may be missing or new")
    logged = []
    for dataset_input in getattr(getattr(source, "inputs", None), "dataset_inputs", None) or []:
        tags = {t.key: t.value for t in (dataset_input.tags or [])}
        if tags.get(DATA_CONTEXT_TAG) in _TRAINING_CONTEXTS:
            logged.append(dataset_input.dataset)
    if not logged:
        return None
    ours = _pandas_digests(path) | ({sha[:16]} if sha else set())
    match = next((d for d in logged if d.digest in ours), None)
    if match is not None:
        return DataCheck("same", f"{name} matches the training run's dataset input {match.name} (digest {match.digest})")
    theirs = ", ".join(f"{d.name} (digest {d.digest})" for d in logged)
    return DataCheck("changed", f"the training data read here ({path}) does not match the training dataset the run "
                                f"{source.info.run_id} logged, {theirs}: it changed since training, or the run "
                                "logged it from another reading of the rows")
