"""Logging a validation experiment to MLflow: params, metrics, tags, artifacts and child reports.

Inside ``mlflow run`` the project's run is the experiment's run (``MLFLOW_RUN_ID``); the suite
entry point ``all`` logs each experiment as a nested run under it. Run standalone, the runs go
to the ``gradian-validation`` experiment of the current tracking URI (MLflow's default is
``sqlite:///mlflow.db`` in the working directory).

Params are the verdict's parameters under ``validation.`` (``mlflow run`` has already logged the
entry point's own). Metrics are the verdict's numeric figures, flattened to dotted keys
(``lds.datainf.spearman``);
``validation.pass`` is 1 for PASS, 0 for FAIL and -1 for INCONCLUSIVE. Reports that Gradian itself
wrote (the attribution, the counterfactual) are logged through ``gradian.report.sinks.publish_report`` as
child runs of the experiment's run, the way a user's diagnosis hangs under their training run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from verdicts import Verdict

__all__ = ["ChildReport", "ExperimentResult", "EXPERIMENT_NAME", "flatten_numbers", "log_result", "suite_run"]

EXPERIMENT_NAME = "gradian-validation"
_PASS_VALUE = {"PASS": 1.0, "FAIL": 0.0, "INCONCLUSIVE": -1.0}


@dataclass
class ChildReport:
    """A Gradian report to log as a child run (``kind``: attribute, counterfactual, ...)."""

    kind: str
    report: dict[str, Any]
    files: list[Path] = field(default_factory=list)
    rankings: Any = None


@dataclass
class ExperimentResult:
    verdict: Verdict
    artifacts: list[Path] = field(default_factory=list)
    children: list[ChildReport] = field(default_factory=list)


def flatten_numbers(data: Any, prefix: str = "") -> dict[str, float]:
    """Finite numbers (and booleans) in nested dicts, keyed by their dotted path."""
    from gradian.report.tracker import flatten_numbers as flatten

    return flatten(data, prefix)


def _safe_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)[:250]


def _start(run_name: str, nested: bool) -> Any:
    import mlflow

    if not nested and not os.environ.get("MLFLOW_RUN_ID") and not (
            os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID")):
        from gradian_mlflow.experiment import use_training_experiment

        use_training_experiment(EXPERIMENT_NAME)  # created as a model-training experiment for the UI
    return mlflow.start_run(run_name=run_name, nested=nested)


@contextmanager
def suite_run(quick: bool) -> Iterator[Any]:
    """The parent run of a whole suite."""
    import mlflow

    with _start("validation-suite" + ("-quick" if quick else ""), nested=False) as run:
        mlflow.set_tags({"gradian.kind": "validation_suite", "validation.quick": str(quick).lower()})
        yield run


def log_result(result: ExperimentResult, *, nested: bool = False) -> str:
    """Log one experiment; returns its run id."""
    import mlflow

    from gradian.report.sinks import publish_report

    v = result.verdict
    with _start(f"validation-{v.experiment}", nested=nested) as run:
        mlflow.set_tags({"gradian.kind": "validation", "validation.experiment": v.experiment,
                         "validation.status": v.status, "mlflow.note.content": v.reason[:5000]})
        # prefixed: under `mlflow run` the entry point's own parameters (quick, workdir) are params already
        params = {_safe_key(f"validation.{k}"): str(val)[:500] for k, val in v.params.items()}
        if params:
            mlflow.log_params(params)
        metrics = {_safe_key(k): val for k, val in flatten_numbers(v.figures).items()}
        metrics["validation.pass"] = _PASS_VALUE[v.status]
        if v.seconds is not None:
            metrics["validation.seconds"] = float(v.seconds)
        mlflow.log_metrics(metrics)
        for path in result.artifacts:
            path = Path(path)
            if path.is_file():
                mlflow.log_artifact(str(path), artifact_path="validation")
        for child in result.children:
            with _outside_project_run():
                publish_report(f"mlflow:{run.info.run_id}", child.report, kind=child.kind,
                               files=[p for p in child.files if Path(p).is_file()], rankings=child.rankings)
        return run.info.run_id


@contextmanager
def _outside_project_run() -> Iterator[None]:
    """Hide ``MLFLOW_RUN_ID`` while a child report is published.

    Inside ``mlflow run`` the sink adopts the project run as the diagnosis when it shares the
    source's experiment. Under the suite, the project run is the *parent* of the experiment run
    that is the source here, so adopting it would make the two runs each other's parent; a fresh
    child run is what is wanted.
    """
    saved = os.environ.pop("MLFLOW_RUN_ID", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["MLFLOW_RUN_ID"] = saved
