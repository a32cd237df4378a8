"""``gradian explain``: the harmful span of one training example, from an attribution's report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["register", "print_explanation"]


def explain_command(
    example_id: str = typer.Option(..., "--example-id", help="The training example to explain (an example_id of rankings.parquet)"),
    report: Path = typer.Option(..., "--report", help="The folder `gradian attribute --out` wrote (or its report.json)"),
    item: Optional[str] = typer.Option(None, "--item", help="The eval item to build the query from (default: the item the row hurts most)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config to use instead of the one the report recorded"),
    engine: Optional[str] = typer.Option(None, "--engine", help="Score the tokens against the query gradient (graddot, the default) or an engine's own preconditioned query on its fitted state (datainf, ekfac, kfac)"),
    words: int = typer.Option(8, "--words", help="How many of the most harmful words to list"),
    as_json: bool = typer.Option(False, "--json", help="Print the explanation as JSON"),
) -> None:
    """Score every supervised token of one training example against one query item and show the harmful span."""
    import json

    from rich.console import Console

    from gradian.cli.output import shown
    from gradian.errors import ConfigError
    from gradian.explain import DIRECT_ENGINES, explain_from_report

    if engine is not None and engine not in DIRECT_ENGINES:
        raise ConfigError(f"--engine {engine!r}: spans can be scored with {' or '.join(DIRECT_ENGINES)}")
    console = Console(stderr=True)
    explanation = explain_from_report(report, example_id, item, config, engine=engine,
                                      log=lambda message: console.print(f"[dim]{shown(message)}[/]", highlight=False))
    if as_json:
        print(json.dumps(explanation.to_dict(), indent=2))
        return
    print_explanation(Console(), explanation.to_dict(), words)


def print_explanation(console: Console, data: dict, n_words: int = 8) -> None:
    """The text with the harmful span in bold red, then the sentences and the most harmful words."""
    from rich.panel import Panel
    from rich.text import Text

    from gradian.cli.output import shown, terminal_safe

    text = Text(terminal_safe(data["text"], keep_offsets=True))  # the span offsets stay valid
    if data.get("span_start") is not None:
        text.stylize("bold red", data["span_start"], data["span_end"])
    score = data.get("score")
    head = (f"example {shown(data['example_id'])} against item {shown(data['item_id'])} ({data['engine']}, {data['signal']} query); "
            f"token contributions sum to {data['token_sum']:.4g}"
            + (f", the example's score is {score:.4g}" if isinstance(score, (int, float)) else ""))
    console.print(head, highlight=False)
    console.print(Panel(text, title="harmful span in red", expand=False))
    if data.get("span_text"):
        console.print(f"Harmful span: \"{shown(data['span_text'])}\" ({data['span_score']:.4g})", highlight=False)
    else:
        console.print("No sentence of this example is harmful to the query.", highlight=False)
    for s in data.get("sentences") or []:
        console.print(f"  {s['score']:+.4g}  {shown(s['text'])}", highlight=False)
    worst = sorted(data.get("words") or [], key=lambda w: w["score"])[:n_words]
    if worst:
        console.print("Most harmful words: " + ", ".join(f"{shown(w['text'])} ({w['score']:+.3g})" for w in worst), highlight=False)
    for note in data.get("notes") or []:
        console.print(f"[yellow]{shown(note)}[/]", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("explain")(explain_command)
