"""Read a local run directory, as the HF Trainer, PEFT or ``gradian train`` leave it.

Looked for, in order of trust: ``gradian_run.json`` (a RunRecord we wrote), a JSON dump of the
training arguments (``training_args.json``, ``args.json``, ``training_config.json``, ``config.json``
when it holds trainer arguments), ``trainer_state.json`` (``log_history`` and a few settings),
and ``adapter_config.json`` for the LoRA settings. ``training_args.bin`` is a pickle and is never
loaded. The adapter is the run dir itself, ``adapter/``, or the newest ``checkpoint-N/``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gradian.errors import RunRecordError
from gradian.runs.record import (
    LoraSettings,
    RunRecord,
    TrainingLogs,
    normalize_trainer_config,
)

__all__ = ["read_run_dir", "find_adapter_dir", "list_checkpoints"]

_ARGS_FILES = ("training_args.json", "args.json", "training_config.json", "trainer_config.json")
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunRecordError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """``checkpoint-N`` directories, oldest (smallest N) first."""
    found = [p for p in run_dir.iterdir() if p.is_dir() and _CHECKPOINT.search(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT.search(p.name).group(1)))


def find_adapter_dir(run_dir: Path) -> Path | None:
    """The directory holding ``adapter_config.json``: the run dir, ``adapter/``, or the last checkpoint."""
    for candidate in (run_dir, run_dir / "adapter", run_dir / "final", run_dir / "peft"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    for checkpoint in reversed(list_checkpoints(run_dir)):
        if (checkpoint / "adapter_config.json").is_file():
            return checkpoint
    return None


def _find_trainer_state(run_dir: Path) -> Path | None:
    if (run_dir / "trainer_state.json").is_file():
        return run_dir / "trainer_state.json"
    for checkpoint in reversed(list_checkpoints(run_dir)):
        if (checkpoint / "trainer_state.json").is_file():
            return checkpoint / "trainer_state.json"
    return None


def read_run_dir(path: str | Path) -> RunRecord:
    """Build a RunRecord from a run directory; missing pieces stay empty, never guessed."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise RunRecordError(f"run directory not found: {run_dir}. Pass the trainer's output_dir with --run.")

    record = RunRecord(source=str(run_dir))
    own = run_dir / "gradian_run.json"
    if own.is_file():
        record = RunRecord.from_dict(_load_json(own))
        record.source = str(run_dir)

    raw_args: dict[str, Any] = {}
    for name in _ARGS_FILES:
        if (run_dir / name).is_file():
            data = _load_json(run_dir / name)
            if isinstance(data, dict):
                raw_args.update(data)
            break

    state_path = _find_trainer_state(run_dir)
    state: dict[str, Any] = _load_json(state_path) if state_path else {}
    if state:
        # trainer_state.json records a few arguments itself; explicit args files win.
        for key in ("num_train_epochs", "max_steps", "train_batch_size", "logging_steps"):
            if key in state and key not in raw_args:
                raw_args[key] = state[key]
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

    adapter = find_adapter_dir(run_dir)
    if adapter is not None:
        record.adapter_dir = str(adapter)
        record.lora = LoraSettings.from_adapter_config(_load_json(adapter / "adapter_config.json"))
    elif record.adapter_dir and not Path(record.adapter_dir).is_absolute():
        record.adapter_dir = str(run_dir / record.adapter_dir)
    record.checkpoints = [str(p) for p in list_checkpoints(run_dir) if (p / "adapter_config.json").is_file()]

    if not (own.is_file() or raw_args or state or adapter):
        raise RunRecordError(
            f"{run_dir}: no trainer output found (looked for gradian_run.json, training_args.json, "
            "trainer_state.json, adapter_config.json); point --run at the trainer's output_dir"
        )
    return record
