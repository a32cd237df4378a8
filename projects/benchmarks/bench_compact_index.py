"""How much EK-FAC loses on a compact index: ``grads.projection_kind: kronecker`` at several widths.

For each world and fine-tune seed (the fine-tunes of ``bench_accused.py``, declared clusters
removed, cached in ``--work``): the full-width index and its Kronecker factors are captured once;
each width's index is then that index projected (``P_out G P_in^T`` per LoRA matrix, the same
function the index build applies to each captured batch) and its factors the full factors seen
through the same projection (``P A P^T``; ``tests/test_kronecker_projection.py`` checks both
against the build's own passes). EK-FAC is fitted on each and scored against the contrastive query
of the tuned model's regressed items (projected the same way), ranked by RelatIF as the pipeline
ranks. Per width it prints:

- ``share``: stored values per example over the full gradient's, and the bytes per example
  (float32);
- ``auc``: ROC AUC of the planted rows against the clean ones (harm = -rank score);
- ``rho``: Spearman correlation of the rank scores with the full-width ones.

Each figure is given per seed and as the median and range over seeds.

``--basis`` chooses the side matrices: ``random`` (the product's projection), or one of two
experiments fitted to the factors: ``eigen`` (each side onto its factor's top eigenvectors) and
``whitened`` (the random matrix after each factor's damped inverse square root).

Run: ``python projects/benchmarks/bench_compact_index.py [--work DIR] [--scenarios a,b]
[--seeds 0,1,2,3,4] [--widths 4,8,16,32] [--basis random|eigen|whitened] [--out results.json]``. About a minute per fine-tune on
2 CPU cores once the fine-tunes exist (they take about three minutes each the first time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_accused import capture_fine_tune, ekfac_rank, prepare_run  # noqa: E402

SCENARIOS = ("poison_capitals_ontopic", "bestiary_poison_diets")
WIDTHS = (4, 8, 16, 32)


class _ProjectedSums:
    """The Kronecker sums a collector gathers, seen through a ``kronecker`` projection."""

    #: summed over every row (``engine.factor_rows`` unset)
    share = 1.0

    def __init__(self, sums: dict[str, tuple[np.ndarray, np.ndarray, int]], n: int) -> None:
        self.sums, self._n = sums, n
        self.summed_examples = n

    def complete(self, n: int) -> bool:
        return n == self._n


def _project_sums(collector: Any, projector: Any, layers: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    out = {}
    for layer in layers:
        xx, gg, tokens = collector.sums[layer["key"]]
        p_in = projector.side_matrix(layer["block"], layer["j"], "in", dtype=torch.float64)
        p_out = projector.side_matrix(layer["block"], layer["j"], "out", dtype=torch.float64)
        xx = xx if p_in is None else p_in.numpy() @ xx @ p_in.numpy().T
        gg = gg if p_out is None else p_out.numpy() @ gg @ p_out.numpy().T
        out[layer["key"]] = (xx, gg, tokens)
    return out


class _EigenSides:
    """A kronecker projector whose side matrices are fitted to the data instead of drawn at random
    (an experiment). ``eigen``: each side onto its factor's top eigenvectors. ``whitened``: the
    random side matrix applied after the factor's damped inverse square root,
    ``P (C + d I)^(-1/2)`` with ``d = damping x mean eigenvalue``, so the projection keeps the
    inner products of the curvature-whitened gradients, which are what the scores read."""

    def __init__(self, base: Any, collector: Any, layers: list[dict[str, Any]], basis: str = "eigen",
                 damping: float = 0.1) -> None:
        import torch

        self.base, self.kind, self.width = base, "kronecker", base.width
        self._sides: dict[tuple[str, int, str], np.ndarray] = {}
        for layer in layers:
            xx, gg, tokens = collector.sums[layer["key"]]
            for side, cov in (("in", xx), ("out", gg)):
                if cov.shape[0] > base.width:
                    values, vectors = np.linalg.eigh((cov + cov.T) / 2 / max(tokens, 1))
                    if basis == "eigen":
                        m = vectors[:, ::-1][:, : base.width].T.copy()
                    else:
                        values = np.clip(values, 0.0, None)
                        inv_sqrt = (vectors / np.sqrt(values + damping * values.mean())) @ vectors.T
                        p = base.side_matrix(layer["block"], layer["j"], side, dtype=torch.float64).numpy()
                        m = p @ inv_sqrt
                    self._sides[(layer["block"], layer["j"], side)] = m

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def side_matrix(self, name: str, layer: int, side: str, device: Any = None, dtype: Any = None) -> Any:
        import torch

        m = self._sides.get((name, layer, side))
        return None if m is None else torch.from_numpy(m).to(dtype or torch.float64)

    def project(self, name: str, grads: Any) -> Any:
        import torch

        rows, parts, offset = grads.shape[0], [], 0
        for j, (o, i) in enumerate(self.base.shapes[name]):
            g = grads[:, offset: offset + o * i].reshape(rows, o, i)
            offset += o * i
            p_out, p_in = self.side_matrix(name, j, "out", dtype=g.dtype), self.side_matrix(name, j, "in", dtype=g.dtype)
            if p_out is not None:
                g = p_out @ g
            if p_in is not None:
                g = g @ p_in.T
            parts.append(g.reshape(rows, -1))
        return torch.cat(parts, dim=1)


def measure_seed(root: Path, planted: set[int], capability: str, widths: list[int],
                 basis: str = "random") -> list[dict[str, Any]]:
    import torch
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    from gradian.engines import FitContext, InMemoryGradients
    from gradian.grads import make_projector
    from gradian.grads.collectors import ModelPasses

    run = capture_fine_tune(root, capability)
    cfg, gm, tokenizer, tokenized = run.cfg, run.gm, run.tokenizer, run.tokenized
    index, collector = run.index, run.collector
    full_rows = index.rows(range(index.n))
    is_planted = np.array([i in planted for i in range(index.n)])
    full_width = sum(b.dim for b in gm.blocks)
    full_rank = ekfac_rank(cfg, InMemoryGradients(full_rows), run.context(), run.query.per_item)
    results = [{"width": None, "share": 1.0, "bytes_per_example": 4 * full_width,
                "auc": float(roc_auc_score(is_planted, -full_rank)), "rho": 1.0}]
    for width in widths:
        grads = dataclasses.replace(cfg.grads, projection_kind="kronecker", projection_dim=int(width))
        projector = make_projector(grads, gm)
        if basis != "random":
            projector = _EigenSides(projector, collector, ModelPasses(gm, tokenized, tokenizer.pad_token_id,
                                                                      cfg.grads).layers, basis)
        project = {b: projector.project(b, torch.from_numpy(np.asarray(v, dtype=np.float64))).numpy()
                   for b, v in full_rows.items()}
        query = {b: projector.project(b, torch.from_numpy(np.asarray(v, dtype=np.float64))).numpy()
                 for b, v in run.query.per_item.items()}
        passes = ModelPasses(gm, tokenized, tokenizer.pad_token_id, grads)
        context = FitContext(passes=passes, grads=grads,
                             collected=_ProjectedSums(_project_sums(collector, projector, passes.layers), index.n))
        rank = ekfac_rank(cfg, InMemoryGradients(project), context, query)
        stored = sum(projector.block_width(b) for b in gm.blocks)
        results.append({"width": int(width), "share": stored / full_width, "bytes_per_example": 4 * stored,
                        "auc": float(roc_auc_score(is_planted, -rank)),
                        "rho": float(spearmanr(full_rank, rank).statistic)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench-compact"))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--widths", default=",".join(str(w) for w in WIDTHS))
    parser.add_argument("--basis", choices=("random", "eigen", "whitened"), default="random",
                        help="random: the product's kronecker projection; eigen: each side onto its factor's top "
                             "eigenvectors; whitened: the random projection after each factor's damped inverse "
                             "square root (experiments)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",") if w]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    report: dict[str, Any] = {}
    for scenario in [s for s in args.scenarios.split(",") if s]:
        per_seed = {}
        for seed in seeds:
            root, planted, capability = prepare_run(args.work, scenario, seed)
            per_seed[seed] = measure_seed(root, planted, capability, widths, args.basis)
            for r in per_seed[seed]:
                label = "full" if r["width"] is None else f"w={r['width']}"
                print(f"{scenario} seed {seed} {label:6s} share {r['share']:.4f} ({r['bytes_per_example']:,} B) "
                      f"AUC {r['auc']:.3f} rho {r['rho']:.3f}", flush=True)
        summary = []
        for k, first in enumerate(per_seed[seeds[0]]):
            aucs = [per_seed[s][k]["auc"] for s in seeds]
            rhos = [per_seed[s][k]["rho"] for s in seeds]
            drops = [per_seed[s][0]["auc"] - per_seed[s][k]["auc"] for s in seeds]
            summary.append({"width": first["width"], "share": first["share"],
                            "bytes_per_example": first["bytes_per_example"],
                            "auc_median": float(np.median(aucs)), "auc_range": [min(aucs), max(aucs)],
                            "auc_drop_median": float(np.median(drops)), "auc_drop_range": [min(drops), max(drops)],
                            "rho_median": float(np.median(rhos)), "rho_range": [min(rhos), max(rhos)]})
        report[scenario] = {"seeds": per_seed, "summary": summary}
        print(f"\n{scenario}: {len(seeds)} seeds")
        for s in summary:
            label = "full" if s["width"] is None else f"w={s['width']}"
            print(f"  {label:6s} share {s['share']:.4f}  AUC median {s['auc_median']:.3f} "
                  f"[{s['auc_range'][0]:.3f}, {s['auc_range'][1]:.3f}]  drop vs full median "
                  f"{s['auc_drop_median']:+.3f} [{s['auc_drop_range'][0]:+.3f}, {s['auc_drop_range'][1]:+.3f}]  "
                  f"rho median {s['rho_median']:.3f} [{s['rho_range'][0]:.3f}, {s['rho_range'][1]:.3f}]", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
