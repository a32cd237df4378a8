"""``gradian train``: the optional LoRA fine-tune path."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["register"]


def train_command(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config file (its train: section)"),
    backend: Optional[str] = typer.Option(
        None, "--backend", "-b", help="hf, trl or unsloth (default: train.backend, which defaults to hf)"
    ),
    dataset: Optional[Path] = typer.Option(None, "--dataset", "-d", help="Training data, overriding the config"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Run directory (default: train.output_dir)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run already in --out"),
) -> None:
    """Fine-tune a LoRA adapter; writes adapter/, trainer_state.json, training_args.json and gradian_run.json."""
    from gradian.config import load_config
    from gradian.paths import ensure_writable_dir
    from gradian.train import require_backend, train_lora

    if backend is not None:
        require_backend(backend)  # fail before reading anything else
    cfg = load_config(config)
    require_backend(backend or cfg.train.backend)
    # before the model loads: a run folder that cannot be written would fail after the training
    ensure_writable_dir(out if out is not None else cfg.train.output_dir, "--out" if out is not None else "train.output_dir")
    record = train_lora(cfg, out, dataset, backend=backend, overwrite=overwrite, progress=True)
    losses = record.logs.series("loss")
    run_dir = record.source
    typer.echo(f"trained {record.config.extra.get('n_trained_examples')} examples, "
               f"{record.logs.steps[-1].step if record.logs.steps else 0} steps"
               + (f", loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}" if losses else ""))
    typer.echo(f"run:     {run_dir}")
    typer.echo(f"adapter: {record.adapter_dir}")


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
