"""What a quantized base (``quantization: 8bit`` or ``4bit``) changes at attribution, against the base in float32.

A user who trained QLoRA may not be able to hold the base in full precision beside the capture's
activations, so Gradian can load it through bitsandbytes. This benchmark measures, on fine-tunes
where both fit (the fine-tunes of ``bench_accused.py``, declared clusters removed, cached in
``--work``), what that costs in exactness. For each world, fine-tune seed and quantization, the
model is loaded as ``gradian attribute`` loads it, the capability measured, the full per-example
gradient index built with its Kronecker factors, the contrastive query formed from that model's
own regressed items, and EK-FAC fitted and scored (RelatIF ranking, as the pipeline ranks). Per
quantization it prints:

- ``weights``: the model's bytes in memory (``get_memory_footprint``) over float32's;
- ``tuned`` / ``flipped``: the capability of the tuned model and how many items flipped, as that
  model measures them;
- ``cos``: each row's gradient cosine with the float32 base's, median and the 5th percentile;
  ``norm``: the median of |g_q| / |g|;
- ``auc``: ROC AUC of the planted rows against the clean ones (harm = -rank score);
  ``rho``: Spearman correlation of the rank scores with float32's;
- ``capture``: seconds of the index build over float32's (one process, on the CPU bitsandbytes
  dequantizes every weight at every call, so expect it slower there; on a GPU it is the memory
  that is saved, not time).

Each figure is given per seed and as the median and range over seeds.

``--trained 4bit`` fine-tunes against the 4-bit base instead (``train.load_in_4bit``, what a QLoRA
run does), so the question becomes the user's: is such an adapter better attributed on the base it
was trained against or on the full-precision one?

Run: ``python projects/benchmarks/bench_quantized.py [--work DIR] [--scenarios a,b] [--seeds 0,1,2]
[--trained float|4bit] [--out results.json]`` (needs bitsandbytes: ``pip install 'gradian-mlflow[quantize]'``). About a
minute per fine-tune and quantization on 2 CPU cores once the fine-tunes exist (about three
minutes each the first time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_accused import capture_fine_tune, ekfac_rank, prepare_run  # noqa: E402

SCENARIOS = ("poison_capitals_ontopic", "bestiary_poison_diets")
QUANTIZATIONS = ("none", "8bit", "4bit")


def measure(root: Path, planted: set[int], capability: str, quantization: str) -> dict[str, Any]:
    """One quantization of one fine-tune: what the module docstring lists, and the raw rows and
    ranks for the comparison with float32."""
    from sklearn.metrics import roc_auc_score

    from gradian.engines import InMemoryGradients

    run = capture_fine_tune(root, capability, {"dtype": "float32", "quantization": quantization})
    rows = run.index.rows(range(run.index.n))
    rank = ekfac_rank(run.cfg, InMemoryGradients(rows), run.context(), run.query.per_item)
    is_planted = np.array([i in planted for i in range(run.index.n)])
    flat = np.concatenate([np.asarray(rows[b.name], dtype=np.float64) for b in run.gm.blocks], axis=1)
    cap = run.capability
    return {"quantization": quantization, "footprint": int(run.gm.model.get_memory_footprint()),
            "capture_s": run.capture_seconds, "base": cap.base, "tuned": cap.tuned, "flipped": cap.n_flipped,
            "auc": float(roc_auc_score(is_planted, -rank)), "rank": rank, "grads": flat}


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's figures against the first (float32)."""
    from scipy.stats import spearmanr

    ref = runs[0]
    out = []
    for run in runs:
        g, g0 = run["grads"], ref["grads"]
        n, n0 = np.linalg.norm(g, axis=1), np.linalg.norm(g0, axis=1)
        cos = (g * g0).sum(axis=1) / np.maximum(n * n0, 1e-300)
        out.append({"quantization": run["quantization"], "weights": run["footprint"] / ref["footprint"],
                    "base": run["base"], "tuned": run["tuned"], "flipped": run["flipped"],
                    "cos_median": float(np.median(cos)), "cos_p5": float(np.percentile(cos, 5)),
                    "norm_median": float(np.median(n / np.maximum(n0, 1e-300))),
                    "auc": run["auc"], "rho": float(spearmanr(ref["rank"], run["rank"]).statistic),
                    "capture": run["capture_s"] / ref["capture_s"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-compact"),
                        help="where the fine-tunes are cached (shared with bench_compact_index.py)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--trained", choices=("float", "4bit"), default="float",
                        help="float: the fine-tunes trained against the float32 base; 4bit: trained against the "
                             "4-bit base (train.load_in_4bit, a QLoRA run), cached apart")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    overrides: dict[str, object] = {"train.load_in_4bit": True} if args.trained == "4bit" else {}
    tag = "-qlora" if args.trained == "4bit" else ""
    seeds = [int(s) for s in args.seeds.split(",") if s]
    report: dict[str, Any] = {}
    for scenario in [s for s in args.scenarios.split(",") if s]:
        per_seed: dict[int, list[dict[str, Any]]] = {}
        for seed in seeds:
            root, planted, capability = prepare_run(args.work, scenario, seed, overrides, tag)
            per_seed[seed] = compare([measure(root, planted, capability, q) for q in QUANTIZATIONS])
            for r in per_seed[seed]:
                print(f"{scenario} seed {seed} {r['quantization']:5s} weights {r['weights']:.3f} tuned "
                      f"{r['tuned']:.3f} flipped {r['flipped']} cos {r['cos_median']:.4f} (p5 {r['cos_p5']:.4f}) "
                      f"norm {r['norm_median']:.3f} AUC {r['auc']:.3f} rho {r['rho']:.3f} "
                      f"capture x{r['capture']:.2f}", flush=True)
        summary = []
        for k, q in enumerate(QUANTIZATIONS):
            row: dict[str, Any] = {"quantization": q}
            for name in ("weights", "cos_median", "cos_p5", "norm_median", "auc", "rho", "capture"):
                values = [per_seed[s][k][name] for s in seeds]
                row[name] = {"median": float(np.median(values)), "range": [float(min(values)), float(max(values))]}
            drops = [per_seed[s][0]["auc"] - per_seed[s][k]["auc"] for s in seeds]
            row["auc_drop"] = {"median": float(np.median(drops)), "range": [float(min(drops)), float(max(drops))]}
            summary.append(row)
        report[scenario] = {"seeds": {str(s): v for s, v in per_seed.items()}, "summary": summary}
        print(f"\n{scenario}: {len(seeds)} seeds (median [min, max])")
        for row in summary:
            cells = "  ".join(f"{name} {v['median']:.3f} [{v['range'][0]:.3f}, {v['range'][1]:.3f}]"
                              for name, v in row.items() if name != "quantization")
            print(f"  {row['quantization']:5s} {cells}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
