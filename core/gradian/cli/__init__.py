"""The ``gradian`` command line.

``app`` is a typer application. Each command group lives in its own module under ``gradian.cli``
and exposes ``register(app)``; ``_COMMAND_MODULES`` lists them in help order. ``main`` is the
console-script entry: it turns every ``GradianError`` into one line on stderr and exit code 2,
never a traceback. ``--verbose`` (before the command) lets libraries' warnings and download bars
through; ``gradian.cli.output`` keeps them out otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import typer

from gradian.errors import GradianError

__all__ = ["app", "main"]

app = typer.Typer(
    name="gradian",
    help="Find the training examples, or the setting, that broke a LoRA fine-tune.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _global_options(
    verbose: bool = typer.Option(False, "--verbose", "-v",
                                 help="Let libraries print their warnings, advisories and download bars"),
) -> None:
    """Find the training examples, or the setting, that broke a LoRA fine-tune."""
    from gradian.cli.output import quiet_libraries

    quiet_libraries(verbose)


#: command modules, each with ``register(app)``; a module not present yet is simply skipped
_COMMAND_MODULES = (
    "gradian.cli.basic",  # version, doctor, init-config
    "gradian.cli.diagnose",  # diagnose, checks
    "gradian.cli.train",  # train
    "gradian.cli.index",  # index, show-index
    "gradian.cli.plan",  # plan
    "gradian.cli.attribute",  # attribute
    "gradian.cli.explain",  # explain
    "gradian.cli.tinyworld",  # tinyworld build|scenario
    "gradian.cli.counterfactual",
)


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).register(app)


_register_all()


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    from rich.console import Console

    try:
        app(args=argv, standalone_mode=True)
    except GradianError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(err.exit_code)
