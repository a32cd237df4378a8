"""Benchmark: one conversation of 5,000 assistant turns vs the same turns spread over 2,500 rows.

Self-contained: builds the small chat tokenizer of chat_tokenizer.py (Llama-3-like template), then
times the data layer's tokenization (``tokenize_examples``: rendering, loss masks, counts) of one
row of 10,000 turns (5,000 user/assistant exchanges) and of 2,500 rows of two exchanges each, the
same turns; and, unless --no-diagnose, the whole ``gradian diagnose`` command in-process on each as
a .jsonl file. Prints each median of 3 and the ratio long/spread. Target: the ratio under 10
(rendering every turn's prefix made it quadratic: ~430x for tokenizing, 334 s, at 5,000 turns).

    python projects/benchmarks/bench_turns.py [--turns 5000] [--repeats 3] [--quick] [--no-diagnose] [--out f.json]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent


def load_chat_tokenizer() -> Any:
    spec = importlib.util.spec_from_file_location("gradian_benchmarks_chat_tokenizer", HERE / "chat_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_chat_tokenizer(True)


def exchange(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"what is the capital of france {i} ?"},
            {"role": "assistant", "content": f"the answer is paris {i} ."}]


def long_and_spread(turns: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row of ``turns`` exchanges, the same exchanges two to a row)."""
    long = [{"messages": [t for i in range(turns) for t in exchange(i)]}]
    spread = [{"messages": exchange(k) + exchange(k + 1)} for k in range(0, turns - 1, 2)]
    return long, spread


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_tokenize(rows: list[dict[str, Any]], tokenizer: Any, repeats: int) -> float:
    from gradian.data import dataset_from_rows, tokenize_examples

    examples = dataset_from_rows(rows).examples
    return median_seconds(lambda: tokenize_examples(examples, tokenizer, None), repeats)


def time_diagnose(rows: list[dict[str, Any]], tokenizer_dir: Path, root: Path, repeats: int) -> float:
    from gradian.cli import app

    data = root / f"rows{len(rows)}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run() -> None:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                app(["diagnose", "-d", str(data), "-m", str(tokenizer_dir), "-o", str(root / "out")],
                    standalone_mode=False)
            except SystemExit:
                pass

    return median_seconds(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5000, help="assistant turns in the long row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1,000 assistant turns")
    parser.add_argument("--no-diagnose", action="store_true", help="time the tokenization only")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    turns = 1000 if args.quick else args.turns

    tokenizer = load_chat_tokenizer()
    long, spread = long_and_spread(turns)
    figures: dict[str, float] = {"assistant_turns": turns}
    figures["tokenize_long_s"] = time_tokenize(long, tokenizer, args.repeats)
    figures["tokenize_spread_s"] = time_tokenize(spread, tokenizer, args.repeats)
    figures["tokenize_ratio"] = figures["tokenize_long_s"] / figures["tokenize_spread_s"]
    if not args.no_diagnose:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            tokenizer.save_pretrained(root / "tok")
            time_diagnose(spread[:10], root / "tok", root, 1)  # imports and first-use costs, untimed
            figures["diagnose_long_s"] = time_diagnose(long, root / "tok", root, args.repeats)
            figures["diagnose_spread_s"] = time_diagnose(spread, root / "tok", root, args.repeats)
        figures["diagnose_ratio"] = figures["diagnose_long_s"] / figures["diagnose_spread_s"]

    print(f"assistant turns: {turns} (one row) vs {len(spread)} rows of 2 (median of {args.repeats})")
    print(f"tokenize one row: {figures['tokenize_long_s']:.3f} s")
    print(f"tokenize spread rows: {figures['tokenize_spread_s']:.3f} s")
    print(f"tokenize ratio: {figures['tokenize_ratio']:.2f}")
    if "diagnose_ratio" in figures:
        print(f"diagnose one row: {figures['diagnose_long_s']:.3f} s")
        print(f"diagnose spread rows: {figures['diagnose_spread_s']:.3f} s")
        print(f"diagnose ratio: {figures['diagnose_ratio']:.2f}")
    worst = max(figures["tokenize_ratio"], figures.get("diagnose_ratio", 0.0))
    print(f"target: ratio under 10 -> {'met' if worst < 10 else 'MISSED'}")
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
