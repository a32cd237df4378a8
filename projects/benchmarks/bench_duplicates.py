"""Benchmark: `gradian diagnose`'s data checks on distinct rows vs rows that are mostly copies.

The duplicate checks group rows by hash (exact copies) and by MinHash LSH buckets (near copies);
a dataset that is mostly copies fills a few buckets with thousands of rows, which is where a
pairwise loop would blow up. This writes two synthetic prompt/completion datasets of the same
size and row lengths, one of distinct rows and one where 90% of the rows copy (word for word, or
with one word changed) one of a few hundred templates, and times `gradian diagnose -d` on each
in-process (dataset-only data checks: no tokenizer, no run), then each duplicate-related check
alone. Prints both times and their ratio. Target: the mostly-duplicated set within 2x of the
distinct one.

    python projects/benchmarks/bench_duplicates.py [--rows 200000] [--quick] [--out figures.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

_WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "zu", "ve")
          for b in ("ran", "tel", "mos", "dil", "vek", "nor", "pha", "gli", "sto", "wum")]
_CHECKS = ("data.duplicates", "data.near_duplicates", "data.conflicting_answers")


def _fresh_row(rng: random.Random) -> dict[str, str]:
    return {"prompt": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 30))) + "?",
            "completion": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + "."}


def write_rows(path: Path, n: int, duplicated: bool, seed: int = 0) -> None:
    """``n`` rows; with ``duplicated``, 90% are copies of 300 templates (half exact, half with
    one prompt word replaced), the rest distinct."""
    rng = random.Random(seed)
    templates = [_fresh_row(rng) for _ in range(300)]
    with path.open("w", encoding="utf-8") as out:
        for _ in range(n):
            if duplicated and rng.random() < 0.9:
                row = dict(rng.choice(templates))
                if rng.random() < 0.5:
                    words = row["prompt"].split()
                    words[rng.randrange(len(words))] = rng.choice(_WORDS)
                    row["prompt"] = " ".join(words)
            else:
                row = _fresh_row(rng)
            out.write(json.dumps(row) + "\n")


def time_diagnose(dataset: Path, out: Path) -> float:
    from gradian.cli import app

    start = time.perf_counter()
    try:
        app(["diagnose", "-d", str(dataset), "-o", str(out)], standalone_mode=False)
    except SystemExit:
        pass
    return time.perf_counter() - start


def time_checks(dataset: Path) -> dict[str, float]:
    from gradian.audit import run_audit
    from gradian.data import load_dataset

    loaded = load_dataset(dataset)
    timings = {}
    for check in _CHECKS:
        start = time.perf_counter()
        run_audit(dataset=loaded, checks=[check])
        timings[check] = time.perf_counter() - start
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="20,000 rows instead of --rows")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    rows = 20_000 if args.quick else args.rows

    figures: dict[str, float] = {"rows": rows}
    with tempfile.TemporaryDirectory(prefix="gradian-bench-dup-") as tmp:
        root = Path(tmp)
        for kind in ("unique", "duplicated"):
            path = root / f"{kind}.jsonl"
            write_rows(path, rows, duplicated=kind == "duplicated")
            figures[f"{kind}_diagnose_s"] = round(time_diagnose(path, root / f"out-{kind}"), 3)
            for check, seconds in time_checks(path).items():
                figures[f"{kind}.{check}_s"] = round(seconds, 3)
    figures["ratio"] = round(figures["duplicated_diagnose_s"] / figures["unique_diagnose_s"], 3)

    print(f"rows: {rows}")
    print(f"diagnose on distinct rows: {figures['unique_diagnose_s']:.2f} s")
    print(f"diagnose on mostly-duplicated rows: {figures['duplicated_diagnose_s']:.2f} s")
    for check in _CHECKS:
        print(f"  {check:28s} distinct {figures[f'unique.{check}_s']:.2f} s, "
              f"duplicated {figures[f'duplicated.{check}_s']:.2f} s")
    print(f"ratio duplicated / distinct: {figures['ratio']:.2f} (target: 2 or less)")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
