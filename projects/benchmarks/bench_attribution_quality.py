"""How well each engine finds the planted rows of tinyworld's ``poison_capitals`` scenario.

One fine-tune (the scenario's own settings, plus a checkpoint saved every ``--save-steps`` steps
so TracIn has a trajectory to sum over), then the attribution pipeline once per engine
(``datainf``, ``graddot``, ``tracin``) and query signal (``target``, ``contrastive``). For each
pair, against the ground truth in ``scenario.json``:

- ``auc``: ROC AUC of planted against clean rows, with harm = -score (1.0: every planted row is
  more harmful than every clean row; 0.5: chance);
- ``top_k_precision``: share of planted rows among the k most harmful, k = number planted;
- ``median_planted_percentile``: median harm percentile of the planted rows (100 = the most
  harmful row of the whole set, 50 = the middle);
- ``planted_share_of_negative`` and ``planted_cluster_rank``: the planted cluster's share of the
  negative influence in the report's cluster table, and its rank by that share (1 = first);
- ``planted_mean_rank``: its rank by mean score per example, most harmful first;
- ``verdict``: the verdict the report reached with that engine and signal.

It also prints the Spearman agreement of every pair of engines under each signal, and, for every
engine against ``datainf`` under the same signal, the AUC difference with a 95% paired bootstrap
interval (rows resampled within the planted and the clean group, 2,000 resamples). Every figure
comes from one run; nothing is averaged over seeds.

Run: ``python projects/benchmarks/bench_attribution_quality.py [--work DIR] [--out results.json]``;
``--scenario bestiary_poison_diets`` for the other world, ``--engines ekfac --set
engine.lambda_scale=0.01`` for a damping sweep (DataInf is always measured beside).
The work directory keeps the fine-tune and the gradient indexes, so a second run only scores.
About five minutes on 2 CPU cores the first time (one minute of it training).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from gradian.report.schema import ClusterRow, Report

ENGINES = ("ekfac", "kfac", "datainf", "graddot", "tracin")
SIGNALS = ("target", "contrastive")
SCENARIO = "poison_capitals"


def prepare_run(work: Path, save_steps: int, scenario: str = SCENARIO) -> tuple[Path, dict[str, Any], float]:
    """Write the scenario and fine-tune it once (reused when the run already exists)."""
    from gradian.config import load_config
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    root = work / scenario
    run = root / "run"
    config_path = root / "gradian.yaml"
    if (run / "gradian_run.json").is_file() and (root / "scenario.json").is_file():
        return config_path, json.loads((root / "scenario.json").read_text()), 0.0
    info = write_scenario(scenario, root)  # the scenario's own world's base model
    cfg = load_config(config_path, _overrides(root, save_steps))
    started = time.perf_counter()
    train_lora(cfg, run, overwrite=True)
    return config_path, info, time.perf_counter() - started


def _overrides(root: Path, save_steps: int) -> dict[str, Any]:
    return {"train.save_checkpoints": True, "train.save_steps": save_steps,
            "cache_dir": str(root / ".gradian"), "device": "cpu"}


def quality(rankings: Any, clusters: "list[ClusterRow]", planted: set[int], planted_cluster: str) -> dict[str, Any]:
    """The figures of the module docstring for one ranking."""
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values

    harm = -rank_values(rankings)
    is_planted = rankings["row_index"].isin(planted).to_numpy()
    k = int(is_planted.sum())
    order = np.argsort(-harm, kind="stable")
    # harm percentile: share of rows at most as harmful as this one (100 = the most harmful)
    ranks = np.argsort(np.argsort(harm, kind="stable"), kind="stable")
    percentile = 100.0 * (ranks + 1) / len(harm)
    by_share = sorted(clusters, key=lambda c: -c.share_of_negative)
    by_mean = sorted(clusters, key=lambda c: c.mean_per_example)
    row = next((c for c in clusters if str(c.cluster) == planted_cluster), None)
    return {
        "n": len(harm),
        "n_planted": k,
        "auc": float(roc_auc_score(is_planted, harm)),
        "top_k_precision": float(is_planted[order[:k]].mean()),
        "median_planted_percentile": float(np.median(percentile[is_planted])),
        "planted_share_of_negative": float(row.share_of_negative) if row else None,
        "planted_cluster_rank": 1 + [str(c.cluster) for c in by_share].index(planted_cluster) if row else None,
        "planted_mean_rank": 1 + [str(c.cluster) for c in by_mean].index(planted_cluster) if row else None,
        "n_clusters": len(clusters),
    }


def is_planted_mask(rankings: Any, planted: set[int]) -> np.ndarray:
    return rankings["row_index"].isin(planted).to_numpy()


def auc_difference(scores_a: np.ndarray, scores_b: np.ndarray, planted: np.ndarray, n_boot: int = 2000,
                   seed: int = 0) -> dict[str, float]:
    """AUC(a) - AUC(b) on the same rows (harm = -score), with a 95% paired bootstrap interval."""
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(planted), np.flatnonzero(~planted)
    point = roc_auc_score(planted, -scores_a) - roc_auc_score(planted, -scores_b)
    draws = []
    for _ in range(n_boot):
        rows = np.concatenate([rng.choice(pos, pos.size), rng.choice(neg, neg.size)])
        draws.append(roc_auc_score(planted[rows], -scores_a[rows]) - roc_auc_score(planted[rows], -scores_b[rows]))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return {"difference": float(point), "ci": [float(lo), float(hi)]}


def measure(config_path: Path, info: dict[str, Any], save_steps: int, engines: tuple[str, ...] = ENGINES,
            scenario: str = SCENARIO, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    from gradian.attribution import rank_values, run_attribution
    from gradian.config import load_config
    from gradian.engines import rank_correlation

    root = config_path.parent
    planted = set(info["planted"]["indices"])
    planted_cluster = str(info["planted"]["cluster"])
    results: list[dict[str, Any]] = []
    scores: dict[tuple[str, str], np.ndarray] = {}
    for signal in SIGNALS:
        for engine in engines:
            cfg = load_config(config_path, {**_overrides(root, save_steps), **(extra or {}), "engine.name": engine,
                                            "evaluation.query_signal": signal})
            started = time.perf_counter()
            outcome = run_attribution(cfg, capability=(info.get("capability") or {}).get("name", "capitals"), cross_check=None)
            seconds = time.perf_counter() - started
            report = Report.of(outcome.report)
            attribution = report.attribution
            if attribution is None:
                raise SystemExit(f"attribution did not run for {engine}/{signal}: {report.verdict.summary}")
            figures = quality(outcome.rankings, attribution.clusters, planted, planted_cluster)
            figures.update(engine=engine, query_signal=attribution.query_signal,
                           verdict=report.verdict.kind, seconds=round(seconds, 1),
                           notes=[n for n in attribution.notes if n.startswith(engine)])
            results.append(figures)
            scores[(engine, signal)] = rank_values(outcome.rankings)
            print(f"  {engine:8s} {signal:12s} AUC {figures['auc']:.3f}  ({seconds:.0f} s)", flush=True)
    differences = {
        signal: {engine: auc_difference(scores[(engine, signal)], scores[("datainf", signal)], is_planted_mask(outcome.rankings, planted))
                 for engine in engines if engine != "datainf"}
        for signal in SIGNALS
    }
    agreement = {
        signal: {f"{a} vs {b}": float(rank_correlation(scores[(a, signal)], scores[(b, signal)]))
                 for i, a in enumerate(engines) for b in engines[i + 1:]}
        for signal in SIGNALS
    }
    cap = outcome.capability
    return {
        "scenario": scenario,
        "n_train": info["n_train"],
        "n_planted": len(planted),
        "capability": {"base": cap.base, "tuned": cap.tuned, "delta": cap.delta, "ci": list(cap.ci),
                       "n_flipped": cap.n_flipped, "n_items": cap.n_items},
        "save_steps": save_steps,
        "results": results,
        "engine_agreement_spearman": agreement,
        "auc_minus_datainf": differences,
    }


def table(summary: dict[str, Any]) -> str:
    head = (f"{'engine':8s} {'query':12s} {'AUC':>6s} {'P@k':>6s} {'med.pct':>8s} "
            f"{'share-':>7s} {'rank':>5s} {'mean rank':>9s}  verdict")
    lines = [head, "-" * len(head)]
    for r in summary["results"]:
        share = f"{r['planted_share_of_negative']:.2f}" if r["planted_share_of_negative"] is not None else "-"
        lines.append(f"{r['engine']:8s} {r['query_signal']:12s} {r['auc']:6.3f} {r['top_k_precision']:6.3f} "
                     f"{r['median_planted_percentile']:8.1f} {share:>7s} {r['planted_cluster_rank']!s:>5s} "
                     f"{r['planted_mean_rank']!s:>9s}  {r['verdict']}")
    return "\n".join(lines)


def parse_overrides(items: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``--set KEY=VALUE`` flags as config overrides, each value read as YAML (``0.01``, ``true``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: use KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "gradian" / "bench" / "attribution_quality"),
                        help="keeps the fine-tune and the indexes between runs")
    parser.add_argument("--save-steps", type=int, default=212,
                        help="checkpoint interval for TracIn (212 steps = one epoch of this scenario at batch 4)")
    parser.add_argument("--out", default=None, help="write the JSON here as well as printing it")
    parser.add_argument("--scenario", default=SCENARIO, help="a poison scenario of tinyworld (or of another offline world)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines; datainf is always measured")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every attribution, e.g. engine.lambda_scale=0.01 (repeatable)")
    args = parser.parse_args()

    work = Path(args.work).resolve()
    engines = tuple(dict.fromkeys(["datainf", *[e for e in args.engines.split(",") if e]]))
    config_path, info, train_seconds = prepare_run(work, args.save_steps, args.scenario)
    checkpoints = sorted(p.name for p in (config_path.parent / "run").glob("checkpoint-*"))
    print(f"{args.scenario}: {info['n_train']} rows, {info['planted']['n']} planted; "
          f"checkpoints {', '.join(checkpoints) or 'none'}"
          + (f"; trained in {train_seconds:.0f} s" if train_seconds else " (reused)"), flush=True)
    extra = parse_overrides(args.set, parser)
    summary = measure(config_path, info, args.save_steps, engines, args.scenario, extra)
    summary["overrides"] = extra
    summary["checkpoints"] = checkpoints
    summary["train_seconds"] = round(train_seconds, 1)
    cap = summary["capability"]
    print(f"\ncapability: {cap['base']:.3f} -> {cap['tuned']:.3f}, {cap['n_flipped']} of {cap['n_items']} flipped")
    print(table(summary))
    print("\nAUC minus datainf's (95% paired bootstrap interval):")
    for signal, rows in summary["auc_minus_datainf"].items():
        print(f"  {signal:12s} " + "  ".join(f"{k} {v['difference']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}]"
                                               for k, v in rows.items()))
    print("\nengine agreement (Spearman):")
    for signal, pairs in summary["engine_agreement_spearman"].items():
        print(f"  {signal:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in pairs.items()))
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
