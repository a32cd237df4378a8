"""``gradian counterfactual``: retrain without the accused examples and measure the capability again.

What to drop: ``--report`` (a report.json from ``gradian attribute``) with ``--drop accused`` (its
accused set: the ``accused`` column of the ``rankings.parquet`` beside it) or ``--drop cluster``
(its whole accused cluster, the default), ``--drop-cluster`` or ``--drop-ids``. The
retrain uses the config's ``train:`` recipe and seed (or, when the config has none and a run is
given, the recipe the run recorded). With ``--mlflow-run``/``--run runs:/<id>`` the result is
logged as a child run of kind ``counterfactual`` beside the diagnosis. ``--until-recovered``
runs rounds (``gradian.attribution.rounds``): while the capability has not come back, the
retrained adapter is attributed again and its accused rows are removed too, at most
``--max-rounds`` retrains, each round its own child run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

import typer

from gradian.cli.run_flags import INTO_RUN_HELP, TRUST_RUN_DATASET_HELP
from gradian.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from gradian.report.schema import Report

__all__ = ["register", "print_counterfactual"]


def counterfactual_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file (its train: section is the recipe)"),
    report: Optional[Path] = typer.Option(None, "--report", help="report.json from `gradian attribute`: drop its accused set (or cluster, see --drop)"),
    drop: Optional[str] = typer.Option(None, "--drop", help="With --report: accused (its accused set) or cluster (its whole accused cluster, the default)"),
    drop_cluster: Optional[str] = typer.Option(None, "--drop-cluster", help="Drop this cluster (by the report's rankings, else the config's clustering)"),
    drop_ids: Optional[str] = typer.Option(None, "--drop-ids", help="Drop these example ids: a,b,c or @file (ids one a line or comma-separated, as report.md prints them, or a JSON list)"),
    truth: Optional[Path] = typer.Option(None, "--truth", help="Known-bad rows for removal precision: a tinyworld scenario.json or a list of row indices/ids"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset the original fine-tune used"),
    eval_dataset: Optional[str] = typer.Option(None, "--eval-dataset", "-e", help="Items describing the capability, with the answers you wanted"),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model id or path"),
    adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="The original LoRA adapter, to measure it when no report is given"),
    run: Optional[str] = typer.Option(None, "--run", "-r", help="The original run: a run directory or runs:/<mlflow run id>"),
    mlflow_run: Optional[str] = typer.Option(None, "--mlflow-run", help="MLflow run id (same as --run runs:/<id>); the result is logged as its child run"),
    no_log: bool = typer.Option(False, "--no-log", help="Read an MLflow run but do not log the result back"),
    trust_run_dataset: bool = typer.Option(False, "--trust-run-dataset", help=TRUST_RUN_DATASET_HELP),
    into_run: Optional[str] = typer.Option(None, "--into-run", help=INTO_RUN_HELP),
    capability: Optional[str] = typer.Option(None, "--capability", help="Name of the capability (default: the report's, else 'capability')"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the kept rows, the retrained run and report.json/.md/.html"),
    until_recovered: bool = typer.Option(False, "--until-recovered", help="Rounds: while the capability has not come back, attribute again on the retrained adapter and remove its accused rows too"),
    max_rounds: int = typer.Option(3, "--max-rounds", help="With --until-recovered: the most retrains (1-10)"),
) -> None:
    """Drop the accused examples, retrain from the same base with the same recipe and seed, re-measure."""
    import tempfile

    from rich.console import Console

    from gradian.config import load_config
    from gradian.attribution import MAX_ROUNDS, run_until_recovered
    from gradian.counterfactual import DROP_CHOICES, load_planted, load_report, parse_id_list, plan_removal, run_counterfactual
    from gradian.cli.output import shown
    from gradian.cli.run_flags import publish_to_source, read_run, run_reference
    from gradian.data import load_dataset
    from gradian.inputs import resolve_inputs
    from gradian.report.schema import AnalysisInputs, Report

    run = run_reference(run, mlflow_run)
    if drop_ids is not None and drop_cluster is not None:
        raise ConfigError("--drop-ids and --drop-cluster both say what to drop; pass one of them")
    if report is None and drop_ids is None and drop_cluster is None:
        raise ConfigError("say what to drop: --report (its accused set or cluster), --drop-cluster or --drop-ids")
    if drop is not None and drop not in DROP_CHOICES:
        raise ConfigError(f"--drop {drop!r}: use {' or '.join(DROP_CHOICES)}")
    if drop is not None and report is None:
        raise ConfigError("--drop names part of a report: pass --report too (or use --drop-cluster/--drop-ids)")
    if not 1 <= max_rounds <= MAX_ROUNDS:
        raise ConfigError(f"--max-rounds {max_rounds}: give 1 to {MAX_ROUNDS} (each round is a full retrain)")
    if max_rounds != 3 and not until_recovered:
        raise ConfigError("--max-rounds bounds the rounds of --until-recovered: pass --until-recovered too")
    if out is not None:  # before the retrain, not after it
        from gradian.paths import ensure_writable_dir

        ensure_writable_dir(out, "--out")

    accusing, rankings = load_report(report) if report is not None else (None, None)
    accusing_report = Report.of(accusing) if accusing is not None else None
    flags: dict[str, object] = {"dataset": dataset, "eval_dataset": eval_dataset, "base_model": base_model,
                             "adapter_path": adapter, "run": run}
    cfg = load_config(config, overrides=flags)
    record = read_run(cfg, trust_run_dataset)
    # what neither the flags nor the config say comes from the report's inputs, then the run's
    inputs = getattr(accusing_report.manifest, "inputs", None) if accusing_report else None
    cfg = resolve_inputs(cfg, record, inputs if isinstance(inputs, AnalysisInputs) else None).config
    if not cfg.dataset:
        raise ConfigError("no training data: pass --dataset (the file the original fine-tune trained on)")

    data = load_dataset(cfg.dataset)
    plan = plan_removal(data, report=accusing, rankings=rankings, drop_cluster=drop_cluster,
                        drop_ids=parse_id_list(drop_ids) if drop_ids is not None else None,
                        clustering=cfg.clustering, seed=cfg.seed, drop=drop)
    planted = load_planted(truth, data) if truth is not None else None
    accused_capability = accusing_report.capability if accusing_report is not None else None
    name = capability or (accused_capability.name if accused_capability else None) or "capability"
    console = Console(stderr=True)
    out_dir = out if out is not None else Path(tempfile.mkdtemp(prefix="gradian-counterfactual-"))
    def log(message: str) -> None:
        console.print(f"[dim]{shown(message)}[/]", highlight=False)

    before = accused_capability.to_json() if accused_capability else None
    if until_recovered:
        rounds = run_until_recovered(cfg, plan, out_dir=out_dir, capability=name, before=before, planted=planted,
                                     run=record, max_rounds=max_rounds, log=log)
        print_counterfactual(Console(), rounds.report)
        Console().print(f"wrote {out_dir / 'report.html'} (and report.json, report.md; each round in "
                        f"{out_dir / 'round-<k>'})", highlight=False)
        # every round but the last is its own child run; the last is the final report, with the rounds table
        for earlier in rounds.rounds[:-1]:
            publish_to_source(record, earlier.report, "counterfactual", earlier.files,
                              no_log=no_log, console=Console(), into_run=into_run)
        publish_to_source(record, rounds.report, "counterfactual", rounds.files, no_log=no_log, console=Console(),
                          into_run=into_run)
        return
    outcome = run_counterfactual(cfg, plan, out_dir=out_dir, capability=name, before=before, planted=planted,
                                 run=record, log=log)
    written = outcome.report
    print_counterfactual(Console(), written)
    Console().print(f"wrote {out_dir / 'report.html'} (and report.json, report.md, the retrained run in {out_dir / 'run'})",
                    highlight=False)
    publish_to_source(record, written, "counterfactual", outcome.files, no_log=no_log, console=Console(), into_run=into_run)


def print_counterfactual(console: Console, report: "Report | Mapping[str, object]") -> None:
    """One screen: the outcome, the verdict's summary and its hedges."""
    from rich.panel import Panel

    from gradian.cli.output import shown
    from gradian.report.schema import Report

    typed = Report.of(report)
    outcome = typed.counterfactual.outcome if typed.counterfactual else "?"
    lines = [f"[bold]Counterfactual: {outcome.replace('_', ' ')}[/]", shown(typed.verdict.summary)]
    for r in (typed.counterfactual.rounds if typed.counterfactual else None) or []:
        lines.append(f"  round {r.round}: {r.n_removed} removed -> {r.outcome.replace('_', ' ')} ({r.after:.4g})"
                     + (f", then {len(r.added)} more accused" if r.added else ""))
    for hedge in typed.verdict.hedges:
        lines.append(f"[yellow]- {shown(hedge)}[/]")
    console.print(Panel("\n".join(lines), title="Gradian", expand=False), highlight=False)


def register(app: typer.Typer) -> None:
    app.command("counterfactual")(counterfactual_command)
