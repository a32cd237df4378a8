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
  ``gradian attribute`` once per curvature setting, no cross check: by default
  ``engine.fisher: empirical`` and ``sampled`` (one draw, ``fisher_seed`` 0) at the default
  damping; ``--fishers``, ``--samples`` (label draws of the sampled Fisher) and
  ``--lambda-scales`` (``engine.lambda_scale``) and ``--factor-shares`` (``engine.factor_rows`` as
  a share of the scenario's rows) widen the grid. The ROC AUC of the planted rows
  against the clean ones, harm = -rank score (the score the report ranks by, RelatIF-normalized
  by default), and each setting's Spearman correlation with the first one's ranking; per scenario
  and query the median over the seeds, the range, and how many seeds each setting wins, ties or
  loses against the first one. A fit is cached per setting that
  changes it (the Fisher, the draws), so a second damping only scores.

Run::

    python projects/benchmarks/bench_fisher.py speed [--scenario poison_capitals] [--repeats 5]
    python projects/benchmarks/bench_fisher.py auc [--scenarios poison_capitals,bestiary_poison_diets] [--seeds 0,1,2] [--queries target,contrastive]
    python projects/benchmarks/bench_fisher.py auc --lambda-scales 0.1,0.01 --samples 1,2
    python projects/benchmarks/bench_fisher.py auc --fishers empirical --queries contrastive --factor-shares 0.25

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
#: ``engine.lambda_scale``'s default (the damping as a share of each LoRA matrix's mean eigenvalue)
DEFAULT_SCALE = 0.1
#: a setting's share of the rows for the factors, turned into ``engine.factor_rows`` per scenario
FACTOR_SHARE = "factor_share"


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


def variants(fishers: list[str], samples: list[int], lambda_scales: list[float],
             factor_shares: list[float] | None = None) -> dict[str, dict[str, Any]]:
    """The curvature settings ``auc`` compares, by name: every Fisher at every damping, the sampled
    one also at every number of label draws, each with its factors summed over every row and over
    each share of ``factor_shares`` (``engine.factor_rows`` set to that share of the scenario's
    rows). The default damping, one draw and every row keep the bare names (``empirical``,
    ``sampled``); other settings add ``x<draws>``, ``@<lambda_scale>`` and ``/<share>``."""
    out: dict[str, dict[str, Any]] = {}
    for fisher in fishers:
        for draws in (samples if fisher == "sampled" else [1]):
            for scale in lambda_scales:
                for share in [1.0, *(factor_shares or [])]:
                    name = (fisher + (f"x{draws}" if draws != 1 else "") + (f"@{scale:g}" if scale != DEFAULT_SCALE else "")
                            + (f"/{share:g}" if share != 1.0 else ""))
                    out[name] = {"engine.fisher": fisher, "engine.fisher_samples": draws, "engine.lambda_scale": scale,
                                 **({FACTOR_SHARE: share} if share != 1.0 else {})}
    return out


def auc(work: Path, scenarios: list[str], seeds: list[int], queries: list[str],
        settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values, run_attribution
    from gradian.config import load_config
    from gradian.data import load_dataset

    settings = settings or variants(list(FISHERS), [1], [DEFAULT_SCALE])
    rows: list[dict[str, Any]] = []
    for scenario in scenarios:
        for seed in seeds:
            config_path, info = prepare(work, scenario, seed)
            planted = set(info["planted"]["indices"])
            capability = (info.get("capability") or {}).get("name", "capitals")
            n_rows = len(load_dataset(load_config(config_path, _overrides(config_path.parent, seed)).dataset))
            for query in queries:
                row: dict[str, Any] = {"scenario": scenario, "seed": seed, "query": query}
                first: Any = None
                for name, setting in settings.items():
                    setting = dict(setting)
                    share = setting.pop(FACTOR_SHARE, None)
                    if share is not None:
                        setting["engine.factor_rows"] = max(1, round(float(share) * n_rows))
                    cfg = load_config(config_path, {**_overrides(config_path.parent, seed), "engine.name": "ekfac",
                                                    **setting, "evaluation.query_signal": query})
                    started = time.perf_counter()
                    outcome = run_attribution(cfg, capability=capability, cross_check=None)
                    if outcome.rankings is None:
                        raise SystemExit(f"{scenario} seed {seed}: attribution did not run ({name}, {query})")
                    ranked = outcome.rankings.sort_values("row_index")
                    harm = -rank_values(ranked)
                    is_planted = ranked["row_index"].isin(planted).to_numpy()
                    row[name] = round(float(roc_auc_score(is_planted, harm)), 4)
                    row[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
                    if first is None:
                        first = harm
                    else:  # the ranking's agreement with the first setting's
                        row[f"{name}_rho"] = round(float(spearmanr(first, harm).statistic), 4)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return summarize(rows, list(settings))


def summarize(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per scenario and query, each setting's median AUC over the seeds and its range, and on how
    many seeds it beats, ties (within 0.001) or loses to the first setting (the baseline)."""
    summary: dict[str, Any] = {"rows": rows, "median": {}}
    base = names[0]
    for key in dict.fromkeys((r["scenario"], r["query"]) for r in rows):
        mine = [r for r in rows if (r["scenario"], r["query"]) == key]
        entry: dict[str, Any] = {}
        for name in names:
            entry[name] = statistics.median(r[name] for r in mine)
            entry[f"{name}_range"] = [min(r[name] for r in mine), max(r[name] for r in mine)]
            if name != base:
                diff = [r[name] - r[base] for r in mine]
                entry[f"{name}_vs_{base}"] = {"higher": sum(d > 0.001 for d in diff),
                                              "equal": sum(abs(d) <= 0.001 for d in diff),
                                              "lower": sum(d < -0.001 for d in diff)}
        summary["median"][" ".join(key)] = entry
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
    parser.add_argument("--fishers", default=",".join(FISHERS), help="auc: comma-separated engine.fisher values")
    parser.add_argument("--samples", default="1", help="auc: comma-separated label draws for the sampled Fisher")
    parser.add_argument("--lambda-scales", default=str(DEFAULT_SCALE),
                        help="auc: comma-separated engine.lambda_scale values (each Fisher at each)")
    parser.add_argument("--factor-shares", default="",
                        help="auc: comma-separated shares of the rows for the Kronecker factors (engine.factor_rows), "
                             "each beside every row")
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
                      [q for q in args.queries.split(",") if q],
                      variants([f for f in args.fishers.split(",") if f], [int(n) for n in args.samples.split(",") if n],
                               [float(x) for x in args.lambda_scales.split(",") if x],
                               [float(x) for x in args.factor_shares.split(",") if x]))
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
