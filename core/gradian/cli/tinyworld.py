"""``gradian tinyworld build`` and ``gradian tinyworld scenario``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

__all__ = ["register"]

tinyworld_app = typer.Typer(
    help="Build the offline tinyworld base model and write scenarios that break it.",
    no_args_is_help=True,
)


@tinyworld_app.command("build")
def build_command(
    out: Optional[Path] = typer.Option(
        None, "--out", "-o",
        help="Cache directory to build into (default: $GRADIAN_TINYWORLD_CACHE or ~/.cache/gradian/tinyworld)",
    ),
    seed: int = typer.Option(0, "--seed", help="World and training seed"),
    world: str = typer.Option("tinyworld", "--world", "-w",
                              help="Which world's base model: `gradian tinyworld worlds` lists them"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the model path"),
) -> None:
    """Build a world's base model (one to two minutes on two CPU cores), or reuse the cached one."""
    import json

    from gradian.tinyworld.worlds import get_world

    spec = get_world(world)
    path = spec.ensure_base_model(out, spec.recipe_type(seed=seed), verbose=not quiet)
    if quiet:
        typer.echo(str(path))
        return
    info = json.loads((path / "tinyworld.json").read_text())
    accuracy = ", ".join(f"{k} {v:.0%}" for k, v in info["accuracy"].items())
    typer.echo(f"base model: {path} ({spec.name}, {spec.architecture})")
    typer.echo(f"accuracy:   {accuracy}")
    typer.echo(f"built in {info['build_seconds']:.0f}s; weights sha256 {info['weights_sha256'][:16]}")


@tinyworld_app.command("worlds")
def worlds_command() -> None:
    """List the offline worlds, their architectures and scenarios."""
    from gradian.tinyworld.worlds import WORLDS

    for spec in WORLDS.values():
        typer.echo(f"{spec.name:<10} {spec.description}")
        typer.echo(f"{'':<10} scenarios: {', '.join(spec.scenarios)}")


@tinyworld_app.command("scenario")
def scenario_command(
    name: str = typer.Argument(..., help="Scenario name; `gradian tinyworld scenario list` shows them"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Directory for train.jsonl, eval.jsonl, gradian.yaml, scenario.json"),
    base_model: Optional[Path] = typer.Option(
        None, "--base-model", "-m",
        help="A built base model of the scenario's world (default: the cached one, built if missing)"
    ),
    shape: str = typer.Option("messages", "--shape", help="Row shape: messages, prompt_completion, question_answer, input_output or instruction"),
) -> None:
    """Write a scenario's data, eval set, run config and ground truth."""
    from gradian.errors import ConfigError
    from gradian.tinyworld import all_scenarios, write_scenario

    if name == "list":
        scenarios = all_scenarios()
        width = max(len(n) for n in scenarios)
        for key, text in scenarios.items():
            typer.echo(f"{key:<{width}}  {text}")
        return
    if out is None:
        raise ConfigError("gradian tinyworld scenario: pass --out DIR for the scenario's files")
    info = write_scenario(name, out, base_model, shape=shape)
    planted = info["planted"]
    typer.echo(f"wrote scenario '{name}' to {out} ({info['n_train']} training rows"
               + (f", {planted['n']} planted in cluster {planted['cluster']}" if planted else "")
               + (f", defect {info['defect']}" if info["defect"] else "") + ")")
    typer.echo(f"next: gradian train --config {Path(out) / 'gradian.yaml'} --out {Path(out) / 'run'}")


def register(app: typer.Typer) -> None:
    app.add_typer(tinyworld_app, name="tinyworld")
