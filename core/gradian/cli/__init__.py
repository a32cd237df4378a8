"""The ``gradian`` command line.

``app`` is a typer application. Each command group lives in its own module under ``gradian.cli``
and exposes ``register(app)``; ``_COMMAND_MODULES`` lists them in help order. ``main`` is the
console-script entry and the one place exit codes are decided:

- 0 done; 1 a gate tripped (``diagnose --fail-on``, ``plan --fail-if-over``);
- 2 bad input: a ``GradianError`` (and click's usage errors), one line on stderr;
- 3 the environment: a ``GradianEnvironmentError`` (missing package, unwritable folder, tracking
  server that does not answer), one line on stderr;
- 70 (``EX_SOFTWARE``) an exception no stage meant to raise: one line naming its type, never a
  traceback unless ``--debug`` is given;
- 130 Ctrl-C, 143 SIGTERM: cleanups run first (an MLflow run Gradian opened is marked FAILED).

Every line printed for an error goes through ``gradian.redact``, so a password in a tracking URI
never reaches the terminal. ``--verbose`` (before the command) lets libraries' warnings and
download bars through; ``gradian.cli.output`` keeps them out otherwise. ``--debug`` re-raises any
error with its traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import typer

from gradian.errors import GradianError, environment_error

__all__ = ["app", "main", "INTERNAL_ERROR_EXIT_CODE"]

#: exit code of an exception no stage meant to raise (sysexits' EX_SOFTWARE); 1 is --fail-on's
INTERNAL_ERROR_EXIT_CODE = 70

#: set by ``--debug``: errors propagate with their traceback instead of one line
_debug = False

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
    debug: bool = typer.Option(False, "--debug",
                               help="Show the full traceback of any error instead of one line"),
) -> None:
    """Find the training examples, or the setting, that broke a LoRA fine-tune."""
    from gradian.cli.output import quiet_libraries

    global _debug
    _debug = debug
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


def _print_error(text: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    from gradian.redact import redact

    from gradian.cli.output import terminal_safe

    line = " ".join(part.strip() for part in redact(text).splitlines() if part.strip())  # one line
    Console(stderr=True).print(f"[bold red]error:[/] {escape(terminal_safe(line))}", highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: runs the command and turns any error into one line and an exit code."""
    from gradian.termination import Terminated, sigterm_raises

    global _debug
    _debug = False
    try:
        with sigterm_raises():
            app(args=argv, standalone_mode=True)
    except Terminated as err:
        if _debug:
            raise
        _print_error(str(err))
        sys.exit(err.exit_code)
    except GradianError as err:
        if _debug:
            raise
        _print_error(str(err))
        sys.exit(err.exit_code)
    except Exception as err:  # noqa: BLE001 -- the last line of defence against a traceback
        if _debug:
            raise
        known = environment_error(err)
        if known is not None:
            _print_error(str(known))
            sys.exit(known.exit_code)
        _print_error(f"internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)")
        sys.exit(INTERNAL_ERROR_EXIT_CODE)
