"""``train_lora``: fine-tune a LoRA adapter with ``transformers.Trainer`` and peft.

What a run directory holds afterwards (``out_dir``):

- ``adapter/``: ``adapter_config.json`` and ``adapter_model.safetensors`` (peft's own format);
- ``trainer_state.json``: the trainer's state, ``log_history`` included (``Trainer.save_state``);
- ``training_args.json``: every trainer argument as JSON, plus the settings Gradian adds
  (``max_seq_length``, ``completion_only_loss``, ``packing``, ``warmup_ratio``, ``backend``).
  The trainer's pickled ``training_args.bin`` is removed from ``adapter/``; nothing here reads
  pickles (checkpoints keep the trainer's own layout, pickle included);
- ``gradian_run.json``: the run as a ``RunRecord``;
- ``checkpoint-N/`` (only with ``train.save_checkpoints``): an adapter and trainer state each.

Tokens and loss mask come from ``gradian.data.tokenize_examples``, the same function the audit and
attribution use. The mask supervises each assistant turn and the end-of-turn token after it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from gradian.errors import ConfigError, GradianError, ModelLoadError
from gradian.runs import DatasetRef, LoraSettings, RunRecord, RunRef, TrainingLogs, normalize_trainer_config
from gradian.train.backends import require_backend
from gradian.train.data import PadCollator, build_train_features
from gradian.transformers_compat import warmup_arguments

if TYPE_CHECKING:
    import datasets
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainingArguments

    from gradian.config import GradianConfig, TrainConfig

__all__ = ["train_lora", "ADAPTER_SUBDIR", "RUN_RECORD_FILE", "TRAINING_ARGS_FILE"]

#: where the adapter lands inside the run directory
ADAPTER_SUBDIR = "adapter"
RUN_RECORD_FILE = "gradian_run.json"
TRAINING_ARGS_FILE = "training_args.json"
#: files whose presence means a directory already holds a finished run
_RUN_MARKERS = (RUN_RECORD_FILE, "trainer_state.json", ADAPTER_SUBDIR)
#: below this many parameters a CPU run trains on one thread (see _cpu_threads_for)
_SMALL_MODEL_PARAMS = 20_000_000


def train_lora(
    config: GradianConfig | str | Path,
    out_dir: str | Path | None = None,
    dataset: str | Path | None = None,
    callbacks: Sequence[TrainerCallback | type[TrainerCallback]] | None = None,
    report_to: str | Sequence[str] | None = None,
    *,
    backend: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> RunRecord:
    """Fine-tune a LoRA adapter as ``config.train`` says; return the run's ``RunRecord``.

    ``config`` is a ``GradianConfig`` or the path of a ``gradian.yaml``. ``out_dir`` defaults to
    ``train.output_dir``; ``dataset`` to the config's ``dataset``; ``backend`` to
    ``train.backend``. ``callbacks`` are passed to the trainer as they are; ``report_to`` is the
    trainer's reporting integrations (none unless asked, e.g. ``["mlflow"]``). An ``out_dir``
    holding a finished run is refused unless ``overwrite``. ``progress`` shows the trainer's
    progress bar; otherwise the trainer prints nothing.
    """
    from gradian.config import GradianConfig, load_config

    if not isinstance(config, GradianConfig):
        config = load_config(config)
    train = config.train
    backend = require_backend(backend or train.backend)
    out = Path(out_dir if out_dir is not None else train.output_dir)
    _prepare_out_dir(out, overwrite)
    base_model = train.base_model or config.base_model
    if not base_model:
        raise ConfigError("no base model to fine-tune: set base_model (or train.base_model) in the config")
    data_path = dataset if dataset is not None else config.dataset
    if not data_path:
        raise ConfigError("no training data: set dataset in the config or pass --dataset")

    import torch
    import transformers
    from gradian.data import load_dataset

    transformers.set_seed(config.seed)
    tokenizer = _load_tokenizer(config.tokenizer or base_model, config.trust_remote_code)
    data = load_dataset(data_path)
    features = build_train_features(data, tokenizer, train.max_seq_length)
    model = _load_model(base_model, config, backend)
    model = _wrap_lora(model, train)

    args_kwargs = _training_arguments(config, out, report_to)
    args_kwargs.setdefault("disable_tqdm", not progress)
    trainer_cls, args, extra_trainer_kwargs = _trainer_and_args(backend, args_kwargs, tokenizer)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=_train_dataset(features.rows, backend),
        data_collator=PadCollator(tokenizer.pad_token_id),
        callbacks=list(callbacks or []),
        **extra_trainer_kwargs,
    )
    if not progress:
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # it prints every log line to stdout
    with _cpu_threads_for(model, args):
        trainer.train()
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise GradianError(
            f"training diverged: the adapter holds NaN or inf after {trainer.state.global_step} "
            "steps; lower train.learning_rate or keep train.max_grad_norm above 0"
        )

    adapter_dir = out / ADAPTER_SUBDIR
    trainer.save_model(str(adapter_dir))
    # training_args.json below replaces the pickle; leaving none means nothing can load it
    (adapter_dir / "training_args.bin").unlink(missing_ok=True)
    trainer.save_state()  # trainer_state.json in out_dir
    if train.save_checkpoints and not train.save_steps:
        _save_final_checkpoint(trainer, out)

    args_json = _args_json(args, train, backend)
    _write_json(out / TRAINING_ARGS_FILE, args_json)
    record = RunRecord(
        config=normalize_trainer_config(args_json),
        lora=LoraSettings.from_adapter_config(
            json.loads((adapter_dir / "adapter_config.json").read_text())
        ),
        logs=TrainingLogs.from_log_history(trainer.state.log_history),
        adapter_dir=str(adapter_dir.resolve()),
        dataset=DatasetRef(path=str(Path(data.path).resolve()), sha256=data.sha256,
                           n_examples=len(data)),
        ref=RunRef.parse(str(out.resolve())),
        checkpoints=[str(p.resolve()) for p in _checkpoints(out)],
    )
    record.config.extra.update({
        "backend": backend,
        "base_model": base_model,
        "n_trained_examples": len(features.rows),
        "examples_without_supervised_tokens": len(features.without_supervised_tokens),
        "n_truncated": features.n_truncated,
        "n_completion_truncated": features.n_completion_truncated,
    })
    record.write_json(out / RUN_RECORD_FILE)
    return record


# -- pieces ----------------------------------------------------------------------------------


def _train_dataset(rows: list[dict[str, list[int]]], backend: str) -> _ListDataset | datasets.Dataset:
    """The tokenized rows as the trainer takes them: a list-backed dataset for the HF Trainer, a
    ``datasets.Dataset`` for TRL's SFTTrainer (which refuses anything else); the same rows in the
    same order either way."""
    if backend == "trl":
        import datasets

        return datasets.Dataset.from_list(rows)
    return _ListDataset(rows)


class _ListDataset:
    """A map-style dataset over ready rows (the Trainer only needs len and getitem)."""

    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


def _prepare_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and any((out / m).exists() for m in _RUN_MARKERS):
        if not overwrite:
            raise ConfigError(
                f"{out} already holds a training run; pass --overwrite (overwrite=True) to replace "
                "it, or choose another --out"
            )
        for marker in (ADAPTER_SUBDIR, *[p.name for p in _checkpoints(out)]):
            shutil.rmtree(out / marker, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def _load_tokenizer(name: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of '{name}' ({err}); check base_model") from None
    if tokenizer.pad_token_id is None:
        # padding is masked out of attention and loss, so any id does; EOS is the usual choice
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_model(name: str, config: GradianConfig, backend: str) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    dtypes = {"auto": "auto", "float32": torch.float32, "float16": torch.float16,
              "bfloat16": torch.bfloat16, "float64": torch.float64}
    kwargs: dict[str, object] = {
        "dtype": dtypes.get(config.dtype, "auto"),
        "attn_implementation": config.attn_implementation,
        "trust_remote_code": config.trust_remote_code,
    }
    if config.train.load_in_4bit:
        from gradian.model_loading import bitsandbytes_config, resolve_device, resolve_dtype

        compute = kwargs["dtype"] if kwargs["dtype"] != "auto" else resolve_dtype("auto", resolve_device(config.device))
        kwargs["quantization_config"] = bitsandbytes_config("4bit", compute, key="train.load_in_4bit")
    if backend == "unsloth":
        return _load_unsloth(name, config)
    if config.attn_implementation == "eager":
        from gradian.model_loading import finite_eager_masks

        finite_eager_masks()
    try:
        model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load base model '{name}' ({err}); check base_model") from None
    from gradian.model_loading import check_finite_weights

    check_finite_weights(model, f"base model '{name}'", "its weights are damaged: copy or download the base "
                         "model again (base_model)")
    return model


def _load_unsloth(name: str, config: GradianConfig) -> PreTrainedModel:
    # Untested here (unsloth needs a GPU): its loader patches the model for faster kernels,
    # after which the usual peft wrapping and HF Trainer apply.
    from unsloth import FastLanguageModel

    model, _ = FastLanguageModel.from_pretrained(
        model_name=name, max_seq_length=config.train.max_seq_length,
        load_in_4bit=config.train.load_in_4bit,
    )
    return model


def _wrap_lora(model: PreTrainedModel, train: TrainConfig) -> PeftModel:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=train.r,
        lora_alpha=train.lora_alpha,
        lora_dropout=train.lora_dropout,
        target_modules=list(train.target_modules) if train.target_modules else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as err:  # peft: a target module that is not in the model
        raise ConfigError(f"train.target_modules={train.target_modules}: {err}") from None


def _training_arguments(config: GradianConfig, out: Path,
                        report_to: str | Sequence[str] | None) -> dict[str, object]:
    train = config.train
    if report_to is None:
        reporters: list[str] = []
    elif isinstance(report_to, str):
        reporters = [report_to]
    else:
        reporters = list(report_to)
    if train.save_checkpoints and train.save_steps > 0:
        save = {"save_strategy": "steps", "save_steps": train.save_steps}
    else:
        save = {"save_strategy": "no"}
    kwargs: dict[str, object] = {
        "output_dir": str(out),
        "learning_rate": train.learning_rate,
        "num_train_epochs": train.num_train_epochs,
        "per_device_train_batch_size": train.per_device_train_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        **warmup_arguments(train.warmup_ratio),
        "lr_scheduler_type": train.lr_scheduler_type,
        "logging_steps": train.logging_steps,
        "max_grad_norm": train.max_grad_norm,
        "weight_decay": train.weight_decay,
        "seed": config.seed,
        "data_seed": config.seed,
        "report_to": reporters,
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        "use_cpu": config.device == "cpu",
        **save,
    }
    for key, value in (train.extra or {}).items():
        if key in ("output_dir",):
            raise ConfigError(f"train.extra.{key}: set the output directory with --out or train.output_dir")
        kwargs[key] = value
    import inspect

    from transformers import TrainingArguments

    known = set(inspect.signature(TrainingArguments).parameters)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(
            f"train.extra: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
            "TrainingArguments fields in this transformers version; remove or rename them"
        )
    return kwargs


def _trainer_and_args(backend: str, kwargs: dict[str, object], tokenizer: PreTrainedTokenizerBase,
                      ) -> tuple[type[Trainer], TrainingArguments, dict[str, object]]:
    """The trainer class, its arguments object and any extra keyword arguments it needs."""
    from transformers import Trainer, TrainingArguments

    if backend != "trl":
        return Trainer, TrainingArguments(**kwargs), {}
    # SFTTrainer gets rows we already tokenized and masked, and is told to skip its own dataset
    # preparation, so TRL's loss mask never replaces the one every Gradian lane shares.
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**_hf_defaults_for(SFTConfig, kwargs), dataset_kwargs={"skip_prepare_dataset": True})
    return SFTTrainer, args, {"processing_class": tokenizer}


def _hf_defaults_for(config_cls: type[TrainingArguments], kwargs: Mapping[str, object]) -> dict[str, Any]:
    """``kwargs`` plus, for every ``TrainingArguments`` field whose default ``config_cls`` changes
    (TRL's SFTConfig turns on bfloat16 and gradient checkpointing, among others) and that the run
    does not set, the ``TrainingArguments`` default: the trl backend trains as the hf backend does
    unless ``train.extra`` says otherwise."""
    import dataclasses

    from transformers import TrainingArguments

    hf = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    out: dict[str, Any] = dict(kwargs)  # each value of the type its field takes
    for f in dataclasses.fields(config_cls):
        base = hf.get(f.name)
        if base is None or f.name in out or not f.init:
            continue
        if f.default is not dataclasses.MISSING and base.default is not dataclasses.MISSING and f.default != base.default:
            out[f.name] = base.default
    return out


def _args_json(args: TrainingArguments, train: TrainConfig, backend: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(json.dumps(args.to_dict(), default=str))
    for secret in ("hub_token",):
        data.pop(secret, None)
    data.update({
        "max_seq_length": train.max_seq_length,
        "completion_only_loss": True,
        "packing": False,
        "warmup_ratio": train.warmup_ratio,
        "world_size": args.world_size,
        "backend": backend,
        "lora_r": train.r,
        "lora_alpha": train.lora_alpha,
        "lora_dropout": train.lora_dropout,
        "lora_target_modules": train.target_modules,
    })
    return data


@contextlib.contextmanager
def _cpu_threads_for(model: torch.nn.Module, args: TrainingArguments) -> Iterator[None]:
    """One torch thread while a small model trains on CPU, restored afterwards.

    A small model's matrices are too small for intra-op threads to pay off, and on a busy
    machine (parallel test workers, a shared CI box) idle OpenMP threads spin against the other
    processes: a tinyworld fine-tune measured 50x slower with two threads than with one there.
    """
    import torch

    small = sum(p.numel() for p in model.parameters()) < _SMALL_MODEL_PARAMS
    if not (small and args.device.type == "cpu"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _save_final_checkpoint(trainer: Trainer, out: Path) -> None:
    """One ``checkpoint-N`` at the end, when checkpoints are wanted but no interval was given."""
    step = trainer.state.global_step
    target = out / f"checkpoint-{step}"
    trainer.save_model(str(target))
    trainer.state.save_to_json(str(target / "trainer_state.json"))


def _checkpoints(out: Path) -> list[Path]:
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def _write_json(path: Path, data: Mapping[str, object]) -> None:
    from gradian.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
