"""``RunRecord``: what any trainer leaves behind, normalized.

The audit and the report only ever see a RunRecord. Readers (a local run directory here, an MLflow
run in ``gradian_mlflow``) build one; ``normalize_trainer_config`` is the single place where
trainer argument names (HF ``TrainingArguments``, TRL ``SFTConfig``) and the string values an
MLflow param store holds are turned into typed fields.

Derived figures are computed here and nowhere else: effective batch size, effective LoRA learning
rate and total optimizer steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping, SupportsFloat, SupportsIndex, TypeVar, cast

from gradian.errors import RunRecordError
from gradian.runs.ref import RunRef

__all__ = [
    "TrainerConfig",
    "LoraSettings",
    "LogStep",
    "TrainingLogs",
    "DatasetRef",
    "RunRecord",
    "normalize_trainer_config",
    "parse_param_value",
]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: the builtin a reader helper checks a value against, and the dataclass it builds
_T = TypeVar("_T")
_D = TypeVar("_D", bound="DataclassInstance")


@dataclass
class TrainerConfig:
    """Trainer settings that matter to the audit. ``None`` means the run did not record it."""

    learning_rate: float | None = None
    num_train_epochs: float | None = None
    max_steps: int | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    world_size: int | None = None
    #: warmup as a fraction of total steps, whichever way the trainer wrote it
    warmup_ratio: float | None = None
    #: warmup as an absolute number of optimizer steps
    warmup_steps: int | None = None
    lr_scheduler_type: str | None = None
    max_grad_norm: float | None = None
    weight_decay: float | None = None
    seed: int | None = None
    max_seq_length: int | None = None
    packing: bool | None = None
    completion_only_loss: bool | None = None
    fp16: bool | None = None
    bf16: bool | None = None
    eval_strategy: str | None = None
    #: the keys the trainer recorded that were not mapped to a field, verbatim
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class LoraSettings:
    """The adapter's LoRA settings, as written to ``adapter_config.json``."""

    r: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    target_modules: list[str] | None = None
    use_rslora: bool = False
    base_model: str | None = None

    @classmethod
    def from_adapter_config(cls, data: Mapping[str, object]) -> "LoraSettings":
        targets = data.get("target_modules")
        if isinstance(targets, str):  # peft allows a regex string here
            targets = [targets]
        return cls(
            r=_as_int(data.get("r")),
            alpha=_as_float(data.get("lora_alpha")),
            dropout=_as_float(data.get("lora_dropout")),
            target_modules=[str(t) for t in targets] if isinstance(targets, (list, tuple)) else None,
            use_rslora=bool(data.get("use_rslora") or False),
            base_model=_text(data.get("base_model_name_or_path")),
        )

    @property
    def scaling(self) -> float | None:
        """LoRA's output scale: alpha / r, or alpha / sqrt(r) under rsLoRA."""
        if not self.r or self.alpha is None:
            return None
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


@dataclass
class LogStep:
    """One logged optimizer step; any value may be missing from a given log line."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    epoch: float | None = None
    eval_loss: float | None = None


@dataclass
class TrainingLogs:
    steps: list[LogStep] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def series(self, name: str) -> list[tuple[int, float]]:
        """(step, value) pairs for one metric, in step order, skipping steps that lack it."""
        out = [(s.step, getattr(s, name)) for s in self.steps if getattr(s, name) is not None]
        return sorted(out, key=lambda item: item[0])

    @classmethod
    def from_log_history(cls, history: Iterable[Mapping[str, object]]) -> "TrainingLogs":
        """Build from HF ``trainer_state.json`` ``log_history`` (one dict per log call).

        Entries for the same step (a train log and an eval log) are merged; the final summary
        entry (``train_loss``, ``train_runtime``) carries no per-step metric and is dropped.
        """
        by_step: dict[int, LogStep] = {}
        for entry in history:
            step = _as_int(entry.get("step"))
            if step is None:
                continue
            record = by_step.setdefault(step, LogStep(step=step))
            for name in ("loss", "grad_norm", "learning_rate", "epoch", "eval_loss"):
                value = _as_float(entry.get(name))
                if value is not None:
                    setattr(record, name, value)
        steps = [s for s in by_step.values() if _has_metric(s)]
        return cls(steps=sorted(steps, key=lambda s: s.step))


def _has_metric(step: LogStep) -> bool:
    return any(
        v is not None
        for v in (step.loss, step.grad_norm, step.learning_rate, step.eval_loss)
    )


@dataclass
class DatasetRef:
    path: str | None = None
    sha256: str | None = None
    n_examples: int | None = None


@dataclass
class RunRecord:
    """A training run as the audit and the report see it."""

    config: TrainerConfig = field(default_factory=TrainerConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    logs: TrainingLogs = field(default_factory=TrainingLogs)
    adapter_dir: str | None = None
    dataset: DatasetRef = field(default_factory=DatasetRef)
    #: where the run was read from: a local directory, or ``mlflow:<run id>`` (its spelling is ``source``)
    ref: RunRef | None = None
    #: checkpoint directories found beside the adapter, oldest first (for TracIn)
    checkpoints: list[str] = field(default_factory=list)
    #: optimizer steps the trainer planned (``max_steps`` in trainer_state.json), whether the
    #: user set max_steps or the trainer derived it from epochs
    planned_steps: int | None = None
    #: config fields the run did not record and the reader inferred: field name -> how
    inferred: dict[str, str] = field(default_factory=dict)
    #: what the reader had to say about the run's files (a refused training_args.bin, ...)
    notes: list[str] = field(default_factory=list)

    @property
    def source(self) -> str | None:
        """The run's reference as reports spell it: the path of a local directory, ``<scheme>:<id>``
        otherwise; None for a record read from nowhere."""
        return str(self.ref) if self.ref is not None else None

    @source.setter
    def source(self, value: "str | RunRef | None") -> None:
        self.ref = RunRef.parse(value) if value else None

    # -- derived figures, computed here once -------------------------------------------------

    @property
    def effective_batch_size(self) -> int | None:
        """per-device batch x gradient accumulation x world size (world size 1 when unknown)."""
        c = self.config
        if c.per_device_train_batch_size is None:
            return None
        return (
            c.per_device_train_batch_size
            * (c.gradient_accumulation_steps or 1)
            * (c.world_size or 1)
        )

    @property
    def effective_lora_lr(self) -> float | None:
        """learning_rate x alpha / r (alpha / sqrt(r) under rsLoRA): the step LoRA really takes."""
        scale = self.lora.scaling
        if self.config.learning_rate is None or scale is None:
            return None
        return self.config.learning_rate * scale

    def total_optimizer_steps(self, n_examples: int | None = None) -> int | None:
        """Optimizer steps the run was set up to take.

        ``max_steps`` wins when positive, then the trainer's own plan (``planned_steps``).
        Otherwise ceil(n / (batch x world)) batches per epoch, grouped by gradient accumulation
        (rounded up, as the HF Trainer does), times epochs. Falls back to the last logged step
        when the dataset size is unknown.
        """
        c = self.config
        if c.max_steps is not None and c.max_steps > 0:
            return c.max_steps
        if self.planned_steps:
            return self.planned_steps
        n = n_examples if n_examples is not None else self.dataset.n_examples
        if n and c.per_device_train_batch_size and c.num_train_epochs:
            per_step = c.per_device_train_batch_size * (c.world_size or 1)
            batches = math.ceil(n / per_step)
            updates_per_epoch = max(math.ceil(batches / (c.gradient_accumulation_steps or 1)), 1)
            return math.ceil(updates_per_epoch * c.num_train_epochs)
        if self.logs.steps:
            return max(s.step for s in self.logs.steps)
        return None

    def inferred_gradient_accumulation(self, n_examples: int | None = None) -> int | None:
        """Gradient accumulation implied by the logs, for a run that did not record it.

        The logged ``epoch`` grows by 1 / U per optimizer step, U the updates per epoch; the
        trainer makes U = ceil(B / g) updates from B = ceil(n / (batch x world)) batches, so g is
        the accumulation for which ceil(B / g) = U. None without the dataset size, the
        per-device batch or two logged epochs.
        """
        c = self.config
        n = n_examples if n_examples is not None else self.dataset.n_examples
        points = [(s.step, s.epoch) for s in self.logs.steps if s.epoch is not None and s.epoch > 0]
        if not n or not c.per_device_train_batch_size or len(points) < 2:
            return None
        (s0, e0), (s1, e1) = points[0], points[-1]
        if e1 <= e0 or s1 <= s0:
            return None
        updates = round((s1 - s0) / (e1 - e0))
        if updates < 1:
            return None
        batches = math.ceil(n / (c.per_device_train_batch_size * (c.world_size or 1)))
        guess = max(1, round(batches / updates))
        for g in sorted(range(max(1, guess - 2), guess + 3), key=lambda g: abs(g - guess)):
            if math.ceil(batches / g) == updates:
                return g
        return None

    @property
    def warmup_fraction(self) -> float | None:
        """Warmup as a fraction of the run, from a ratio or from steps over the planned total."""
        c = self.config
        if c.warmup_ratio is not None:
            return c.warmup_ratio
        if c.warmup_steps is not None:
            total = self.total_optimizer_steps()
            if total:
                return c.warmup_steps / total
            return 0.0 if c.warmup_steps == 0 else None
        return None

    def label_inferred(self, evidence: Mapping[str, object], *names: str) -> dict[str, object]:
        """``evidence`` plus ``inferred`` {field: how} for those of ``names`` the reader inferred."""
        used = {name: self.inferred[name] for name in names if name in self.inferred}
        return {**evidence, "inferred": used} if used else dict(evidence)

    # -- serialization: the ``gradian_run.json`` artifact ------------------------------------

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        del data["ref"]
        data["source"] = self.source  # the file keeps the reference as one string
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object], where: str = "run record") -> "RunRecord":
        """The record ``to_dict`` wrote. Every section and field is type-checked: a wrong type
        is a ``RunRecordError`` naming ``where`` (the file) and the key."""
        data = _section(data, where, "")
        logs = _section(data.get("logs") or {}, where, "logs")
        steps = _list(logs.get("steps") or [], where, "logs.steps")
        return cls(
            config=_dataclass_from(TrainerConfig, data.get("config") or {}, where, "config"),
            lora=_dataclass_from(LoraSettings, data.get("lora") or {}, where, "lora"),
            logs=TrainingLogs(steps=[_dataclass_from(LogStep, s, where, f"logs.steps[{k}]") for k, s in enumerate(steps)]),
            adapter_dir=_typed(data.get("adapter_dir"), str, where, "adapter_dir"),
            dataset=_dataclass_from(DatasetRef, data.get("dataset") or {}, where, "dataset"),
            ref=_run_ref(_typed(data.get("source"), str, where, "source")),
            checkpoints=[path for k, c in enumerate(_list(data.get("checkpoints") or [], where, "checkpoints"))
                         if (path := _typed(c, str, where, f"checkpoints[{k}]")) is not None],
            planned_steps=_as_int(_typed(data.get("planned_steps"), int, where, "planned_steps")),
            inferred={str(k): str(v) for k, v in _section(data.get("inferred") or {}, where, "inferred").items()},
            notes=[str(n) for n in _list(data.get("notes") or [], where, "notes")],
        )

    def write_json(self, path: str | Path) -> None:
        from gradian.atomic import write_text_atomic

        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2, sort_keys=True))


def _kind(value: object) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _bad(where: str, key: str, value: object, wanted: str) -> RunRecordError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    name = f"'{key}'" if key else "the file"
    return RunRecordError(
        f"{where}: {name} is {_kind(value)} ({shown}); it must be {wanted}. The file is damaged or was "
        "not written by Gradian: delete it (the trainer's own files are read instead) or write it again "
        "with `gradian train`"
    )


def _section(data: object, where: str, key: str) -> Mapping[str, object]:
    if not isinstance(data, Mapping):
        raise _bad(where, key, data, "an object")
    return data


def _list(data: object, where: str, key: str) -> list[object]:
    if not isinstance(data, list):
        raise _bad(where, key, data, "a list")
    return data


def _typed(value: object, kind: type[_T], where: str, key: str) -> _T | None:
    """``value`` if it is ``None`` or of ``kind`` (an int where a float is wanted too); else an error."""
    if value is None:
        return None
    ok = (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))) or (
        kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise _bad(where, key, value, {bool: "true or false", int: "an integer", float: "a number",
                                       str: "a string", list: "a list", dict: "an object"}[kind])
    return cast(_T, value)  # of ``kind``, or an int where a float is wanted: a float by the numeric tower


def _field_kind(annotation: object) -> type | None:
    """The one builtin a dataclass field holds (``int | None`` -> int); ``None`` for any other type."""
    text = str(annotation).replace(" ", "")
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text in (name, f"{name}|None"):
            return kind
    if text.startswith("list[") or text.startswith("list|") or text == "list":
        return list
    if text.startswith("dict["):
        return dict
    return None


def _dataclass_from(cls: type[_D], data: object, where: str = "run record", key: str = "") -> _D:
    data = _section(data, where, key)
    values = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        kind = _field_kind(f.type)
        value = data[f.name]
        if kind is not None:
            _typed(value, kind, where, f"{key}.{f.name}" if key else f.name)
        if kind is list and isinstance(value, list):  # a list by the check above
            for k, item in enumerate(value):
                _typed(item, str, where, f"{key}.{f.name}[{k}]")
        values[f.name] = value
    missing = [f.name for f in fields(cls) if f.name not in values
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise RunRecordError(f"{where}: '{key}' has no '{missing[0]}'; the file is damaged: delete it (the "
                             "trainer's own files are read instead) or write it again with `gradian train`")
    return cls(**values)


# -- trainer argument normalization -----------------------------------------------------------

#: trainer argument name -> TrainerConfig field. HF TrainingArguments and TRL SFTConfig names.
_ALIASES: dict[str, str] = {
    "learning_rate": "learning_rate",
    "lr": "learning_rate",
    "num_train_epochs": "num_train_epochs",
    "epochs": "num_train_epochs",
    "max_steps": "max_steps",
    "per_device_train_batch_size": "per_device_train_batch_size",
    "train_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "world_size": "world_size",
    "warmup_ratio": "warmup_ratio",
    "warmup_steps": "warmup_steps",
    "lr_scheduler_type": "lr_scheduler_type",
    "max_grad_norm": "max_grad_norm",
    "weight_decay": "weight_decay",
    "seed": "seed",
    "max_seq_length": "max_seq_length",
    "max_length": "max_seq_length",  # TRL >= 0.20 SFTConfig
    "packing": "packing",
    "completion_only_loss": "completion_only_loss",
    "assistant_only_loss": "completion_only_loss",
    "fp16": "fp16",
    "bf16": "bf16",
    "eval_strategy": "eval_strategy",
    "evaluation_strategy": "eval_strategy",
}

_INT_FIELDS = {
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "seed",
    "max_seq_length",
}
_FLOAT_FIELDS = {"learning_rate", "num_train_epochs", "max_grad_norm", "weight_decay", "warmup_ratio"}
_BOOL_FIELDS = {"packing", "completion_only_loss", "fp16", "bf16"}


def parse_param_value(value: object) -> object:
    """Turn a logged string ("2e-4", "True", "None", "[1, 2]") back into a Python value.

    The HF MLflow callback logs every argument as a string; JSON dumps keep types. Values that
    are not recognizably numbers, booleans, null or JSON stay strings.
    """
    if not isinstance(value, str):
        return value
    text = value.strip()
    lowered = text.lower()
    if lowered in ("none", "null", ""):
        return None
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            try:  # python repr of a list, as str(list) logs it
                return json.loads(text.replace("'", '"'))
            except ValueError:
                return text
    if "." in text:  # enum reprs such as "IntervalStrategy.STEPS"
        head, _, tail = text.rpartition(".")
        if head and tail.isupper():
            return tail.lower()
    return text


def normalize_trainer_config(raw: Mapping[str, object]) -> TrainerConfig:
    """Map trainer arguments (typed, or strings as an MLflow param store holds them) to fields.

    Today's trainers need care: transformers 5 dropped ``warmup_ratio`` and reads a float
    ``warmup_steps`` below 1 as a ratio; TRL calls the sequence length ``max_length``.
    """
    config = TrainerConfig()
    for key, raw_value in raw.items():
        name = _ALIASES.get(key)
        value = parse_param_value(raw_value)
        if name is None:
            config.extra[key] = value
            continue
        if value is None:
            continue
        if name == "warmup_steps":
            number = _as_float(value)
            if number is None:
                continue
            if 0 < number < 1:
                config.warmup_ratio = number
            else:
                config.warmup_steps = int(number)
            continue
        if name == "warmup_ratio":
            number = _as_float(value)
            if number:  # a ratio of 0 next to real warmup_steps must not hide them
                config.warmup_ratio = number
            elif config.warmup_ratio is None and number == 0 and config.warmup_steps is None:
                config.warmup_steps = 0
            continue
        if name in _INT_FIELDS:
            value = _as_int(value)
        elif name in _FLOAT_FIELDS:
            value = _as_float(value)
        elif name in _BOOL_FIELDS:
            value = bool(value)
        elif value is not None:
            value = str(value).lower() if name in ("lr_scheduler_type", "eval_strategy") else value
        setattr(config, name, value)
    if config.max_steps is not None and config.max_steps < 0:
        config.max_steps = None  # HF uses -1 for "not set"
    return config


def _run_ref(text: str | None) -> RunRef | None:
    return RunRef.parse(text) if text else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _as_float(value: object) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (SupportsFloat, SupportsIndex, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _as_int(value: object) -> int | None:
    number = _as_float(value)
    if number is None or math.isnan(number) or math.isinf(number):
        return None
    return int(number)
