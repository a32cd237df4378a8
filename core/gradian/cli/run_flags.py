"""The `--run` / `--mlflow-run` / `--no-log` / `--trust-run-dataset` / `--into-run` flags that
diagnose, index, attribute and counterfactual share, the `--cross-check` check attribute and plan
share, and the progress bar of an index build.

A run reference is parsed once, into a ``gradian.runs.RunRef``; its scheme picks the run source
that reads it and the report sink that logs back (see ``gradian.runs.sources``).

Not a command module (it has no ``register``): the commands import these helpers.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from gradian.errors import ConfigError

if TYPE_CHECKING:
    from pandas import DataFrame
    from rich.console import Console

    from gradian.config import GradianConfig
    from gradian.report.schema import Report
    from gradian.runs import RunRecord

__all__ = ["run_reference", "check_cross_check", "read_run", "publish_to_source", "index_progress", "TRUST_RUN_DATASET_HELP",
           "INTO_RUN_HELP"]

TRUST_RUN_DATASET_HELP = ("Read the training data from wherever the MLflow run's dataset input points (a local "
                          "path, another run), not only from the run's own artifacts")
INTO_RUN_HELP = ("Log the report into this run, already open for the work (the project run `mlflow run` "
                 "creates), instead of creating a child run of the source run")


def run_reference(run: str | None, mlflow_run: str | None) -> str | None:
    """The run to read, checked once: ``--run`` as written (a directory, ``<scheme>:<id>``), or
    ``--mlflow-run <id>`` as ``mlflow:<id>``."""
    from gradian.runs import RunRef

    if mlflow_run and run:
        raise ConfigError("--run and --mlflow-run both name a run; pass one of them")
    if mlflow_run:
        ref = RunRef.parse(mlflow_run)
        return f"mlflow:{ref.id if ref.scheme in ('mlflow', 'runs') else ref.raw}"
    return RunRef.parse(run).raw if run else None


def check_cross_check(cross_check: str) -> str:
    """``--cross-check`` as given, when it is ``auto``, ``none`` or a registered engine; else a
    ``ConfigError`` naming the flag and the choices."""
    from gradian.engines.registry import available_engines

    if cross_check not in (*available_engines(), "none", "auto"):
        raise ConfigError(f"--cross-check {cross_check!r}: use auto, none or one of {', '.join(available_engines())}")
    return cross_check


def read_run(cfg: GradianConfig, trust_run_dataset: bool = False) -> "RunRecord | None":
    """The RunRecord ``cfg.run`` names, or None.

    A tracking-server run's dataset input outside its own artifacts is read only with
    ``--trust-run-dataset``; with ``--dataset`` given, such a run is read without it.
    """
    from gradian.runs import resolve_run, resolve_run_ref, run_options

    if not cfg.run:
        return None
    options = run_options(cfg)
    if trust_run_dataset:
        options["trust_run_dataset"] = True
    if cfg.dataset:
        options["dataset_given"] = True
    record = resolve_run(resolve_run_ref(cfg.run), cache_dir=cfg.cache_dir, **options)
    # what the reader had to say about the run's files (a refused pickle, a cached download repaired)
    if record is not None and record.notes:
        from rich.console import Console

        from gradian.cli.output import shown
        from gradian.redact import redact

        for note in record.notes:
            Console(stderr=True).print(f"[yellow]note:[/] {shown(redact(str(note)))}", highlight=False, soft_wrap=True)
    return record


def publish_to_source(record: "RunRecord | None", report: "Report | Mapping[str, object]", kind: str,
                      files: Sequence[Path] = (), *, rankings: DataFrame | None = None, no_log: bool = False,
                      console: Console | None = None,
                      into_run: str | None = None) -> str | None:
    """Log ``report`` back to where ``record`` came from, through the report sink of its scheme
    (nothing for a local run, or a source without a sink). ``into_run``: ``--into-run``."""
    from gradian.report.sinks import publish_report, report_link

    ref = record.ref if record is not None else None
    if no_log or ref is None:
        return None
    child = publish_report(ref, report, kind=kind, files=list(files), rankings=rankings, into_run=into_run)
    if child is not None and console is not None:
        console.print(f"logged the {kind} report as {ref.scheme} run {child} (child of {ref.id})", highlight=False)
        link = report_link(ref, child)
        if link:
            console.print(f"see it at {link}", highlight=False, soft_wrap=True)
    return child


@contextmanager
def index_progress(console: Console) -> Iterator[Callable[[int, int], None]]:
    """A progress bar for an index build; yields ``progress(done, total)`` with examples/second.

    ``progress.relabel(what, unit)`` starts the bar over for other work (``replaying``, ``steps``),
    its rate counted afresh."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.fields[what]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]} {task.fields[unit]}/s"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("index", total=None, rate="-", what="indexing", unit="examples")
        start: dict[str, float] = {}

        def progress(done: int, total: int) -> None:
            now = time.perf_counter()
            if "t0" not in start:
                start["t0"], start["d0"] = now, done
            elapsed = now - start["t0"]
            rate = (done - start["d0"]) / elapsed if elapsed > 0 else 0.0
            bar.update(task, completed=done, total=total, rate=f"{rate:.1f}")

        def relabel(what: str, unit: str) -> None:
            start.clear()
            bar.reset(task, total=None, rate="-", what=what, unit=unit)

        progress.relabel = relabel  # type: ignore[attr-defined]
        yield progress
