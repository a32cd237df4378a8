"""Run records: what a training run left behind, normalized for the audit and the report.

Public interface: ``RunRecord`` (with ``TrainerConfig``, ``LoraSettings``, ``TrainingLogs``,
``LogStep``, ``DatasetRef``), ``normalize_trainer_config``, ``parse_param_value``,
``read_run_dir``, ``find_adapter_dir``, ``list_checkpoints``.
"""

from gradian.runs.reader import find_adapter_dir, list_checkpoints, read_run_dir
from gradian.runs.record import (
    DatasetRef,
    LogStep,
    LoraSettings,
    RunRecord,
    TrainerConfig,
    TrainingLogs,
    normalize_trainer_config,
    parse_param_value,
)

__all__ = [
    "DatasetRef",
    "LogStep",
    "LoraSettings",
    "RunRecord",
    "TrainerConfig",
    "TrainingLogs",
    "find_adapter_dir",
    "list_checkpoints",
    "normalize_trainer_config",
    "parse_param_value",
    "read_run_dir",
]
