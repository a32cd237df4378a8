"""How commands print: rich tables on a terminal, plain lines when piped, JSON on request.

Not a command module (it has no ``register``). Rich lays a table out for 80 columns when stdout is
not a terminal, so ``gradian checks | grep config.`` would see ids cut to ``config.attention_onl…``.
When stdout is not a terminal a table is printed as one row per line, cells separated by a tab,
never truncated or wrapped; ``--json`` prints the same data as JSON.

``quiet_libraries`` keeps library chatter (FutureWarnings, per-file download bars, transformers'
advisory logging) out of the output unless ``--verbose`` is given.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, Iterable, Sequence

import typer

from gradian.redact import terminal_safe

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["stdout_is_terminal", "print_table", "print_json", "print_line", "quiet_libraries", "terminal_safe",
           "shown"]

def shown(text: object) -> str:
    """A user's string made safe for the terminal and for rich markup (``[bold]`` stays literal)."""
    from rich.markup import escape

    return escape(terminal_safe(text))


def stdout_is_terminal() -> bool:
    """Whether stdout is an interactive terminal (rich tables) or a pipe or file (plain lines)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


def _cell(value: object) -> str:
    text = "" if value is None else terminal_safe(value)
    return " ".join(text.split()) if any(c in text for c in "\t\n\r") else text


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    styles: Sequence[str] | None = None,
    title_on_stderr: bool = False,
    console: Console | None = None,
) -> None:
    """A rich table on a terminal; otherwise ``title`` on its own line, then one tab-separated line per row.

    ``styles`` (one rich style per row, e.g. a severity colour) is used on a terminal only.
    ``title_on_stderr`` keeps stdout to the rows alone when piped, for listings a script reads.
    """
    rows = [list(r) for r in rows]
    if not stdout_is_terminal():
        if title:
            typer.echo(title, err=title_on_stderr)
        for row in rows:
            typer.echo("\t".join(_cell(v) for v in row))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for i, row in enumerate(rows):
        table.add_row(*(escape(_cell(v)) for v in row), style=(styles[i] if styles else None) or None)
    (console or Console()).print(table)


def print_line(text: str, style: str | None = None, *, err: bool = False) -> None:
    """One line of prose; styled on a terminal, plain when piped."""
    text = terminal_safe(text)
    if not stdout_is_terminal() or err:
        typer.echo(text, err=err)
        return
    from rich.console import Console

    Console().print(text, style=style, highlight=False, markup=False, soft_wrap=True)


def print_json(data: object) -> None:
    """``data`` as indented JSON on stdout (non-JSON values such as paths as strings)."""
    typer.echo(json.dumps(data, indent=2, default=str))


def quiet_libraries(verbose: bool = False) -> None:
    """Keep FutureWarnings, deprecation notices and download bars out of the output.

    Environment variables the user set win; with ``verbose`` nothing is changed.
    """
    if verbose:
        return
    for name, value in (
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),  # the per-file bars of a snapshot download
        ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
    ):
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # bitsandbytes (imported by peft whenever it is installed) warns on CPUs with bfloat16 AVX-512
    # that it cannot fetch an optional kernel from a hub; the fallback it then uses is exact
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # libraries already imported read their settings at import time; tell them directly
    if "huggingface_hub" in sys.modules:
        try:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except ImportError:
            pass
    if "transformers" in sys.modules:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        except ImportError:
            pass
