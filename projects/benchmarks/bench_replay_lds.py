"""The replay against its own counterfactual: LDS over weighted replays that drop a share of the rows.

The fidelity experiment (``projects/validation/validate.py fidelity``) retrains half subsets with
the trainer: each retrain sees other batches, fewer steps and its own rounding, and the spread of
one subset's loss under other seeds caps what any score can predict. The replay differentiates
another, deterministic counterfactual: the same run, in the same order and batches, with some
rows' weights set to 0 in its window (the last epoch by default) and every other step as it was.
This benchmark measures how well each engine predicts that counterfactual, where no seed noise
enters (the ceiling is 1):

- each scenario and fine-tune seed is ``bench_accused.py``'s fine-tune keeping a trainer
  checkpoint every epoch (as ``bench_replay.py --checkpoints`` makes it, cached in ``--work``),
  attributed with the contrastive query under ``replay`` (the defaults: the last epoch, started
  from the run's checkpoint), ``ekfac`` and ``tracin``;
- for each ``--drops`` share ``p``, ``--subsets`` random sets ``D`` of ``round(p * rows)`` trained
  rows are dropped: the run is replayed with weight 0 on ``D`` over the replay's window
  (``gradian.replay.replay(..., horizon=...)``, from the same checkpoint) and the query measurement
  taken after it, minus the measurement of the unweighted replay, is the ground truth;
- ``--counterfactual run`` drops ``D`` from every step instead, replaying from the first step (the
  removal MAGIC's single-model setting measures; a whole training run per subset);
- LDS: the Spearman correlation over the subsets of the measured change with each engine's
  prediction ``sum_{j in D} score_j / n`` (the sign convention: a positive score lowered the
  query loss, so dropping it raises the loss), with 95% bootstrap intervals, and the replay minus
  EK-FAC on the same resamples.

Run: ``python projects/benchmarks/bench_replay_lds.py [--work DIR] [--scenarios a,b] [--seeds 0]
[--drops 0.01,0.05,0.5] [--subsets 32] [--counterfactual window|run] [--out results.json]``.
A ground-truth replay of the window costs about a quarter of a training run of these worlds (4
epochs); one of the whole run about one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import _attribute, add_run_arguments, replay_run  # noqa: E402

ENGINES = ("replay", "ekfac", "tracin")


def _capture_replay_inputs() -> dict[str, Any]:
    """Have the replay engine hand out what it scored with (its inputs, query items and signal)."""
    from gradian.replay import engine as replay_engine

    captured: dict[str, Any] = {}
    score = getattr(replay_engine.ReplayEngine.score, "unwrapped", replay_engine.ReplayEngine.score)

    def scoring(self: Any, state: Any, query: Any, config: Any, query_items: Any = (), query_signal: str = "target",
                progress: Any = None, **context: Any) -> Any:
        captured.update(inputs=state.extra["inputs"], items=list(query_items), signal=query_signal)
        return score(self, state, query, config, query_items=query_items, query_signal=query_signal,
                     progress=progress, **context)

    scoring.unwrapped = score  # type: ignore[attr-defined]
    replay_engine.ReplayEngine.score = scoring  # type: ignore[method-assign]
    return captured


def _measured(inputs: Any, measure: Any, weights: Any, whole_run: bool) -> float:
    """The query measurement after the run replayed with ``weights``: over the replay's window from
    its start, or (``whole_run``) over every step from the first."""
    import torch

    from gradian.replay import replay
    from gradian.replay.unrolled import ReplayedModel

    if whole_run:
        final = replay(inputs.model, inputs.init, inputs.rows, inputs.run_recipe.batches, weights,
                       inputs.run_recipe.recipe, pad_id=inputs.pad_id)
    else:
        final = replay(inputs.model, inputs.first_params, inputs.rows, inputs.run_recipe.batches, weights,
                       inputs.run_recipe.recipe, pad_id=inputs.pad_id, start=inputs.start, horizon=inputs.window)
    with torch.no_grad():
        return float(measure(ReplayedModel(inputs.model, final)))


def _rounded(value: Any) -> Any:
    """``value`` with every float rounded to 4 places (lists and dicts walked), for printing."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def run_one(work: Path, scenario: str, seed: int, drops: list[float], subsets: int, whole_run: bool,
            boot: dict[str, int]) -> dict[str, Any]:
    import torch

    from gradian.counterfactual import lds_difference, lds_table
    from gradian.replay.engine import query_measure

    torch.set_num_threads(1)
    root, _, capability = replay_run(work, scenario, seed, checkpoints=True)
    captured = _capture_replay_inputs()
    outcomes = {engine: _attribute(root, capability, engine)[0] for engine in ENGINES}
    inputs, items, signal = captured["inputs"], captured["items"], captured["signal"]
    measure = query_measure(inputs, items, signal)
    n = inputs.n_examples
    scores = {}
    for engine, outcome in outcomes.items():
        ranked = outcome.rankings.sort_values("row_index")
        if not (ranked["row_index"].to_numpy() == np.arange(n)).all():
            raise RuntimeError(f"{engine}: rankings are not one per row; the subset sums would be misaligned")
        scores[engine] = ranked["score"].to_numpy(dtype=np.float64)
    dtype = next(iter(inputs.lora_params.values())).dtype
    trained = np.asarray(inputs.positions, dtype=np.int64)
    ones = torch.ones(len(inputs.rows), dtype=dtype)
    started = time.perf_counter()
    base = _measured(inputs, measure, ones, whole_run)
    seconds = time.perf_counter() - started
    out: dict[str, Any] = {"scenario": scenario, "seed": seed, "rows": n, "trained_rows": len(trained),
                           "counterfactual": "run" if whole_run else "window",
                           "steps": inputs.run_recipe.steps,
                           "weighted_steps": inputs.run_recipe.steps if whole_run else inputs.window,
                           "start_step": 0 if whole_run else inputs.start_step,
                           "unweighted_measurement": base, "seconds_per_replay": round(seconds, 1), "drops": {}}
    rng = np.random.default_rng(seed)
    for p in drops:
        k = max(1, int(round(p * len(trained))))
        masks = np.ones((subsets, n), dtype=bool)
        losses = []
        for s in range(subsets):
            dropped = rng.choice(len(trained), size=k, replace=False)
            weights = ones.clone()
            weights[torch.as_tensor(dropped)] = 0.0
            masks[s, trained[dropped]] = False
            losses.append(_measured(inputs, measure, weights, whole_run) - base)
        table = lds_table(losses, masks, scores, **boot)
        out["drops"][str(p)] = {
            "rows_dropped": k, "measured_change_sd": round(float(np.std(losses, ddof=1)), 6),
            "lds": {e: _rounded({"spearman": v["spearman"], "ci": v["ci"]}) for e, v in table["engines"].items()},
            "replay_minus_ekfac": _rounded(lds_difference(losses, masks, scores["replay"], scores["ekfac"], **boot)),
        }
        print(json.dumps({"scenario": scenario, "seed": seed, "drop": p, **out["drops"][str(p)]}), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--drops", default="0.01,0.05,0.5", help="shares of the trained rows dropped, comma-separated")
    parser.add_argument("--subsets", type=int, default=32, help="random subsets per share")
    parser.add_argument("--counterfactual", choices=("window", "run"), default="window",
                        help="drop the rows in the replay's window (from its checkpoint) or in every step")
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        drops = [float(s) for s in args.drops.split(",") if s.strip()]
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error("--drops takes shares such as 0.01,0.05 and --seeds whole numbers such as 0,1")
    if not drops or any(not 0 < p < 1 for p in drops):
        parser.error(f"--drops {args.drops!r}: give shares strictly between 0 and 1")
    if args.subsets < 4:
        parser.error(f"--subsets {args.subsets}: at least 4 subsets per share")
    results = [run_one(args.work, scenario, seed, drops, args.subsets, args.counterfactual == "run",
                       {"n_bootstrap": args.bootstrap, "seed": 0})
               for scenario in args.scenarios.split(",") for seed in seeds]
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
