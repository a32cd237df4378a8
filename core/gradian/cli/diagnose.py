"""``gradian diagnose`` (the audit over a dataset, run and tokenizer) and ``gradian checks``.

``diagnose`` loads the tokenizer only, never model weights. Flags override the config file.
``--fail-on SEVERITY`` exits 1 when a finding at or above that severity fires, so the audit can
gate CI before a training run; bad input exits 2 through ``gradian.cli.main``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from gradian.errors import ConfigError, ModelLoadError
from gradian.findings import SEVERITIES

__all__ = ["register", "load_tokenizer"]

_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}


def load_tokenizer(name: str, trust_remote_code: bool = False, flag: str = "--base-model") -> Any:
    """``AutoTokenizer.from_pretrained(name)``: the tokenizer only, never the weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(
            f"{flag} {name}: cannot load its tokenizer ({first}); pass a local model directory or a "
            "hub id available offline"
        ) from None


def diagnose_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset, .jsonl or .json"),
    eval_dataset: Optional[str] = typer.Option(None, "--eval-dataset", help="Eval dataset; enables the contamination check"),
    run: Optional[str] = typer.Option(None, "--run", "-r", help="Run directory with trainer logs and the adapter"),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model id or path, used for its tokenizer only"),
    max_seq_length: Optional[int] = typer.Option(None, "--max-seq-length", help="Sequence length used in training (default: the run's)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write diagnose.json and diagnose.md to this directory"),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help=f"Exit 1 when a finding at or above this severity fires ({', '.join(SEVERITIES)})"),
) -> None:
    """Audit a dataset, trainer config and training logs. No GPU, no model weights."""
    from rich.console import Console

    from gradian.audit import diagnosis_report, run_audit, write_diagnosis
    from gradian.config import config_to_dict, load_config

    if fail_on is not None and fail_on.lower() not in SEVERITIES:
        raise ConfigError(f"--fail-on {fail_on!r}: use one of {', '.join(SEVERITIES)}")
    if max_seq_length is not None and max_seq_length <= 0:
        raise ConfigError(f"--max-seq-length {max_seq_length}: must be a positive number of tokens")
    cfg = load_config(
        config,
        overrides={"dataset": dataset, "eval_dataset": eval_dataset, "run_dir": run, "base_model": base_model},
    )
    inputs = _load_inputs(cfg, max_seq_length)
    if all(inputs[k] is None for k in ("dataset", "run", "tokenizer", "eval_dataset")):
        raise ConfigError(
            "nothing to diagnose: pass --dataset, --run or --base-model (or set them in the config)"
        )
    result = run_audit(
        dataset=inputs["dataset"],
        tokenizer=inputs["tokenizer"],
        run=inputs["run"],
        eval_dataset=inputs["eval_dataset"],
        max_seq_length=max_seq_length,
        base_model=inputs["base_model_name"],
        config=cfg.audit,
    )
    console = Console()
    _print_result(console, result)
    if out is not None:
        report = diagnosis_report(result, inputs=inputs["manifest"], audit_config=config_to_dict(cfg).get("audit"))
        json_path, md_path = write_diagnosis(report, out)
        console.print(f"wrote {json_path} and {md_path}", highlight=False)
    if fail_on is not None and result.at_least(fail_on.lower()):
        n = len(result.at_least(fail_on.lower()))
        console.print(f"[bold red]{n} finding(s) at or above {fail_on.lower()}: failing (--fail-on).[/]")
        raise typer.Exit(code=1)


def _load_inputs(cfg: Any, max_seq_length: int | None) -> dict[str, Any]:
    from gradian.data import load_dataset
    from gradian.runs import read_run_dir

    run = read_run_dir(cfg.run_dir) if cfg.run_dir else None
    dataset_path = cfg.dataset
    if dataset_path is None and run is not None and run.dataset.path and Path(run.dataset.path).is_file():
        dataset_path = run.dataset.path  # the run recorded its training file and it is still here
    dataset = load_dataset(dataset_path) if dataset_path else None
    eval_dataset = load_dataset(cfg.eval_dataset) if cfg.eval_dataset else None

    tokenizer_name, flag = None, "--base-model"
    if cfg.tokenizer:
        tokenizer_name, flag = cfg.tokenizer, "tokenizer (config)"
    elif cfg.base_model:
        tokenizer_name = cfg.base_model
    elif run is not None and run.lora.base_model and Path(run.lora.base_model).is_dir():
        # The adapter names a base model present on this machine: its tokenizer is free to load.
        tokenizer_name, flag = run.lora.base_model, "adapter_config.json base_model_name_or_path"
    tokenizer = load_tokenizer(tokenizer_name, cfg.trust_remote_code, flag) if tokenizer_name else None
    manifest = {
        "dataset": {"path": dataset.path, "sha256": dataset.sha256, "n_examples": len(dataset)} if dataset else None,
        "eval_dataset": {"path": eval_dataset.path, "sha256": eval_dataset.sha256, "n_examples": len(eval_dataset)}
        if eval_dataset else None,
        "run": run.source if run else None,
        "base_model": cfg.base_model or None,
        "tokenizer": tokenizer_name,
        "max_seq_length": max_seq_length if max_seq_length is not None else (run.config.max_seq_length if run else None),
    }
    return {
        "dataset": dataset,
        "eval_dataset": eval_dataset,
        "run": run,
        "tokenizer": tokenizer,
        "base_model_name": cfg.base_model or None,
        "manifest": manifest,
    }


def _print_result(console: Any, result: Any) -> None:
    from rich.table import Table

    verdict = result.verdict()
    critical = result.at_least("critical")
    if critical:
        console.print(
            f"[bold red]{len(critical)} critical issue(s) invalidate or dominate this run: fix these first.[/]"
        )
    table = Table(title=f"Audit findings ({len(result.findings)} fired, {len(result.ran)} checks ran)")
    for col in ("severity", "check", "finding", "fix"):
        table.add_column(col, overflow="fold")
    for f in result.findings:
        style = _STYLE.get(f.severity, "")
        table.add_row(f"[{style}]{f.severity}[/]", f.id, f.title, f.fix)
    if result.findings:
        console.print(table)
    else:
        console.print("[green]No check fired.[/]")
    console.print(f"[bold]Verdict ({verdict['kind']}):[/] {verdict['summary']}", highlight=False)
    if result.skipped:
        skipped = Table(title=f"Skipped checks ({len(result.skipped)})")
        skipped.add_column("check")
        skipped.add_column("why", overflow="fold")
        for s in result.skipped:
            skipped.add_row(s.id, s.reason)
        console.print(skipped)


def checks_command() -> None:
    """List every registered diagnostic check: category, id and description."""
    from rich.console import Console
    from rich.table import Table

    from gradian.audit import all_checks

    checks = all_checks()
    table = Table(title=f"{len(checks)} diagnostic checks")
    for col in ("category", "id", "description", "needs"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.category, c.id, c.description, ", ".join(c.needs))
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("diagnose")(diagnose_command)
    app.command("checks")(checks_command)
