"""Read a local run directory, as the HF Trainer, PEFT or ``gradian train`` leave it.

Looked for, in order of trust: ``gradian_run.json`` (a RunRecord we wrote), a JSON dump of the
training arguments (``training_args.json``, ``args.json``, ``training_config.json``,
``trainer_config.json``), else ``training_args.bin`` (the Trainer's pickle, read only through
``gradian.runs.training_args``: ``torch.load(weights_only=True)`` with an allowlist of argument
classes, never a general unpickle), ``trainer_state.json`` (``log_history`` and a few settings),
and ``adapter_config.json`` for the LoRA settings. The adapter is the run dir itself,
``adapter/``, or the newest ``checkpoint-N/``.

Settings no file recorded are left empty, except the learning rate, schedule and warmup, which
``gradian.runs.schedule`` fits to the logged learning rates and lists in ``RunRecord.inferred``.
A ``training_args.bin`` that is refused leaves a one-line note in ``RunRecord.notes``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradian.errors import RunRecordError
from gradian.runs.record import (
    LoraSettings,
    RunRecord,
    TrainingLogs,
    normalize_trainer_config,
)
from gradian.runs.ref import RunRef
from gradian.runs.schedule import fill_config_from_logs

if TYPE_CHECKING:
    from gradian.jsontypes import JsonObject

__all__ = ["read_run_dir", "find_adapter_dir", "list_checkpoints"]

_ARGS_FILES = ("training_args.json", "args.json", "training_config.json", "trainer_config.json")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunRecordError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    except UnicodeDecodeError as err:
        raise RunRecordError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); the file is "
                             "damaged: write it again or remove it from the run folder") from None
    except RecursionError:
        raise RunRecordError(f"{path}: nested too deeply to be a trainer's file; remove it from the "
                             "run folder") from None


def _load_object(path: Path) -> JsonObject:
    """A JSON file that must hold an object (a trainer's state, an adapter config)."""
    data = _load_json(path)
    if not isinstance(data, dict):
        raise RunRecordError(f"{path}: holds a JSON {type(data).__name__}, not an object; the file is "
                             "damaged: write it again or remove it from the run folder")
    return data


def list_checkpoints(run_dir: Path) -> list[Path]:
    """``checkpoint-N`` directories, oldest (smallest N) first."""
    found = [p for p in run_dir.iterdir() if p.is_dir() and _CHECKPOINT.search(p.name)]
    return sorted(found, key=_checkpoint_step)


def _checkpoint_step(path: Path) -> int:
    match = _CHECKPOINT.search(path.name)
    return int(match.group(1)) if match else -1


def find_adapter_dir(run_dir: Path) -> Path | None:
    """The directory holding ``adapter_config.json``: the run dir, ``adapter/``, or the last checkpoint."""
    for candidate in (run_dir, run_dir / "adapter", run_dir / "final", run_dir / "peft"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    for checkpoint in reversed(list_checkpoints(run_dir)):
        if (checkpoint / "adapter_config.json").is_file():
            return checkpoint
    return None


def _find_in_run(run_dir: Path, name: str) -> Path | None:
    """``name`` in the run dir, else in the newest checkpoint that has it."""
    if (run_dir / name).is_file():
        return run_dir / name
    for checkpoint in reversed(list_checkpoints(run_dir)):
        if (checkpoint / name).is_file():
            return checkpoint / name
    return None


def _read_pickled_args(run_dir: Path, record: RunRecord) -> JsonObject:
    """The arguments in ``training_args.bin``, or {} with a note saying why it was not used."""
    from gradian.runs.training_args import TrainingArgsRefused, read_training_args

    path = _find_in_run(run_dir, "training_args.bin")
    if path is None:
        return {}
    try:
        return read_training_args(path)
    except TrainingArgsRefused as err:
        fallback = (
            "using trainer_state.json instead (learning rate, schedule and warmup fitted to its "
            "logged learning rates)" if _find_in_run(run_dir, "trainer_state.json") else
            "no trainer_state.json either, so the run's settings stay unknown; pass a "
            "training_args.json (TrainingArguments.to_json_string()) beside it"
        )
        record.notes.append(f"{err}; {fallback}")
        return {}


def read_run_dir(path: str | Path) -> RunRecord:
    """Build a RunRecord from a run directory; missing pieces stay empty, never guessed."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise RunRecordError(f"run directory not found: {run_dir}. Pass the trainer's output_dir with --run.")

    record = RunRecord(ref=RunRef.parse(str(run_dir)))
    own = run_dir / "gradian_run.json"
    if own.is_file():
        record = RunRecord.from_dict(_load_json(own), where=str(own))
        record.source = str(run_dir)

    raw_args: JsonObject = {}
    for name in _ARGS_FILES:
        if (run_dir / name).is_file():
            data = _load_json(run_dir / name)
            if isinstance(data, dict):
                raw_args.update(data)
            break
    if not raw_args and not own.is_file():
        raw_args = _read_pickled_args(run_dir, record)

    state_path = _find_in_run(run_dir, "trainer_state.json")
    state: dict[str, Any] = _load_object(state_path) if state_path else {}
    if state:
        # trainer_state.json records a few arguments itself; explicit args files win. Its
        # max_steps is the trainer's plan (derived from epochs when the user set none), not the
        # user's max_steps, so it is kept apart.
        for key in ("num_train_epochs", "train_batch_size", "logging_steps"):
            if key in state and key not in raw_args:
                raw_args[key] = state[key]
        if "per_device_train_batch_size" in raw_args:  # the state's figure counts every GPU
            raw_args.pop("train_batch_size", None)
        planned = state.get("max_steps")
        if isinstance(planned, int) and planned > 0:
            record.planned_steps = planned
        if not record.logs.steps:
            record.logs = TrainingLogs.from_log_history(state.get("log_history") or [])

    if raw_args:
        parsed = normalize_trainer_config(raw_args)
        if own.is_file():  # keep what gradian_run.json recorded, fill only the gaps
            for field_name, value in vars(parsed).items():
                if field_name != "extra" and getattr(record.config, field_name) is None:
                    setattr(record.config, field_name, value)
        else:
            record.config = parsed

    if record.logs.steps:
        fill_config_from_logs(record)

    adapter = find_adapter_dir(run_dir)
    if adapter is not None:
        record.adapter_dir = str(adapter)
        record.lora = LoraSettings.from_adapter_config(_load_object(adapter / "adapter_config.json"))
    elif record.adapter_dir and not Path(record.adapter_dir).is_absolute():
        record.adapter_dir = str(run_dir / record.adapter_dir)
    record.checkpoints = [str(p) for p in list_checkpoints(run_dir) if (p / "adapter_config.json").is_file()]

    if not (own.is_file() or raw_args or state or adapter):
        raise RunRecordError(
            f"{run_dir}: no trainer output found (looked for gradian_run.json, training_args.json, "
            "training_args.bin, trainer_state.json, adapter_config.json); point --run at the "
            "trainer's output_dir" + (f" ({record.notes[-1]})" if record.notes else "")
        )
    return record
