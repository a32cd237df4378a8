"""``gradian diagnose`` (the audit over a dataset, run and tokenizer) and ``gradian checks``.

``diagnose`` loads the tokenizer only, never model weights. Flags override the config file.
``--fail-on SEVERITY`` exits 1 when a finding at or above that severity fires, so the audit can
gate CI before a training run; bad input exits 2 through ``gradian.cli.main``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from gradian.cli.run_flags import INTO_RUN_HELP, TRUST_RUN_DATASET_HELP
from gradian.errors import ConfigError
from gradian.findings import SEVERITIES

if TYPE_CHECKING:
    from gradian.audit.runner import AuditResult
    from gradian.report.schema import Verdict

__all__ = ["register"]

_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}


def diagnose_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset, .jsonl or .json"),
    eval_dataset: Optional[str] = typer.Option(None, "--eval-dataset", help="Eval dataset; enables the contamination check"),
    run: Optional[str] = typer.Option(None, "--run", "-r", help="Run directory with trainer logs and the adapter, or runs:/<mlflow run id>"),
    mlflow_run: Optional[str] = typer.Option(None, "--mlflow-run", help="MLflow run id to read (same as --run runs:/<id>); the diagnosis is logged as its child run"),
    no_log: bool = typer.Option(False, "--no-log", help="Read an MLflow run but do not log the diagnosis back"),
    trust_run_dataset: bool = typer.Option(False, "--trust-run-dataset", help=TRUST_RUN_DATASET_HELP),
    into_run: Optional[str] = typer.Option(None, "--into-run", help=INTO_RUN_HELP),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model id or path, used for its tokenizer only"),
    adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="LoRA adapter folder (its adapter_config.json): the LoRA settings a run logged with params only lacks"),
    max_seq_length: Optional[int] = typer.Option(None, "--max-seq-length", help="Sequence length used in training (default: the run's)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write diagnose.json and diagnose.md to this directory"),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help=f"Exit 1 when a finding at or above this severity fires ({', '.join(SEVERITIES)})"),
    as_json: bool = typer.Option(False, "--json", help="Print the diagnosis (the diagnose.json report) as JSON on stdout instead of tables"),
) -> None:
    """Audit a dataset, trainer config and training logs. No GPU, no model weights."""
    from rich.console import Console

    from gradian.audit import write_diagnosis
    from gradian.cli.output import print_json
    from gradian.audit.session import diagnose
    from gradian.config import load_config
    from gradian.cli.run_flags import publish_to_source, read_run, run_reference
    from gradian.runs import has_report_sink

    if fail_on is not None and fail_on.lower() not in SEVERITIES:
        raise ConfigError(f"--fail-on {fail_on!r}: use one of {', '.join(SEVERITIES)}")
    if max_seq_length is not None and max_seq_length <= 0:
        raise ConfigError(f"--max-seq-length {max_seq_length}: must be a positive number of tokens")
    if out is not None:
        from gradian.paths import ensure_writable_dir

        ensure_writable_dir(out, "--out")
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(f"--adapter {adapter}: no adapter_config.json there; pass the folder the trainer saved "
                          "the adapter to (save_model's output_dir, or a checkpoint-N inside it)")
    run = run_reference(run, mlflow_run)
    cfg = load_config(
        config,
        overrides={"dataset": dataset, "eval_dataset": eval_dataset, "run": run, "base_model": base_model,
                   "adapter_path": adapter},
    )
    diagnosis = diagnose(cfg, max_seq_length, run=read_run(cfg, trust_run_dataset))
    result, report = diagnosis.result, diagnosis.report
    # with --json, stdout carries the JSON alone; everything else goes to stderr
    console = Console(stderr=as_json)
    record = diagnosis.inputs.run
    if as_json:
        print_json(report.to_json())
    else:
        _print_result(result, report.verdict)
    files: list[Path] = []
    if out is not None:
        files = list(write_diagnosis(report, out))
        console.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False, soft_wrap=True)
    if not no_log and record is not None and has_report_sink(record.ref) and not files:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="gradian-diagnose-") as staging:  # for the sink only
            files = list(write_diagnosis(report, staging))
            publish_to_source(record, report, "diagnose", files, no_log=no_log, console=console, into_run=into_run)
    else:
        publish_to_source(record, report, "diagnose", files, no_log=no_log, console=console, into_run=into_run)
    if fail_on is not None and result.at_least(fail_on.lower()):
        n = len(result.at_least(fail_on.lower()))
        Console(stderr=True).print(f"[bold red]{n} finding(s) at or above {fail_on.lower()}: failing (--fail-on).[/]",
                                   highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)


def _print_result(result: AuditResult, verdict: "Verdict") -> None:
    """The findings and skipped checks as tables, and ``verdict`` (the report's) in words."""
    from gradian.cli.output import print_line, print_table

    critical = result.at_least("critical")
    if critical:
        print_line(f"{len(critical)} critical issue(s) invalidate or dominate this run: fix these first.", "bold red")
    if result.findings:
        print_table(f"Audit findings ({len(result.findings)} fired, {len(result.ran)} checks ran)",
                    ("severity", "check", "finding", "fix"),
                    [(f.severity, f.id, f.title, f.fix) for f in result.findings],
                    styles=[_STYLE.get(f.severity, "") for f in result.findings])
    else:
        print_line("No check fired.", "green")
    print_line(f"Verdict ({verdict.kind}): {verdict.summary}", "bold")
    if result.skipped:
        print_table(f"Skipped checks ({len(result.skipped)})", ("check", "why"),
                    [(s.id, s.reason) for s in result.skipped])


def checks_command(
    as_json: bool = typer.Option(False, "--json", help="Print the checks as a JSON list (id, category, description, needs)"),
) -> None:
    """List every registered diagnostic check: id, category, description and the inputs it needs.

    Piped or redirected, one check per line (tab-separated: id, category, description, needs).
    """
    from gradian.audit import all_checks
    from gradian.cli.output import print_json, print_table

    checks = all_checks()
    if as_json:
        print_json([{"id": c.id, "category": c.category, "description": c.description, "needs": list(c.needs)}
                    for c in checks])
        return
    print_table(f"{len(checks)} diagnostic checks", ("id", "category", "description", "needs"),
                [(c.id, c.category, c.description, ", ".join(c.needs)) for c in checks],
                title_on_stderr=True)


def register(app: typer.Typer) -> None:
    app.command("diagnose")(diagnose_command)
    app.command("checks")(checks_command)
