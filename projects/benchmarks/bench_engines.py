"""Wall time of each engine's fit + score against the gradient index it reads, in one process.

On tinyworld's ``poison_capitals`` fine-tune (trained once and kept in ``--work``, shared with
``bench_attribution_quality.py``), with the model loaded once:

- ``index``: building the gradient index from scratch (``force``), the stage every engine needs;
- ``index+factors``: the same build with the Kronecker factors gathered on the way (what
  ``gradian attribute`` does when ``ekfac`` or ``kfac`` will score);
- for each engine: ``fit`` (no cached state; ``ekfac``/``kfac`` given the gathered factors) and
  ``score`` (the target query of the scenario's eval items, one column per item).

Each stage is timed ``--repeats`` times and the median is reported, with the ratios that matter
measured inside the same run: each engine's ``index + fit + score`` over DataInf's (the Kronecker
engines counted with ``index+factors``), and its ``fit + score`` over the index build. Timing on a shared machine is noisy; ratios from one run are
the figures to compare.

Run: ``python projects/benchmarks/bench_engines.py [--work DIR] [--repeats 3] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINES = ("datainf", "graddot", "kfac", "ekfac")


def _index_stage(engine: str) -> str:
    return "index+factors" if engine in ("ekfac", "kfac") else "index"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "gradian" / "bench" / "attribution_quality"))
    parser.add_argument("--scenario", default="poison_capitals")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import dataclasses

    import torch

    from bench_attribution_quality import prepare_run
    from gradian.config import load_config
    from gradian.data import load_dataset, tokenize_examples
    from gradian.attribution.checkpoints import fit_context
    from gradian.engines import fit_engine, get_engine
    from gradian.grads.collectors import KroneckerCollector
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.model_loading import load_tokenizer
    from gradian.query import QueryItem, build_query_gradient

    torch.set_num_threads(1)
    config_path, info, _ = prepare_run(Path(args.work).resolve(), 212, args.scenario)
    root = config_path.parent
    cfg = load_config(config_path, {"device": "cpu", "adapter_path": str(root / "run" / "adapter")})
    dataset = load_dataset(cfg.dataset)
    evals = load_dataset(cfg.eval_dataset)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code)
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    items = [QueryItem(e.prompt_messages, e.completion, None, True, e.id) for e in evals.examples]
    query = build_query_gradient(gm, tokenizer, items, "target", cfg.grads).per_item
    tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)

    times: dict[str, list[float]] = {"index": [], "index+factors": []}
    for engine in ENGINES:
        times[f"{engine}.fit"], times[f"{engine}.score"] = [], []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            run_cfg = dataclasses.replace(cfg, cache_dir=cache)
            started = time.perf_counter()
            index = GradientIndex.build(gm, tokenizer, dataset, run_cfg, force=True)
            times["index"].append(time.perf_counter() - started)
            started = time.perf_counter()
            with KroneckerCollector(gm) as collector:
                index = GradientIndex.build(gm, tokenizer, dataset, run_cfg, force=True)
            times["index+factors"].append(time.perf_counter() - started)
            for engine in ENGINES:
                engine_cfg = dataclasses.replace(cfg.engine, name=engine)
                context = fit_context(run_cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=collector)
                started = time.perf_counter()
                state = fit_engine(engine, index, engine_cfg, context)  # no cache_dir: always fitted
                times[f"{engine}.fit"].append(time.perf_counter() - started)
                started = time.perf_counter()
                get_engine(engine).score(state, query, engine_cfg)
                times[f"{engine}.score"].append(time.perf_counter() - started)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)

    median = {k: statistics.median(v) for k, v in times.items()}
    base = median["index"] + median["datainf.fit"] + median["datainf.score"]
    summary: dict[str, Any] = {
        "scenario": args.scenario, "n_train": len(dataset), "n_query_items": len(items), "repeats": args.repeats,
        "median_seconds": {k: round(v, 3) for k, v in median.items()},
        "all_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "ratio_to_datainf_total": {e: round((median[_index_stage(e)] + median[f"{e}.fit"] + median[f"{e}.score"]) / base, 3)
                                   for e in ENGINES},
        "fit_plus_score_over_index": {e: round((median[f"{e}.fit"] + median[f"{e}.score"]) / median["index"], 3)
                                      for e in ENGINES},
    }
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
