"""The `--run` / `--mlflow-run` / `--no-log` / `--trust-run-dataset` flags that diagnose, index,
attribute and counterfactual share, and the progress bar of an index build.

Not a command module (it has no ``register``): the commands import these helpers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from gradian.errors import ConfigError

__all__ = ["run_reference", "read_run", "publish_to_source", "index_progress", "TRUST_RUN_DATASET_HELP"]

TRUST_RUN_DATASET_HELP = ("Read the training data from wherever the MLflow run's dataset input points (a local "
                          "path, another run), not only from the run's own artifacts")


def run_reference(run: str | None, mlflow_run: str | None) -> str | None:
    """The run to read: ``--run`` as given, or ``--mlflow-run <id>`` as ``runs:/<id>``."""
    if mlflow_run and run:
        raise ConfigError("--run and --mlflow-run both name a run; pass one of them")
    if mlflow_run:
        return mlflow_run if mlflow_run.startswith("runs:/") else f"runs:/{mlflow_run}"
    return run


def read_run(cfg: Any, trust_run_dataset: bool = False) -> Any:
    """The RunRecord ``cfg.run_dir`` names, or None.

    A tracking-server run's dataset input outside its own artifacts is read only with
    ``--trust-run-dataset``; with ``--dataset`` given, such a run is read without it.
    """
    from gradian.runs import resolve_run

    if not cfg.run_dir:
        return None
    options = {"trust_run_dataset": True} if trust_run_dataset else {}
    if cfg.dataset:
        options["dataset_given"] = True
    return resolve_run(cfg.run_dir, cache_dir=cfg.cache_dir, **options)


def publish_to_source(record: Any, report: dict, kind: str, files: Sequence[Path] = (), *,
                      rankings: Any = None, no_log: bool = False, console: Any = None) -> str | None:
    """Log ``report`` back to the tracking-server run ``record`` came from (nothing for a local run)."""
    from gradian.runs import publish_report

    source = getattr(record, "source", None)
    if no_log or not source:
        return None
    child = publish_report(source, report, kind=kind, files=list(files), rankings=rankings)
    if child is not None and console is not None:
        console.print(f"logged the {kind} report as MLflow run {child} (child of {source.split(':', 1)[1]})",
                      highlight=False)
    return child


@contextmanager
def index_progress(console: Any) -> Iterator[Callable[[int, int], None]]:
    """A progress bar for an index build; yields ``progress(done, total)`` with examples/second."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("indexing"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} examples/s"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("index", total=None, rate="-")
        start: dict[str, float] = {}

        def progress(done: int, total: int) -> None:
            now = time.perf_counter()
            if "t0" not in start:
                start["t0"], start["d0"] = now, done
            elapsed = now - start["t0"]
            rate = (done - start["d0"]) / elapsed if elapsed > 0 else 0.0
            bar.update(task, completed=done, total=total, rate=f"{rate:.1f}")

        yield progress
