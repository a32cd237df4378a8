"""Run records: what a training run left behind, normalized for the audit and the report.

Public interface: ``RunRecord`` (with ``TrainerConfig``, ``LoraSettings``, ``TrainingLogs``,
``LogStep``, ``DatasetRef``), ``normalize_trainer_config``, ``parse_param_value``,
``read_run_dir``, ``find_adapter_dir``, ``list_checkpoints``, ``resolve_run`` (a local dir or,
through the ``gradian.run_sources`` entry points, a tracking-server run).
"""

from gradian.runs.reader import find_adapter_dir, list_checkpoints, read_run_dir
from gradian.runs.sources import is_remote_run_ref, publish_report, resolve_run
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
    "is_remote_run_ref",
    "list_checkpoints",
    "normalize_trainer_config",
    "parse_param_value",
    "publish_report",
    "read_run_dir",
    "resolve_run",
]
