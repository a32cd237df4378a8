"""``gradian version``, ``gradian doctor`` and ``gradian init-config``."""

from __future__ import annotations

from pathlib import Path

import typer

from gradian.errors import ConfigError

__all__ = ["register"]


def version_command() -> None:
    """Print the installed version."""
    from gradian import __version__

    typer.echo(f"gradian {__version__}")


def doctor_command(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (packages, features, devices, determinism, problems)"),
) -> None:
    """Check the environment: packages against the supported window, devices, determinism, extras."""
    import dataclasses

    from gradian.cli.output import print_json, print_line, print_table
    from gradian.doctor import collect_report

    report = collect_report()
    if as_json:
        print_json(dataclasses.asdict(report))
        return
    status_style = {"ok": "green", "outside window": "yellow", "missing": "red"}
    print_table("Packages", ("package", "installed", "supported", "status"),
                [(row.name, row.installed or "-", row.window, row.status) for row in report.packages],
                styles=[status_style.get(row.status, "") for row in report.packages])
    print_table("Optional features", ("feature", "available", "why"),
                [(row.name, "yes" if row.available else "no", row.reason) for row in report.features],
                styles=["" if row.available else "yellow" for row in report.features])
    print_line(f"Devices: {', '.join(report.devices)}")
    for line in report.determinism:
        print_line(f"Determinism: {line}")
    if report.problems:
        print_line(f"{len(report.problems)} warning(s):", "yellow")
        for problem in report.problems:
            print_line(f"  - {problem}")
    else:
        print_line("Everything required is installed and inside the supported window.", "green")


def init_config_command(
    out: Path = typer.Option(Path("gradian.yaml"), "--out", "-o", help="Where to write the config"),
    base_model: str = typer.Option("", "--base-model", "-m", help="Pre-fill the base model id or path"),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file"),
) -> None:
    """Write a commented starter gradian.yaml with every field at its default."""
    from gradian.atomic import write_text_atomic
    from gradian.config import render_starter_config

    from gradian.paths import ensure_writable_dir

    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; pass a file path such as {out / 'gradian.yaml'}")
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to overwrite it or --out to pick another path")
    ensure_writable_dir(out.parent, "--out")  # a read-only folder is named, not its temporary file
    write_text_atomic(out, render_starter_config(base_model=base_model))
    typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("version")(version_command)
    app.command("doctor")(doctor_command)
    app.command("init-config")(init_config_command)
