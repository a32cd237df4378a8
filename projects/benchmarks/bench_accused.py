"""The accused set each engine's scores lead to, when the clusters are discovered, not declared.

One fine-tune of a poison scenario whose planted rows share their topic with correct clean rows
(``poison_capitals_ontopic`` by default), with the declared ``cluster`` column removed from the
training file so that ``clustering.method: auto`` has to find the topics itself. Then the
attribution pipeline once per engine (contrastive query, no cross-check), and for each, against
the ground truth in ``scenario.json``:

- ``auc``: ROC AUC of the planted rows against the clean ones (harm = -score), for reference;
- the accused topic cluster: its size and how many planted rows it holds;
- the accused set the report chose: its method, size, precision and recall of the planted rows;
- every candidate split ``refine_accused`` weighed (whole cluster, score gap, score mixture,
  gradient sub-clusters), with the same precision and recall, so a better rule can be seen.

Run: ``python projects/benchmarks/bench_accused.py [--work DIR] [--engines datainf,ekfac]
[--scenario NAME] [--seeds 0,1,2] [--set KEY=VALUE] [--out results.json]``. The work directory
keeps the fine-tunes and the indexes; a second run only scores. About three minutes per fine-tune
on 2 CPU cores the first time. ``--seeds`` fine-tunes the same data once per training seed (the
config's ``seed``: LoRA initialisation and row order) and prints each engine's figures per seed
and their range; without it, one fine-tune at the scenario's own seed.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradian.report.schema import Accused, Report

SCENARIO = "poison_capitals_ontopic"
ENGINES = ("datainf", "ekfac", "kfac", "graddot")


def prepare_run(work: Path, scenario: str, seed: int | None = None,
                train_overrides: dict[str, object] | None = None, tag: str = "") -> tuple[Path, set[int], str]:
    """Write the scenario without its declared clusters and fine-tune it once (reused after);
    ``seed`` overrides the training seed (the scenario's own when None), ``train_overrides``
    other config keys of the fine-tune, under a folder name ending in ``tag``."""
    from gradian.config import load_config
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    root = work / ((scenario if seed is None else f"{scenario}-seed{seed}") + tag)
    if not ((root / "run" / "gradian_run.json").is_file() and (root / "scenario.json").is_file()):
        write_scenario(scenario, root)
        train = root / "train.jsonl"
        rows = [json.loads(line) for line in train.read_text().splitlines() if line.strip()]
        for row in rows:
            row.pop("cluster", None)
        train.write_text("".join(json.dumps(row) + "\n" for row in rows))
        cfg = load_config(root / "gradian.yaml", {**({} if seed is None else {"seed": seed}), **(train_overrides or {})})
        train_lora(cfg, root / "run", overwrite=True)
    info = json.loads((root / "scenario.json").read_text())
    capability = (info.get("capability") or {}).get("name", "capitals")
    return root, {int(i) for i in (info.get("planted") or {}).get("indices") or []}, capability


@dataclass
class Captured:
    """One fine-tune loaded and captured as ``capture_fine_tune`` leaves it."""

    cfg: Any
    gm: Any
    tokenizer: Any
    dataset: Any
    tokenized: list[Any]
    #: the full-width index, built with ``collector`` gathering the Kronecker factors on the way
    index: Any
    collector: Any
    #: the capability measured on this model, and the contrastive query of its regressed items
    capability: Any
    query: Any
    #: wall seconds of the index build
    capture_seconds: float

    def context(self) -> Any:
        """The fit context of the full-width index (the factors ``collector`` gathered)."""
        from gradian.attribution.checkpoints import fit_context

        return fit_context(self.cfg, self.gm, self.tokenizer, self.dataset, None, tokenized=self.tokenized,
                           collected=self.collector)


def capture_fine_tune(root: Path, capability: str, overrides: dict[str, object] | None = None) -> Captured:
    """The fine-tune in ``root`` as ``gradian attribute`` loads it on the CPU (EK-FAC, contrastive
    query; ``overrides`` on top): its full index built while the Kronecker factors are gathered,
    the capability measured and the query formed from the items it regressed on."""
    import time

    from gradian.attribution.pipeline import _query_items
    from gradian.config import load_config
    from gradian.data import load_dataset, tokenize_examples
    from gradian.evaluate import evaluate_capability
    from gradian.grads import load_model_for_gradients
    from gradian.grads.collectors import KroneckerCollector
    from gradian.index import GradientIndex
    from gradian.model_loading import load_tokenizer
    from gradian.query import build_query_gradient, select_query_items

    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu",
                                              "evaluation.query_signal": "contrastive", "engine.name": "ekfac",
                                              **(overrides or {})})
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model)
    dataset = load_dataset(cfg.dataset)
    tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)
    start = time.perf_counter()
    with KroneckerCollector(gm) as collector:
        index = GradientIndex.build(gm, tokenizer, dataset, cfg, force=True)  # force: the collector sees the pass
    seconds = time.perf_counter() - start
    eval_set = load_dataset(cfg.eval_dataset)
    cap = evaluate_capability(cfg, eval_set, model=gm.model, tokenizer=tokenizer, capability=capability)
    items, scope, notes, ids = select_query_items(_query_items(cap, eval_set), dataset.examples)
    query = build_query_gradient(gm, tokenizer, items, "contrastive", cfg.grads, scope=scope, notes=notes,
                                 finding_ids=ids)
    return Captured(cfg, gm, tokenizer, dataset, tokenized, index, collector, cap, query, seconds)


def ekfac_rank(cfg: Any, train: Any, context: Any, query: dict[str, np.ndarray]) -> np.ndarray:
    """EK-FAC fitted on ``train`` under ``context`` and scored against ``query``: each row's rank
    score (RelatIF, as the pipeline ranks), averaged over the query's items."""
    from gradian.engines import get_engine

    engine = get_engine("ekfac")
    state = engine.fit(train, cfg.engine, context)
    return np.asarray(engine.score(state, query, cfg.engine).rank_scores, dtype=np.float64).mean(axis=1)


def precision_recall(chosen: set[int], planted: set[int]) -> tuple[float, float]:
    hit = len(chosen & planted)
    return (hit / len(chosen) if chosen else 0.0), (hit / len(planted) if planted else 0.0)


def candidate_rows(rankings: Any, accused: "Accused", seed: int) -> dict[str, set[int]]:
    """Row indices of every candidate split, recomputed from the rankings the report wrote."""
    from gradian.cluster.accused import _gap_split, _harmful_probability, harm_transform

    members = rankings[rankings["cluster"].astype(str) == str(accused.cluster)]
    scores = members["score"].to_numpy(dtype=np.float64)
    rows = members["row_index"].to_numpy()
    scale = float(np.median(np.abs(rankings["score"].to_numpy(dtype=np.float64)))) or 1.0
    t = harm_transform(scores, scale)
    probability, means = _harmful_probability(t, scores, seed)
    out = {"whole_cluster": set(int(r) for r in rows)}
    if means is not None:
        out["score_mixture"] = {int(r) for r in rows[(probability > 0.5) & (scores < 0)]}
    gap = _gap_split(t, means)
    if gap is not None:
        out["score_gap"] = {int(r) for r in rows[gap & (scores < 0)]}
    return out


def measure(root: Path, planted: set[int], capability: str, engine: str, overrides: dict[str, Any]) -> dict[str, Any]:
    from gradian.attribution import rank_values, run_attribution
    from gradian.config import load_config

    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu",
                                              "clustering.method": "auto",
                                              "evaluation.query_signal": "contrastive",
                                              "engine.name": engine, **overrides})
    outcome = run_attribution(cfg, capability=capability, cross_check="none", out_dir=root / f"report-{engine}")
    report, rankings = Report.of(outcome.report), outcome.rankings
    accused = report.attribution.accused if report.attribution is not None else None
    from sklearn.metrics import roc_auc_score

    is_planted = rankings["row_index"].isin(planted).to_numpy()
    # a scenario without planted rows (a setting fault) has no AUC: only its verdict is measured
    auc = float(roc_auc_score(is_planted, -rank_values(rankings))) if 0 < is_planted.sum() < len(is_planted) else None
    result: dict[str, Any] = {"engine": engine, "verdict": report.verdict.kind,
                              "auc": None if auc is None else round(auc, 3)}
    if not accused:
        return result
    cluster_rows = set(rankings.loc[rankings["cluster"].astype(str) == str(accused.cluster), "row_index"])
    chosen = set(int(r) for r in rankings.loc[rankings["accused"], "row_index"])
    precision, recall = precision_recall(chosen, planted)
    result.update(cluster_n=len(cluster_rows), planted_in_cluster=len(cluster_rows & planted),
                  method=accused.method, accused_n=len(chosen), precision=round(precision, 3),
                  recall=round(recall, 3), candidates={})
    for method, rows in candidate_rows(rankings, accused, cfg.seed).items():
        p, r = precision_recall(rows, planted)
        result["candidates"][method] = {"n": len(rows), "precision": round(p, 3), "recall": round(r, 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "gradian" / "bench" / "accused"),
                        help="work directory (kept between runs)")
    parser.add_argument("--scenario", default=SCENARIO, help="a poison scenario with on-topic clean rows")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated training seeds: one fine-tune each (default: the scenario's own seed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override applied to every engine (repeatable)")
    parser.add_argument("--out", default=None, help="write the JSON here as well as printing it")
    args = parser.parse_args()
    from bench_attribution_quality import parse_overrides  # the script folder is on sys.path

    overrides = parse_overrides(args.set, parser)
    seeds: list[int | None] = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [None]
    engines = [engine for engine in args.engines.split(",") if engine]
    per_seed = []
    for seed in seeds:
        root, planted, capability = prepare_run(Path(args.work), args.scenario, seed)
        results = [measure(root, planted, capability, engine, overrides) for engine in engines]
        per_seed.append({"seed": seed, "results": results})
        print(f"-- training seed {'(scenario default)' if seed is None else seed}")
        for r in results:
            auc = "n/a" if r["auc"] is None else f"{r['auc']:.3f}"
            if "method" not in r:
                print(f"{r['engine']:8s} AUC {auc}; verdict {r['verdict']}, no accused set")
                continue
            print(f"{r['engine']:8s} AUC {auc}; cluster {r['cluster_n']} rows ({r['planted_in_cluster']} planted); "
                  f"accused {r['accused_n']} by {r['method']}: precision {r['precision']:.3f}, recall {r['recall']:.3f}")
            for method, c in r["candidates"].items():
                print(f"{'':10s}{method:14s} n {c['n']:4d}  precision {c['precision']:.3f}  recall {c['recall']:.3f}")
    if len(seeds) > 1:
        print(f"-- range over {len(seeds)} training seeds (min / median / max)")
        for engine in engines:
            rows = [r for run in per_seed for r in run["results"] if r["engine"] == engine]
            line = [f"{engine:8s}", f"verdicts {','.join(r['verdict'] for r in rows)}"]
            for key in ("auc", "precision", "recall"):
                values = [r[key] for r in rows if r.get(key) is not None]
                if values:
                    line.append(f"{key} {min(values):.3f} / {float(np.median(values)):.3f} / {max(values):.3f}")
            print("  ".join(line))
    payload = per_seed[0] if len(seeds) == 1 else {"seeds": per_seed}
    text = json.dumps({"scenario": args.scenario, "overrides": overrides, **payload}, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
