"""Run records: what a training run left behind, normalized for the audit and the report.

Public interface: ``RunRecord`` (with ``TrainerConfig``, ``LoraSettings``, ``TrainingLogs``,
``LogStep``, ``DatasetRef``), ``normalize_trainer_config``, ``parse_param_value``,
``read_run_dir``, ``find_adapter_dir``, ``list_checkpoints``, ``RunRef`` (a ``--run`` value parsed
once: scheme, id, as written), ``resolve_run`` (a local dir or, through the ``gradian.run_sources``
entry point named by the reference's scheme, a run elsewhere; ``resolve_run_ref``,
``installed_schemes``; ``RunSource`` is a source's contract), ``has_report_sink`` (whether the
record's scheme has a ``gradian.report_sinks`` entry point; ``gradian.report.sinks`` publishes
through it), ``read_training_args``
(``training_args.bin`` through ``torch.load(weights_only=True)`` and an allowlist;
``TrainingArgsRefused`` otherwise) and ``fill_config_from_logs`` (learning rate, schedule and
warmup fitted to the logged rates when no argument file recorded them).
"""

from gradian.runs.reader import find_adapter_dir, list_checkpoints, read_run_dir
from gradian.runs.schedule import fill_config_from_logs
from gradian.runs.training_args import TrainingArgsRefused, read_training_args
from gradian.runs.ref import RunRef
from gradian.runs.sources import (
    RunSource,
    has_report_sink,
    installed_schemes,
    is_remote_run_ref,
    resolve_run,
    resolve_run_ref,
    run_options,
)
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
    "RunRef",
    "RunSource",
    "TrainerConfig",
    "TrainingArgsRefused",
    "TrainingLogs",
    "fill_config_from_logs",
    "find_adapter_dir",
    "has_report_sink",
    "installed_schemes",
    "is_remote_run_ref",
    "list_checkpoints",
    "run_options",
    "normalize_trainer_config",
    "parse_param_value",
    "read_run_dir",
    "read_training_args",
    "resolve_run",
    "resolve_run_ref",
]
