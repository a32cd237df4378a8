"""Read an MLflow training run into a ``RunRecord``.

- params -> trainer config, through the engine's one normalizer (HF and TRL names, string values);
- metric history -> per-step logs (``loss``, ``grad_norm``, ``learning_rate``, ``epoch``,
  ``eval_loss``), with ``trainer_state.json`` from the artifacts as fallback;
- the adapter: the run's own artifacts first (``adapter/``, ``peft/``, the root, ``checkpoint-N/``),
  then its logged models (MLflow 3 keeps models outside run artifacts; the HF callback logs each
  checkpoint as a model named ``checkpoint-N``; the transformers flavor keeps a PEFT adapter under
  ``peft/``);
- the LoRA config from the adapter's ``adapter_config.json`` (the HF callback never logs it);
- a learning rate, schedule or warmup the run did not log as a param: fitted to the logged rates
  (``gradian.runs.fill_config_from_logs``) and listed in ``RunRecord.inferred``;
- the dataset from the run's dataset inputs: a source inside the run's own artifacts is always
  read; one outside them (a local path, another run's or a model's artifacts) only when the caller
  trusts it (``trust_run_dataset``, the CLI's ``--trust-run-dataset``), since a run can name any
  file on the reading machine and its rows end up in the report logged back to the server.
  Otherwise the run's ``data/`` artifact stands in, and a run with neither is refused unless the
  caller brings the dataset itself (``dataset_given``);
- the base model from ``adapter_config.json``, else the run's ``gradian.base_model`` tag.

Downloads land in a cache keyed by run and artifact path, written to a temporary folder and moved
into place only when complete; a ``.gradian-download.json`` records each file's sha256 and is
checked before the cache is reused.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from gradian.errors import RunRecordError
from gradian.runs import (
    DatasetRef,
    fill_config_from_logs,
    LoraSettings,
    RunRecord,
    TrainingLogs,
    normalize_trainer_config,
)
from gradian.runs.record import LogStep
from gradian.runs.ref import RunRef
from gradian_mlflow.client import call, get_client, parse_run_ref
from gradian_mlflow.lineage import DOWNLOAD_RECORD, source_model_ids

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import FileInfo, Run

__all__ = ["read_mlflow_run", "MlflowRunSource", "RUN_SOURCE", "AdapterLocation", "find_adapters", "default_cache_dir",
           "BASE_MODEL_TAG"]

#: the run tag naming the base model (set by ``train_and_log`` and ``GradianCallback``)
BASE_MODEL_TAG = "gradian.base_model"
#: params that name the base model in runs logged by the HF and TRL callbacks, most specific first
_BASE_MODEL_PARAMS = ("base_model_name_or_path", "model_name_or_path", "_name_or_path")

_LOG_METRICS = ("loss", "grad_norm", "learning_rate", "epoch", "eval_loss")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
#: files an adapter needs; optimizer state and pickles are never downloaded
_ADAPTER_NAMES = r"adapter_config\.json|adapter_model\.(safetensors|bin)|trainer_state\.json|README\.md"
_ADAPTER_FILES = re.compile(rf"^({_ADAPTER_NAMES})$")
#: a checkpoint's files when its optimizer state is wanted too (the replay engine starts from it)
_CHECKPOINT_FILES = re.compile(rf"^({_ADAPTER_NAMES}|optimizer\.pt)$")
_MARKER = DOWNLOAD_RECORD
_BARE_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass
class AdapterLocation:
    """Where an adapter lives: a run artifact path, or a logged model's artifact URI."""

    artifact_uri: str  # e.g. runs:/<id>/adapter or models:/<model_id>/peft
    label: str
    step: int | None = None


def default_cache_dir() -> Path:
    return Path(".gradian") / "mlflow"


def _walk(list_fn: Callable[[str], Sequence[FileInfo]], path: str, depth: int) -> list[str]:
    """Every file path under ``path``, ``depth`` folders deep at most."""
    out: list[str] = []
    for info in list_fn(path):
        # Only the last name is reliable: stores differ in what they prefix entries with
        # (a logged model's listing repeats the last folder of the URI).
        child = f"{path}/{Path(info.path).name}" if path else Path(info.path).name
        if info.is_dir:
            if depth > 0:
                out += _walk(list_fn, child, depth - 1)
        else:
            out.append(child)
    return out


def _adapter_dirs(files: list[str]) -> list[str]:
    return sorted({str(Path(f).parent) if "/" in f else "" for f in files if f.endswith("adapter_config.json")})


def _rank(folder: str) -> tuple[int, int]:
    """Final adapters before checkpoints; later checkpoints first."""
    match = _CHECKPOINT.search(folder)
    return (1, -int(match.group(1))) if match else (0, folder.count("/"))


def _run_files(client: MlflowClient, run_id: str) -> list[str]:
    """Every artifact file path of the run, four folders deep at most (listed once per read)."""
    return call(f"listing artifacts of run {run_id}",
                lambda: _walk(lambda p: client.list_artifacts(run_id, p or None), "", 4))


def find_adapters(client: MlflowClient, run: Run, files: list[str] | None = None,
                  ) -> tuple[AdapterLocation | None, list[AdapterLocation]]:
    """(the final adapter, checkpoints oldest first) from run artifacts, then logged models.

    ``files`` is the run's artifact listing when the caller has it already.
    """
    run_id = run.info.run_id
    files = files if files is not None else _run_files(client, run_id)
    locations = [AdapterLocation(f"runs:/{run_id}/{d}".rstrip("/"), d or "(run root)", _step(d))
                 for d in _adapter_dirs(files)]
    if not locations:
        locations = _from_logged_models(client, run)
    if not locations:
        return None, []
    final = sorted(locations, key=lambda loc: _rank(loc.label))[0]
    stepped = [(loc.step, loc) for loc in locations if loc.step is not None]
    checkpoints = [loc for _, loc in sorted(stepped, key=lambda pair: pair[0])]
    return final, checkpoints


def _step(folder: str) -> int | None:
    match = _CHECKPOINT.search(folder)
    return int(match.group(1)) if match else None


def _from_logged_models(client: MlflowClient, run: Run) -> list[AdapterLocation]:
    from mlflow.artifacts import list_artifacts

    locations = []
    for model_id in source_model_ids(client, run):
        model = call(f"reading logged model {model_id}", lambda: client.get_logged_model(model_id))
        base = model.artifact_location.rstrip("/")
        files = call(f"listing logged model {model.name}",
                     lambda: _walk(lambda p: list_artifacts(artifact_uri=f"{base}/{p}" if p else base), "", 4))
        for folder in _adapter_dirs(files):
            label = f"{model.name}/{folder}" if folder else model.name
            step = _step(folder) or _step(model.name)
            locations.append(AdapterLocation(f"{base}/{folder}".rstrip("/"), label, step))
    return locations


def _hash_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != _MARKER
    }


def _cache_damage(recorded: object, artifact_uri: str, found: dict[str, str]) -> str | None:
    """What is wrong with a cached download against its marker, in words; None when it is whole."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
        return "its record of the files is damaged"
    if recorded.get("uri") != artifact_uri:
        return f"it was downloaded from {recorded.get('uri')}"
    files = recorded["files"]
    for name in sorted(set(files) | set(found)):
        if name not in found:
            return f"{name} is missing"
        if name not in files:
            return f"{name} was added"
        if files[name] != found[name]:
            return f"{name} does not match the sha256 recorded when it was downloaded"
    return None


def _cached_download(artifact_uri: str, cache_dir: Path, only: re.Pattern | None = None,
                     notes: list[str] | None = None) -> Path:
    """Download a folder (adapter files only when ``only`` is given) into a verified cache.

    A cached copy whose files no longer match the sha256 recorded at download is downloaded
    again, and ``notes`` gets a line saying which file and what was wrong."""
    from mlflow.artifacts import download_artifacts, list_artifacts

    key = hashlib.sha256(artifact_uri.encode()).hexdigest()[:16]
    target = cache_dir / key
    marker = target / _MARKER
    if marker.is_file():
        try:
            recorded = json.loads(marker.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            recorded = None  # a damaged marker: the folder cannot be trusted
        damage = _cache_damage(recorded, artifact_uri, _hash_tree(target))
        if damage is None:
            return target
        if notes is not None:
            notes.append(f"repaired the cached download of {artifact_uri} in {target}: {damage}; downloaded it again")
        shutil.rmtree(target)  # damaged or stale: fetch again
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir))
    try:
        if only is None:
            call(f"downloading {artifact_uri}", lambda: download_artifacts(artifact_uri=artifact_uri, dst_path=str(tmp)))
            inner = tmp / Path(artifact_uri.rstrip("/")).name
            src = inner if inner.is_dir() else tmp
        else:
            entries = call(f"listing {artifact_uri}", lambda: list_artifacts(artifact_uri=artifact_uri))
            names = [Path(e.path).name for e in entries if not e.is_dir and only.match(Path(e.path).name)]
            for name in names:
                call(f"downloading {artifact_uri}/{name}",
                     lambda: download_artifacts(artifact_uri=f"{artifact_uri}/{name}", dst_path=str(tmp)))
            src = tmp
        (src / _MARKER).write_text(json.dumps({"uri": artifact_uri, "files": _hash_tree(src)}))
        if src != tmp:
            src.rename(cache_dir / f".{key}.done")
            shutil.rmtree(tmp)
            (cache_dir / f".{key}.done").rename(target)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _logs_from_history(client: MlflowClient, run_id: str) -> TrainingLogs:
    by_step: dict[int, LogStep] = {}
    for key in _LOG_METRICS:
        history = call(f"reading metric {key} of run {run_id}", lambda: client.get_metric_history(run_id, key))
        for metric in history:
            step = by_step.setdefault(int(metric.step), LogStep(step=int(metric.step)))
            setattr(step, key, float(metric.value))
    steps = [s for s in by_step.values() if any(
        getattr(s, k) is not None for k in ("loss", "grad_norm", "learning_rate", "eval_loss"))]
    return TrainingLogs(steps=sorted(steps, key=lambda s: s.step))


@dataclass
class _DatasetInputs:
    """What the run's training dataset inputs gave: a usable dataset, and a source left unread."""

    dataset: DatasetRef
    #: an outside source that could have been read but was not trusted
    refused: str | None = None


def _dataset_from_inputs(run: Run, cache_dir: Path, *, trust: bool) -> _DatasetInputs:
    refused = None
    inputs = getattr(run, "inputs", None)
    for dataset_input in getattr(inputs, "dataset_inputs", None) or []:
        tags = {t.key: t.value for t in (dataset_input.tags or [])}
        if tags.get("mlflow.data.context") not in (None, "train", "training"):
            continue
        dataset = dataset_input.dataset
        try:
            source = json.loads(dataset.source or "{}")
        except ValueError:
            source = {"uri": dataset.source}
        uri = source.get("uri") or source.get("url") or source.get("path")
        if not uri:
            continue
        uri = str(uri)
        if not _is_own_artifact(uri, run) and not trust:
            if _readable(uri):
                refused = refused or uri
            continue
        path = _resolve_data_uri(uri, cache_dir)
        if path is not None:
            return _DatasetInputs(DatasetRef(path=str(path), sha256=None))
    return _DatasetInputs(DatasetRef(), refused)


_ARTIFACT_SCHEMES = ("runs:/", "mlflow-artifacts:", "models:/")


def _local_path(uri: str) -> str | None:
    """The filesystem path ``uri`` names (``file://`` or no scheme), else None."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    return None if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri) else uri


def _readable(uri: str) -> bool:
    """Whether ``_resolve_data_uri`` would read something at ``uri``."""
    local = _local_path(uri)
    return Path(local).exists() if local is not None else uri.startswith(_ARTIFACT_SCHEMES)


def _is_own_artifact(uri: str, run: Run) -> bool:
    """Whether ``uri`` lies inside the run's own artifacts (``runs:/<this run>/...`` or under its
    artifact URI); ``..`` segments never count as inside."""
    if uri.startswith("runs:/"):
        parts = uri[len("runs:/"):].split("/")
        return parts[0] == run.info.run_id and ".." not in parts
    root = str(getattr(run.info, "artifact_uri", "") or "").rstrip("/")
    if not root:
        return False
    local, local_root = _local_path(uri), _local_path(root)
    if local is not None and local_root is not None:
        return Path(local).resolve().is_relative_to(Path(local_root).resolve())
    return uri.startswith(root + "/") and ".." not in uri[len(root):].split("/")


def _refused_dataset(run_id: str, uri: str) -> RunRecordError:
    return RunRecordError(
        f"run {run_id}: its training dataset input names {uri}, outside the run's own artifacts, and the "
        f"run logged no data/ artifact to use instead; pass --dataset {uri} to read it, or --trust-run-dataset "
        "to let the run name its data"
    )


_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _dataset_from_artifacts(run_id: str, files: list[str], cache_dir: Path) -> DatasetRef:
    """A single data file logged under the run's ``data/`` artifacts, when the inputs named none."""
    data = [f for f in files if f.startswith("data/") and f.count("/") == 1 and f.endswith(_DATA_SUFFIXES)]
    if len(data) != 1:
        return DatasetRef()
    path = _resolve_data_uri(f"runs:/{run_id}/{data[0]}", cache_dir)
    return DatasetRef(path=str(path)) if path is not None else DatasetRef()


def _resolve_data_uri(uri: str, cache_dir: Path) -> Path | None:
    local = _local_path(uri)
    if local is not None:
        return Path(local) if Path(local).exists() else None
    if uri.startswith(_ARTIFACT_SCHEMES):
        from mlflow.artifacts import download_artifacts

        folder = cache_dir / "datasets" / hashlib.sha256(uri.encode()).hexdigest()[:16]
        if not folder.exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=folder.parent))
            call(f"downloading dataset {uri}", lambda: download_artifacts(artifact_uri=uri, dst_path=str(tmp)))
            tmp.rename(folder)
        files = [p for p in folder.rglob("*") if p.is_file()]
        return files[0] if len(files) == 1 else folder
    return None


#: JSON files a run may carry beside its params: the trainer's arguments as JSON (settings such as
#: ``max_seq_length`` that are not TrainingArguments fields), and a RunRecord written by gradian
_JSON_ARGS = ("training_args.json", "gradian_run.json")


def _fill_from_json_artifacts(run_id: str, files: list[str], record: RunRecord, cache: Path) -> None:
    """Fill config fields the params left empty from JSON argument files among the artifacts."""
    from mlflow.artifacts import download_artifacts

    names = {f for f in files if "/" not in f}  # files at the artifact root
    for name in _JSON_ARGS:
        if name not in names:
            continue
        cache.mkdir(parents=True, exist_ok=True)
        local = call(f"downloading {name}", lambda: download_artifacts(run_id=run_id, artifact_path=name,
                                                                     dst_path=str(cache)))
        try:
            data = json.loads(Path(local).read_text())
        except ValueError:
            continue
        raw = data.get("config", data) if name == "gradian_run.json" else data
        parsed = normalize_trainer_config({k: v for k, v in raw.items() if k != "extra"})
        for field_name, value in vars(parsed).items():
            if field_name != "extra" and value is not None and getattr(record.config, field_name) is None:
                setattr(record.config, field_name, value)


def read_mlflow_run(ref: str, cache_dir: str | Path | None = None, client: MlflowClient | None = None, *,
                    trust_run_dataset: bool = False, dataset_given: bool = False,
                    optimizer_states: bool = False) -> RunRecord:
    """Build a RunRecord from a run id or ``runs:/<id>``; adapters are downloaded to the cache.

    ``optimizer_states``: each checkpoint is downloaded with its ``optimizer.pt`` where the run
    logged one (what the replay engine starts from; a LoRA run's is twice its adapter's size).
    ``trust_run_dataset`` lets a dataset input outside the run's artifacts be read;
    ``dataset_given`` says the caller has the training data already, so a run whose only dataset
    is such an input is read without one instead of refused.
    """
    run_id = parse_run_ref(ref)
    client = client or get_client(existing_store=True)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    run = call(f"reading run {run_id}", lambda: client.get_run(run_id))

    record = RunRecord(ref=RunRef("mlflow", run_id, f"mlflow:{run_id}"))
    record.config = normalize_trainer_config(run.data.params)
    run_cache = cache / run_id
    files = _run_files(client, run_id)
    _fill_from_json_artifacts(run_id, files, record, run_cache)
    record.logs = _logs_from_history(client, run_id)

    final, checkpoints = find_adapters(client, run, files)
    if final is not None:
        adapter_dir = _cached_download(final.artifact_uri, run_cache / "adapters", only=_ADAPTER_FILES,
                                       notes=record.notes)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise RunRecordError(f"run {run_id}: {final.artifact_uri} lost its adapter_config.json while downloading")
        record.adapter_dir = str(adapter_dir)
        record.lora = LoraSettings.from_adapter_config(json.loads((adapter_dir / "adapter_config.json").read_text()))
        # with their optimizer states (a cache of their own: the adapter-only one holds none)
        kept, files_of = ("checkpoints", _CHECKPOINT_FILES) if optimizer_states else ("adapters", _ADAPTER_FILES)
        record.checkpoints = [
            str(_cached_download(c.artifact_uri, run_cache / kept, only=files_of, notes=record.notes))
            for c in checkpoints
        ]
        if not record.logs.steps:
            state = adapter_dir / "trainer_state.json"
            if state.is_file():
                record.logs = TrainingLogs.from_log_history(json.loads(state.read_text()).get("log_history") or [])
    # a run logged without its arguments (or without these): the logged rates say what they were
    fill_config_from_logs(record)
    if not record.lora.base_model and run.data.tags.get(BASE_MODEL_TAG):
        record.lora.base_model = run.data.tags[BASE_MODEL_TAG]
    if not record.lora.base_model:  # a run logged with params only (the HF / TRL callback's defaults)
        for key in _BASE_MODEL_PARAMS:
            value = (run.data.params.get(key) or "").strip()
            if value and value.lower() not in ("none", "null"):
                record.lora.base_model = value
                record.inferred["base_model"] = f"the run's param {key}"
                break
    found = _dataset_from_inputs(run, run_cache, trust=trust_run_dataset)
    record.dataset = found.dataset
    if record.dataset.path is None:
        record.dataset = _dataset_from_artifacts(run_id, files, run_cache)
    # with a data/ artifact the refused source is not needed: the run's own copy of its rows is
    # the better witness anyway (MLflow cannot name a proxied artifact as a dataset source, so
    # train_and_log and GradianCallback runs name the local file they were trained from)
    if found.refused is not None and record.dataset.path is None and not dataset_given:
        raise _refused_dataset(run_id, found.refused)
    return record


class MlflowRunSource:
    """The ``gradian.run_sources`` entry point for the ``mlflow:`` and ``runs:`` schemes.

    ``mlflow:<id>``, ``runs:/<id>`` and a bare 32-hex run id (one that is not a local folder) all
    name the same run; downloads are cached under ``<cache_dir>/mlflow`` whichever spelling is used.
    """

    name = "mlflow"

    @staticmethod
    def matches(text: str) -> bool:
        """A bare run id, written without a scheme."""
        return bool(_BARE_RUN_ID.match(text.strip()))

    @staticmethod
    def read(ref: RunRef, cache_dir: str | Path | None = None, **options: bool) -> RunRecord:
        # runs:/<id>/<artifact path> names a run by its first segment
        return read_mlflow_run(ref.id.split("/", 1)[0], cache_dir=cache_dir, **options)


#: what ``pyproject.toml`` registers under ``gradian.run_sources``
RUN_SOURCE = MlflowRunSource()
