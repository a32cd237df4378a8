"""Which eval items and which signal make the query that finds the planted rows best.

For every poison scenario and fine-tune seed (each fine-tuned here with the scenario's own recipe
and the seed, kept in ``--work`` so a second run only scores), ``gradian attribute`` with the
default engine (EK-FAC), no cross check, under each query of ``--variants``:

- ``flipped/contrastive``: the items the tuned model now fails, ``l(wanted) - l(generated)``;
- ``flipped/target``: the same items, ``l(wanted)``;
- ``lost/contrastive``: those, and the items still answered right whose wanted answer lost at
  least ``evaluation.query_lost_nats`` of log-likelihood (their ``l(wanted)`` alone);
- ``lost/target``: the same items, ``l(wanted)`` for each;
- ``lost@N/...``: ``lost`` with ``evaluation.query_lost_nats: N``;
- ``lost@N+runner_up/contrastive``: those items, each still answered right contrasted with its
  runner-up answer (``evaluation.query_kept_contrast: runner_up``);
- a suffix ``:harm`` or ``:mean`` on the signal (``flipped/contrastive:harm``) sets
  ``engine.rank_items``, how the rows are ordered over the query's items.

Recorded per run: the ROC AUC of the planted rows against the clean ones (harm = -rank score, the
order the report ranks by), P@k (the share of planted rows among the k most harmful, k = the
number planted), and how many items the query held. The summary gives, per scenario and
variant, the median and range over seeds, and for each variant the seeds on which it beat
``flipped/contrastive``.

Run::

    python projects/benchmarks/bench_query.py --scenarios poison_capitals,poison_capitals_partial --seeds 0,1,2

It prints JSON lines per run and a summary (``--out`` writes it too). The figures are
deterministic for a fine-tune; fine-tunes differ between CPU models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fisher import _overrides, prepare  # noqa: E402

SCENARIOS = ("poison_capitals", "poison_capitals_partial", "poison_capitals_ontopic", "bestiary_poison_diets",
             "delta_poison_partial", "delta_poison_redundant")
VARIANTS = ("flipped/contrastive", "flipped/target", "lost/contrastive", "lost/target")
BASELINE = "flipped/contrastive"


def _score(config_path: Path, info: dict[str, Any], seed: int, variant: str) -> dict[str, Any]:
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values, run_attribution
    from gradian.config import load_config

    scope, signal = variant.split("/")
    signal, _, order = signal.partition(":")
    scope, _, kept = scope.partition("+")
    scope, _, nats = scope.partition("@")
    extra: dict[str, Any] = {"evaluation.query_lost_nats": float(nats)} if nats else {}
    if kept:
        extra["evaluation.query_kept_contrast"] = kept
    if order:
        extra["engine.rank_items"] = order
    cfg = load_config(config_path, {**_overrides(config_path.parent, seed), "evaluation.query_scope": scope,
                                    "evaluation.query_signal": signal, **extra})
    capability = (info.get("capability") or {}).get("name", "capitals")
    started = time.perf_counter()
    outcome = run_attribution(cfg, capability=capability, cross_check="none")
    if outcome.rankings is None:
        return {"variant": variant, "auc": None, "note": "attribution did not run (the regression did not pass its gate)"}
    planted = set(info["planted"]["indices"])
    harm = -rank_values(outcome.rankings)
    is_planted = outcome.rankings["row_index"].isin(planted).to_numpy()
    k = int(is_planted.sum())
    top = np.argsort(-harm, kind="stable")[:k]
    query = outcome.report.to_json()["attribution"]["query"]
    return {"variant": variant, "auc": round(float(roc_auc_score(is_planted, harm)), 4),
            "p_at_k": round(float(is_planted[top].mean()), 4), "query_items": query["n_items"],
            "signal": query["signal"], "seconds": round(time.perf_counter() - started, 1)}


def run(work: Path, scenarios: list[str], seeds: list[int], variants: list[str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for scenario in scenarios:
        for seed in seeds:
            config_path, info = prepare(work, scenario, seed)
            for variant in variants:
                row = {"scenario": scenario, "seed": seed, **_score(config_path, info, seed, variant)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"rows": rows, "by_scenario": {}, "beats_baseline": {}}
    for scenario in scenarios:
        for variant in variants:
            aucs = [r["auc"] for r in rows if r["scenario"] == scenario and r["variant"] == variant and r["auc"] is not None]
            if aucs:
                summary["by_scenario"][f"{scenario} {variant}"] = {
                    "median": statistics.median(aucs), "range": [min(aucs), max(aucs)], "n": len(aucs)}
    for variant in variants:
        wins = ties = losses = 0
        for scenario in scenarios:
            for seed in seeds:
                mine = [r["auc"] for r in rows if (r["scenario"], r["seed"], r["variant"]) == (scenario, seed, variant)]
                base = [r["auc"] for r in rows if (r["scenario"], r["seed"], r["variant"]) == (scenario, seed, BASELINE)]
                if mine and base and mine[0] is not None and base[0] is not None:
                    wins += mine[0] > base[0] + 1e-4
                    losses += mine[0] < base[0] - 1e-4
                    ties += abs(mine[0] - base[0]) <= 1e-4
        summary["beats_baseline"][variant] = {"wins": wins, "ties": ties, "losses": losses}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "gradian" / "bench" / "fisher"),
                        help="keeps the fine-tunes and their indexes between runs (shared with bench_fisher.py)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated poison scenarios")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated fine-tune seeds")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated scope/signal pairs")
    parser.add_argument("--out", default=None, help="write the JSON here as well as printing it")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        scope, _, signal = v.partition("/")
        signal, _, order = signal.partition(":")
        scope, _, kept = scope.partition("+")
        name, _, nats = scope.partition("@")
        if name not in ("flipped", "lost") or signal not in ("contrastive", "target", "auto") or (
                nats and (name != "lost" or not nats.replace(".", "", 1).isdigit())) or (
                kept and (name != "lost" or kept not in ("none", "runner_up"))) or order not in ("", "mean", "harm"):
            parser.error(f"--variants: {v!r} is not scope/signal[:order] (scope flipped, lost, lost@NATS or "
                         "lost@NATS+runner_up; signal contrastive, target or auto; order mean or harm)")
    summary = run(Path(args.work).resolve(), [s for s in args.scenarios.split(",") if s],
                  [int(s) for s in args.seeds.split(",") if s], variants)
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
