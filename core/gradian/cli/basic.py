"""``gradian version``, ``gradian doctor`` and ``gradian init-config``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from gradian.errors import ConfigError

__all__ = ["register"]


def version_command() -> None:
    """Print the installed version."""
    from gradian import __version__

    typer.echo(f"gradian {__version__}")


def doctor_command() -> None:
    """Check the environment: packages against the supported window, devices, determinism, extras."""
    from gradian.doctor import collect_report

    report = collect_report()
    console = Console()
    table = Table(title="Packages", show_lines=False)
    for col in ("package", "installed", "supported", "status"):
        table.add_column(col)
    for row in report.packages:
        style = {"ok": "green", "outside window": "yellow", "missing": "red"}.get(row.status, "")
        table.add_row(row.name, row.installed or "-", row.window, f"[{style}]{row.status}[/]")
    console.print(table)

    extras = Table(title="Optional features")
    for col in ("feature", "available", "why"):
        extras.add_column(col)
    for row in report.features:
        extras.add_row(row.name, "[green]yes[/]" if row.available else "[yellow]no[/]", row.reason)
    console.print(extras)

    console.print(f"[bold]Devices:[/] {', '.join(report.devices)}")
    for line in report.determinism:
        console.print(f"[bold]Determinism:[/] {line}")
    if report.problems:
        console.print(f"[yellow]{len(report.problems)} warning(s):[/]")
        for problem in report.problems:
            console.print(f"  - {problem}")
    else:
        console.print("[green]Everything required is installed and inside the supported window.[/]")


def init_config_command(
    out: Path = typer.Option(Path("gradian.yaml"), "--out", "-o", help="Where to write the config"),
    base_model: str = typer.Option("", "--base-model", "-m", help="Pre-fill the base model id or path"),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file"),
) -> None:
    """Write a commented starter gradian.yaml with every field at its default."""
    from gradian.atomic import write_text_atomic
    from gradian.config import render_starter_config

    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to overwrite it or --out to pick another path")
    write_text_atomic(out, render_starter_config(base_model=base_model))
    typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("version")(version_command)
    app.command("doctor")(doctor_command)
    app.command("init-config")(init_config_command)
