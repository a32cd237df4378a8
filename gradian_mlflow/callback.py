"""``GradianCallback``: a ``transformers.TrainerCallback`` that leaves an MLflow run Gradian can debug.

It works beside the stock ``MLflowCallback`` (``report_to=["mlflow"]``) or instead of it, and
writes the run in the layout ``gradian_mlflow.source.read_mlflow_run`` reads back, with the same
names ``gradian_mlflow.training.train_and_log`` uses, so ``gradian attribute --mlflow-run <id>
--eval-dataset items.jsonl`` needs nothing else.

On train begin (into the active run, or one it starts as ``MLflowCallback`` would):

- tags ``gradian.kind`` (``finetune``), ``gradian.base_model``, ``gradian.tokenizer``,
  ``gradian.tokenizer_fingerprint`` (vocabulary, special tokens and chat template, the fingerprint
  the gradient index records) and ``gradian.chat_template_sha256``;
- the trainer arguments as params and metrics on each log, unless ``MLflowCallback`` logs them
  already; a key the run holds already is never logged again (MLflow refuses a changed value);
  ``training_args.json`` always, and the LoRA settings as ``lora.*`` params;
- the training rows under ``data/`` (up to ``max_dataset_artifact_mb``) and a dataset input
  (context ``training``; MLflow computes its digest) sourced at that artifact where MLflow can
  name it as a source (a local artifact store), else at the file; a reader uses the ``data/``
  copy either way. Past the limit only the input is logged, pointing at the original file, and
  ``gradian.dataset_logged`` is ``false``: a later reader then needs ``--dataset`` or
  ``--trust-run-dataset``;
- the eval items, when given, under ``eval/``.

On train end (by run id: ``MLflowCallback`` may have ended the run already):

- the final adapter (``save_pretrained``) with ``trainer_state.json`` under ``adapter/``, and
  ``trainer_state.json`` at the root;
- with ``diagnose_on_end``, a ``gradian diagnose`` child run (``gradian_mlflow.sink``);
- the run is ended if this callback started it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from transformers import TrainerCallback

from gradian.errors import ConfigError, DatasetError
from gradian_mlflow.client import call, get_client
from gradian_mlflow.experiment import use_training_experiment
from gradian_mlflow.source import BASE_MODEL_TAG
from gradian_mlflow.training import TRAIN_DATA_ARTIFACT

if TYPE_CHECKING:
    import datasets
    import pandas as pd
    import torch
    from mlflow import MlflowClient
    from peft import PeftConfig
    from transformers import PreTrainedTokenizerBase, TrainerControl, TrainerState, TrainingArguments

__all__ = ["GradianCallback", "EVAL_DATA_ARTIFACT"]

#: artifact folder of the eval items
EVAL_DATA_ARTIFACT = "eval"

_LOG = logging.getLogger(__name__)
#: ``report_to`` entries whose callback is (or extends) ``MLflowCallback``
_MLFLOW_INTEGRATIONS = ("mlflow", "dagshub")
#: columns a tokenized dataset adds; the rows Gradian reads are the text before them
_TOKEN_COLUMNS = ("input_ids", "attention_mask", "labels", "token_type_ids", "position_ids")
_DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")

Rows = Sequence[Mapping[str, object]]


class GradianCallback(TrainerCallback):
    """Log what a later Gradian diagnosis needs into the training run's MLflow run.

    ``train_dataset``: the training rows as the user wrote them: a ``.jsonl``/``.json``/
    ``.parquet`` file, a list of dicts, a pandas DataFrame or a ``datasets.Dataset``; by default
    the trainer's own dataset, when it still holds text columns. ``eval_items``: a file or a list
    of dicts describing the capability to watch. ``max_dataset_artifact_mb``: training data larger
    than this is not copied into the run; only its dataset input (a pointer) is logged.
    ``log_params_and_metrics``: log the trainer arguments and per-step metrics (default: only when
    ``report_to`` has no MLflow integration). ``diagnose_on_end``: log a ``gradian diagnose`` child
    run once training ends. ``tokenizer`` and ``base_model`` override what the trainer passes.
    """

    def __init__(
        self,
        train_dataset: str | Path | Rows | pd.DataFrame | datasets.Dataset | None = None,
        *,
        eval_items: str | Path | Rows | None = None,
        max_dataset_artifact_mb: float = 100.0,
        log_params_and_metrics: bool | None = None,
        diagnose_on_end: bool = False,
        tokenizer: PreTrainedTokenizerBase | None = None,
        base_model: str | None = None,
    ) -> None:
        if not max_dataset_artifact_mb >= 0:
            raise ConfigError(
                f"GradianCallback(max_dataset_artifact_mb={max_dataset_artifact_mb!r}): give a size in MiB, "
                "0 or more (0 logs the dataset input alone, never the rows)"
            )
        # a wrong path fails here, before training, not after the run is opened
        for argument, value in (("train_dataset", train_dataset), ("eval_items", eval_items)):
            if isinstance(value, (str, Path)):
                _check_data_file(Path(value), argument)
        self.train_dataset = train_dataset
        self.eval_items = eval_items
        self.max_dataset_artifact_mb = float(max_dataset_artifact_mb)
        self.log_params_and_metrics = log_params_and_metrics
        self.diagnose_on_end = diagnose_on_end
        self.tokenizer = tokenizer
        self.base_model = base_model
        #: the MLflow run written to (set on train begin)
        self.run_id: str | None = None
        #: the ``gradian diagnose`` child run (set on train end with ``diagnose_on_end``)
        self.diagnosis_run_id: str | None = None
        self._started_run = False
        self._logs_trainer = False
        self._eval_path: Path | None = None
        self._data_file: Path | None = None
        self._dataset_logged = False
        self._scratch: tempfile.TemporaryDirectory | None = None

    # -- trainer events ----------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        from gradian.train import TRAINING_ARGS_FILE

        self.run_id = self._open_run(args)
        client = get_client()
        present = any(name in (args.report_to or []) for name in _MLFLOW_INTEGRATIONS)
        self._logs_trainer = not present if self.log_params_and_metrics is None else self.log_params_and_metrics
        self._scratch = tempfile.TemporaryDirectory(prefix="gradian-callback-")
        scratch = Path(self._scratch.name)

        model = kwargs.get("model")
        tokenizer = self.tokenizer if self.tokenizer is not None else kwargs.get("processing_class")
        tags = {"gradian.kind": "finetune", **_tokenizer_tags(tokenizer)}
        base = self.base_model or _base_model_name(model)
        if base:
            tags[BASE_MODEL_TAG] = str(base)
        params = _lora_params(model)
        if self._logs_trainer:
            params.update(_trainer_params(args))
        _log_batch(client, self.run_id, params=params, tags=tags)
        args_file = scratch / TRAINING_ARGS_FILE
        args_file.write_text(json.dumps(json.loads(args.to_json_string()), indent=2))
        call(f"logging {args_file.name}", lambda: client.log_artifact(self.run_id, str(args_file)))

        rows_source = self.train_dataset
        if rows_source is None:
            loader = kwargs.get("train_dataloader")
            rows_source = _text_rows(getattr(loader, "dataset", None))
        if rows_source is None:
            _LOG.warning("GradianCallback: the trainer's dataset holds no text rows and no train_dataset was "
                         "given; the run names no training data (pass GradianCallback(train_dataset=...))")
        else:
            self._data_file = _as_data_file(rows_source, scratch / "train", "train.jsonl")
            self._log_training_data(client, self.run_id, self._data_file,
                                    user_file=isinstance(rows_source, (str, Path)))
        if self.eval_items is not None:
            self._eval_path = _as_data_file(self.eval_items, scratch / "eval", "eval.jsonl")
            call("logging the eval items", lambda: client.log_artifact(
                self.run_id, str(self._eval_path), artifact_path=EVAL_DATA_ARTIFACT))

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Mapping[str, object] | None = None, **kwargs: object) -> None:
        if not (state.is_world_process_zero and self._logs_trainer and self.run_id and logs):
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(re.sub(r"[^0-9A-Za-z_\-. :/]", "_", key), float(value), now, state.global_step)
                   for key, value in logs.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)]
        if metrics:
            client = get_client()
            call("logging metrics", lambda: client.log_batch(self.run_id, metrics=metrics))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        # both are set by on_train_begin
        run_id, scratch_dir = self.run_id, self._scratch
        if not (state.is_world_process_zero and run_id and scratch_dir is not None):
            return
        from gradian.train import ADAPTER_SUBDIR

        client = get_client()
        model = kwargs.get("model")
        try:
            scratch = Path(scratch_dir.name)
            state_file = scratch / "trainer_state.json"
            state.save_to_json(str(state_file))
            call("logging trainer_state.json", lambda: client.log_artifact(run_id, str(state_file)))
            if model is not None and getattr(model, "peft_config", None):
                adapter = scratch / ADAPTER_SUBDIR
                model.save_pretrained(str(adapter))
                state.save_to_json(str(adapter / "trainer_state.json"))
                call("logging the adapter", lambda: client.log_artifacts(run_id, str(adapter), ADAPTER_SUBDIR))
            else:
                _LOG.warning("GradianCallback: the model is not a PEFT model; no adapter was logged, and "
                             "attribution will need --adapter")
            if self.diagnose_on_end:
                self.diagnosis_run_id = self._diagnose(run_id)
        finally:
            if self._started_run:
                self._close_run()
            if self._scratch is not None:
                self._scratch.cleanup()
                self._scratch = None

    # -- pieces ------------------------------------------------------------------------------

    def _open_run(self, args: TrainingArguments) -> str:
        """The active run's id, or a new run's (as ``MLflowCallback`` starts one)."""
        import mlflow

        active = mlflow.active_run()
        if active is not None:
            return active.info.run_id
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if experiment and not os.environ.get("MLFLOW_RUN_ID"):
            use_training_experiment(experiment)  # created, it is tagged as model training
        self._started_run = True
        return mlflow.start_run(run_name=args.run_name).info.run_id

    def _close_run(self) -> None:
        import mlflow

        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run()
        else:
            client = get_client()
            call("ending the training run", lambda: client.set_terminated(self.run_id, "FINISHED"))

    def _log_training_data(self, client: MlflowClient, run_id: str, data_file: Path, *, user_file: bool) -> None:
        """Rows as the ``data/`` artifact up to the size limit, and the dataset input either way.

        Past the limit the input points at the user's file (``user_file``); rows held only in
        memory have nothing to point at, so their input records the digest and schema alone.
        """
        import mlflow
        from mlflow.exceptions import MlflowException

        size_mb = data_file.stat().st_size / (1 << 20)
        self._dataset_logged = size_mb <= self.max_dataset_artifact_mb
        tags = {"gradian.dataset_logged": str(self._dataset_logged).lower(),
                "gradian.dataset_sha256": hashlib.sha256(data_file.read_bytes()).hexdigest()}
        run = call(f"reading run {run_id}", lambda: client.get_run(run_id))
        source: str | None = None
        if self._dataset_logged:
            call(f"logging {data_file.name}", lambda: client.log_artifact(
                run_id, str(data_file), artifact_path=TRAIN_DATA_ARTIFACT))
            source = f"{run.info.artifact_uri.rstrip('/')}/{TRAIN_DATA_ARTIFACT}/{data_file.name}"
        else:
            _LOG.warning(f"GradianCallback: the training data is {size_mb:.1f} MiB, over max_dataset_artifact_mb="
                         f"{self.max_dataset_artifact_mb:g}; the run records its dataset input but not its rows")
            if user_file:
                source = tags["gradian.dataset_pointer"] = str(data_file.resolve())
        _log_batch(client, run_id, tags=tags)

        frame = _frame(data_file).astype(str)  # nested chat turns: the input records the text only
        try:
            dataset = mlflow.data.from_pandas(frame, source=source, name=data_file.name)
        except MlflowException:  # a store whose URIs have no dataset-source resolver
            dataset = mlflow.data.from_pandas(frame, source=str(data_file.resolve()), name=data_file.name)
        # _open_run made our run the active one
        call("logging the dataset input", lambda: mlflow.log_input(dataset, context="training"))

    def _diagnose(self, run_id: str) -> str | None:
        """Log a ``gradian diagnose`` child run; a failure is a warning, the training run is kept."""
        from gradian.audit import write_diagnosis
        from gradian.audit.session import diagnose
        from gradian.config import load_config
        from gradian.errors import GradianError
        from gradian_mlflow.sink import log_diagnosis
        from gradian_mlflow.source import read_mlflow_run

        with tempfile.TemporaryDirectory(prefix="gradian-diagnose-") as tmp:
            # training data the run points at but does not hold is this process's own file
            local_data = str(self._data_file) if self._data_file and not self._dataset_logged else None
            try:
                record = read_mlflow_run(run_id, cache_dir=Path(tmp) / "mlflow",
                                         dataset_given=local_data is not None)
                cfg = load_config(None, overrides={
                    "run": f"runs:/{run_id}", "cache_dir": tmp, "dataset": local_data,
                    "eval_dataset": str(self._eval_path) if self._eval_path else None})
                diagnosis = diagnose(cfg, run=record)
                files = write_diagnosis(diagnosis.report, Path(tmp) / "report")
                return log_diagnosis(diagnosis.report, run_id, kind="diagnose", files=list(files))
            except GradianError as err:
                _LOG.warning(f"GradianCallback: the end-of-training diagnosis failed ({err}); rerun it with "
                             f"`gradian diagnose --mlflow-run {run_id}`")
                return None


# -- helpers without state -------------------------------------------------------------------


def _log_batch(client: MlflowClient, run_id: str, *, params: Mapping[str, str] | None = None,
               tags: Mapping[str, str] | None = None) -> None:
    """Log params the run does not hold yet (a held key keeps its value) and tags, 100 at a time."""
    from mlflow.entities import Param, RunTag

    held = call(f"reading run {run_id}", lambda: client.get_run(run_id)).data.params
    entries: list[Param | RunTag] = [Param(k, v) for k, v in (params or {}).items() if k not in held]
    entries += [RunTag(k, v) for k, v in (tags or {}).items()]
    for start in range(0, len(entries), 100):
        chunk = entries[start:start + 100]
        call("logging params and tags", lambda: client.log_batch(
            run_id, params=[e for e in chunk if isinstance(e, Param)],
            tags=[e for e in chunk if isinstance(e, RunTag)]))


def _trainer_params(args: TrainingArguments) -> dict[str, str]:
    """The trainer arguments as ``MLflowCallback`` logs them: every value a string, over-long ones dropped."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    return {k: str(v) for k, v in args.to_dict().items() if len(str(v)) <= MAX_PARAM_VAL_LENGTH}


def _lora_params(model: torch.nn.Module | None) -> dict[str, str]:
    """``lora.*`` params from the model's active LoRA config (nothing for a model without one)."""
    config = _peft_config(model)
    if config is None:
        return {}
    targets = getattr(config, "target_modules", None)
    values = {
        "lora.r": getattr(config, "r", None),
        "lora.alpha": getattr(config, "lora_alpha", None),
        "lora.dropout": getattr(config, "lora_dropout", None),
        "lora.target_modules": ",".join(sorted(targets)) if isinstance(targets, (set, list, tuple)) else targets,
        "lora.use_rslora": getattr(config, "use_rslora", None),
    }
    return {k: str(v) for k, v in values.items() if v is not None}


def _peft_config(model: torch.nn.Module | None) -> PeftConfig | None:
    configs = getattr(model, "peft_config", None) or {}
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    return configs.get(active) if isinstance(active, str) and active in configs else next(iter(configs.values()))


def _base_model_name(model: torch.nn.Module | None) -> str | None:
    """The base model id or path: the LoRA config's, else the model config's ``_name_or_path``."""
    config = _peft_config(model)
    name = getattr(config, "base_model_name_or_path", None) if config is not None else None
    return name or getattr(getattr(model, "config", None), "_name_or_path", None) or None


def _tokenizer_tags(tokenizer: PreTrainedTokenizerBase | None) -> dict[str, str]:
    if tokenizer is None:
        return {}
    from gradian.index import tokenizer_fingerprint

    template = getattr(tokenizer, "chat_template", None)
    tags = {"gradian.tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "gradian.chat_template_sha256": (hashlib.sha256(str(template).encode("utf-8")).hexdigest()
                                             if template else "none")}
    if getattr(tokenizer, "name_or_path", None):
        tags["gradian.tokenizer"] = str(tokenizer.name_or_path)
    return tags


def _text_rows(dataset: torch.utils.data.Dataset | datasets.Dataset | Rows | None) -> list[dict[str, object]] | None:
    """The trainer's dataset as text rows (token columns dropped), or None when none are left."""
    if dataset is None:
        return None
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, Sequence) or hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        rows = [dataset[i] for i in range(len(dataset))]
    else:
        return None
    if not rows or not all(isinstance(r, Mapping) for r in rows):
        return None
    rows = [{k: v for k, v in r.items() if k not in _TOKEN_COLUMNS} for r in rows]
    return rows if all(rows) else None


def _as_data_file(source: str | Path | Rows | pd.DataFrame | datasets.Dataset, folder: Path,
                  default_name: str) -> Path:
    """A data file for ``source``: the file itself, or in-memory rows written as JSONL."""
    if isinstance(source, (str, Path)):
        return Path(source)
    if hasattr(source, "to_dict") and hasattr(source, "columns"):  # pandas DataFrame
        rows: Iterable[Mapping[str, object]] = source.to_dict("records")
    elif hasattr(source, "to_list"):  # datasets.Dataset
        rows = source.to_list()
    else:
        rows = list(source)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / default_name
    path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows), encoding="utf-8")
    return path


def _check_data_file(path: Path, argument: str) -> None:
    if not path.is_file() or path.suffix.lower() not in _DATA_FILE_SUFFIXES:
        raise DatasetError(
            f"GradianCallback({argument}={str(path)!r}): not a .jsonl, .json or .parquet file; pass one, or the "
            "rows themselves (a list of dicts, a DataFrame or a datasets.Dataset)"
        )


def _frame(path: Path) -> pd.DataFrame:
    import pandas as pd

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pd.read_parquet(path)
    return pd.read_json(path, lines=suffix == ".jsonl")
