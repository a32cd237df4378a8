"""The sampled Fisher of EK-FAC against the empirical one: what a fit costs, and how well each ranks.

Two measurements, on the offline poison scenarios (each fine-tuned here with the scenario's own
recipe and the seed given, and kept in ``--work`` so a second run only scores):

- ``speed``: on one fine-tune, with the model loaded once and the same rows, the wall time of one
  plain capture pass (the per-example gradients of every row, what an index build computes), the
  empirical EK-FAC fit as ``gradian attribute`` makes it (factors gathered during the index build,
  eigenvalues corrected from the stored gradients), the empirical fit making its own passes, and
  the sampled fit with one label draw (its own two passes: factors, then the correction). Each is
  timed ``--repeats`` times; medians, ranges and the ratios to the capture pass are printed.
- ``auc``: for every scenario, seed and query of ``--queries`` (target and contrastive),
  ``gradian attribute`` once with ``engine.fisher: empirical`` and once with ``sampled`` (one
  draw, ``fisher_seed`` 0), no cross check; the ROC AUC of the planted rows against the clean
  ones, harm = -rank score (the score the report ranks by, RelatIF-normalized by default).

Run::

    python projects/benchmarks/bench_fisher.py speed [--scenario poison_capitals] [--repeats 5]
    python projects/benchmarks/bench_fisher.py auc [--scenarios poison_capitals,bestiary_poison_diets] [--seeds 0,1,2] [--queries target,contrastive]

Both print JSON (``--out`` writes it too). Timings on a shared machine are noisy: compare the
ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("poison_capitals", "bestiary_poison_diets")
FISHERS = ("empirical", "sampled")


def prepare(work: Path, scenario: str, seed: int) -> tuple[Path, dict[str, Any]]:
    """The scenario written and fine-tuned with ``seed`` under ``work`` (reused when done)."""
    from gradian.config import load_config
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    root = work / scenario / f"seed{seed}"
    config_path = root / "gradian.yaml"
    if (root / "run" / "gradian_run.json").is_file() and (root / "scenario.json").is_file():
        return config_path, json.loads((root / "scenario.json").read_text())
    info = write_scenario(scenario, root)
    started = time.perf_counter()
    train_lora(load_config(config_path, _overrides(root, seed)), root / "run", overwrite=True)
    print(f"{scenario} seed {seed}: fine-tuned in {time.perf_counter() - started:.0f} s", flush=True)
    return config_path, info


def _overrides(root: Path, seed: int) -> dict[str, Any]:
    return {"seed": seed, "device": "cpu", "cache_dir": str(root / ".gradian")}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "all": [round(v, 4) for v in values]}


def speed(work: Path, scenario: str, seed: int, repeats: int) -> dict[str, Any]:
    import dataclasses
    import tempfile

    from gradian.attribution.checkpoints import fit_context
    from gradian.config import load_config
    from gradian.data import load_dataset, tokenize_examples
    from gradian.engines import fit_engine
    from gradian.grads import capture_per_example_grads, collate, load_model_for_gradients
    from gradian.grads.collectors import KroneckerCollector
    from gradian.index import GradientIndex
    from gradian.model_loading import load_tokenizer

    config_path, info = prepare(work, scenario, seed)
    cfg = load_config(config_path, _overrides(config_path.parent, seed))
    dataset = load_dataset(cfg.dataset)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code)
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    size = int(cfg.grads.batch_size)

    def capture() -> None:
        for offset in range(0, len(tokenized), size):
            capture_per_example_grads(gm, collate(tokenized[offset: offset + size], pad, gm.device),
                                      cfg.grads.strategy, cfg.grads.loss_reduction)

    times: dict[str, list[float]] = {"capture": [], "empirical_fit": [], "empirical_fit_own_passes": [],
                                     "sampled_fit_1_draw": []}
    with tempfile.TemporaryDirectory() as cache:
        run_cfg = dataclasses.replace(cfg, cache_dir=cache)
        with KroneckerCollector(gm) as collector:
            index = GradientIndex.build(gm, tokenizer, dataset, run_cfg, force=True)
        gathered = fit_context(run_cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=collector)
        own = fit_context(run_cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=None)
        empirical = dataclasses.replace(cfg.engine, name="ekfac", fisher="empirical")
        sampled = dataclasses.replace(cfg.engine, name="ekfac", fisher="sampled", fisher_samples=1)
        for repeat in range(repeats):
            for name, run in (("capture", capture),
                              ("empirical_fit", lambda: fit_engine("ekfac", index, empirical, gathered)),
                              ("empirical_fit_own_passes", lambda: fit_engine("ekfac", index, empirical, own)),
                              ("sampled_fit_1_draw", lambda: fit_engine("ekfac", index, sampled, own))):
                started = time.perf_counter()
                run()  # no cache_dir: always fitted
                times[name].append(time.perf_counter() - started)
            print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    ratios = {k: [v / c for v, c in zip(times[k], times["capture"])] for k in times if k != "capture"}
    return {"scenario": scenario, "seed": seed, "n_train": len(tokenized), "batch_size": size,
            "repeats": repeats, "seconds": {k: _spread(v) for k, v in times.items()},
            "over_capture_pass": {k: {"of_medians": round(median[k] / median["capture"], 3),
                                      "per_repeat": _spread(v)} for k, v in ratios.items()}}


def auc(work: Path, scenarios: list[str], seeds: list[int], queries: list[str]) -> dict[str, Any]:
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values, run_attribution
    from gradian.config import load_config

    rows: list[dict[str, Any]] = []
    for scenario in scenarios:
        for seed in seeds:
            config_path, info = prepare(work, scenario, seed)
            planted = set(info["planted"]["indices"])
            capability = (info.get("capability") or {}).get("name", "capitals")
            for query in queries:
                row: dict[str, Any] = {"scenario": scenario, "seed": seed, "query": query}
                for fisher in FISHERS:
                    cfg = load_config(config_path, {**_overrides(config_path.parent, seed), "engine.name": "ekfac",
                                                    "engine.fisher": fisher, "engine.fisher_samples": 1,
                                                    "evaluation.query_signal": query})
                    started = time.perf_counter()
                    outcome = run_attribution(cfg, capability=capability, cross_check=None)
                    if outcome.rankings is None:
                        raise SystemExit(f"{scenario} seed {seed}: attribution did not run ({fisher}, {query})")
                    harm = -rank_values(outcome.rankings)
                    is_planted = outcome.rankings["row_index"].isin(planted).to_numpy()
                    row[fisher] = round(float(roc_auc_score(is_planted, harm)), 4)
                    row[f"{fisher}_seconds"] = round(time.perf_counter() - started, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"rows": rows, "median": {}}
    for scenario in scenarios:
        for query in queries:
            mine = [r for r in rows if r["scenario"] == scenario and r["query"] == query]
            summary["median"][f"{scenario} {query}"] = {
                **{f: statistics.median(r[f] for r in mine) for f in FISHERS},
                **{f"{f}_range": [min(r[f] for r in mine), max(r[f] for r in mine)] for f in FISHERS},
                "sampled_wins_every_seed": all(r["sampled"] > r["empirical"] for r in mine)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("prepare", "speed", "auc"), help="prepare: only the fine-tunes")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "gradian" / "bench" / "fisher"),
                        help="keeps the fine-tunes and their indexes between runs")
    parser.add_argument("--scenario", default="poison_capitals", help="speed: the scenario timed")
    parser.add_argument("--seed", type=int, default=0, help="speed: the fine-tune's seed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="auc: comma-separated poison scenarios")
    parser.add_argument("--seeds", default="0,1,2", help="auc: comma-separated fine-tune seeds")
    parser.add_argument("--queries", default="target,contrastive", help="auc: comma-separated query signals")
    parser.add_argument("--out", default=None, help="write the JSON here as well as printing it")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    if args.what == "prepare":
        for scenario in (s for s in args.scenarios.split(",") if s):
            for seed in (int(s) for s in args.seeds.split(",") if s):
                prepare(work, scenario, seed)
        return
    if args.what == "speed":
        summary = speed(work, args.scenario, args.seed, args.repeats)
    else:
        summary = auc(work, [s for s in args.scenarios.split(",") if s], [int(s) for s in args.seeds.split(",") if s],
                      [q for q in args.queries.split(",") if q])
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
