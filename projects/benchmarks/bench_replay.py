"""The replay engine beside EK-FAC: planted-row AUC at several horizons, fidelity, cost in training runs.

For each scenario and fine-tune seed (the fine-tunes of ``bench_accused.py``, declared clusters
removed, cached in ``--work``), ``gradian attribute`` runs with the contrastive query and no
cross-check under:

- ``ekfac`` (the default engine) and ``graddot`` (the cheapest: its wall time is the lane's cost
  without an engine: audit, eval, index read, clustering);
- ``replay`` at each ``--horizons`` value (optimizer steps from the end, or ``<x>epochs`` for x
  times the scenario's steps per epoch, rounded; ``epoch`` is the default,
  the last epoch; ``all`` every step).

Per run it prints the AUC of the planted rows against the clean ones (harm = minus what the report
ranks by: EK-FAC's RelatIF order, beside its raw influence as ``ekfac_auc_influence``; the replay's
scores, which it ranks by), the replay's
fidelity (relative difference of the replayed adapter from the run's) and its cost: the wall time
of the replay attribution minus the graddot one, over the wall time of one ``gradian train`` of
the same fine-tune (timed here, into a scratch folder). Medians and ranges over seeds close it.

``--checkpoints`` fine-tunes each run keeping a trainer checkpoint (LoRA tensors and optimizer
state) at the end of every epoch, so the replay starts from the run's own state before the
differentiated steps (``engine.replay_start: auto``) instead of retraining every step; the runs
are otherwise the same (their folders end in ``-ckpt``). ``--starts auto,beginning`` replays each
run both ways (the results then key each horizon as ``<horizon>/<start>``). ``--scalings
exact,held`` replays each under both ``engine.replay_scaling`` values (keys ending ``/<scaling>``).

Run: ``python projects/benchmarks/bench_replay.py [--work DIR] [--scenarios a,b] [--seeds 0,1]
[--horizons epoch,all] [--checkpoints] [--starts auto,beginning] [--scalings exact,held] [--no-cost]
[--out results.json]``.
``--no-cost`` leaves out the timed ``gradian train`` and the ``graddot`` attribution (AUCs and
fidelity only, for sweeps over seeds and horizons). On 2 CPU cores a replay of a tinyworld fine-tune
(848 steps) takes two to five minutes, an EK-FAC attribution about ten seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_accused import prepare_run  # noqa: E402

SCENARIOS = ("poison_capitals", "bestiary_poison_diets")


def _auc(rankings: Any, planted: set[int], column: str | None = None) -> float:
    """ROC AUC of the planted rows against the clean ones, harm = minus what the report ranks by
    (``rank_values``: EK-FAC's RelatIF order, the replay's scores), or minus ``column``."""
    from sklearn.metrics import roc_auc_score

    from gradian.attribution.pipeline import rank_values

    labels = rankings["row_index"].isin(planted).to_numpy()
    values = rank_values(rankings) if column is None else rankings[column].to_numpy(dtype=np.float64)
    return float(roc_auc_score(labels, -values))


def _horizon_steps(horizon: str, epoch_steps: int) -> int | None:
    """``engine.replay_horizon`` for a ``--horizons`` value: None for ``epoch`` (the default)."""
    if horizon == "epoch":
        return None
    if horizon == "all":
        return 10**9
    if horizon.endswith("epochs"):
        return max(1, round(float(horizon.removesuffix("epochs")) * epoch_steps))
    return int(horizon)


def _attribute(root: Path, capability: str, engine: str, horizon: int | None = None,
               start: str = "auto", scaling: str | None = None) -> tuple[Any, float]:
    from gradian.attribution import run_attribution
    from gradian.config import load_config

    overrides: dict[str, Any] = {"cache_dir": str(root / ".gradian"), "device": "cpu", "engine.name": engine,
                                 "evaluation.query_signal": "contrastive"}
    if engine == "replay" and horizon is not None:
        overrides["engine.replay_horizon"] = horizon
    if engine == "replay":
        overrides["engine.replay_start"] = start
        if scaling is not None:
            overrides["engine.replay_scaling"] = scaling
    cfg = load_config(root / "gradian.yaml", overrides)
    started = time.perf_counter()
    outcome = run_attribution(cfg, capability=capability, cross_check="none")
    return outcome, time.perf_counter() - started


def _train_seconds(root: Path) -> float:
    from gradian.config import load_config
    from gradian.train import train_lora

    scratch = Path(tempfile.mkdtemp(prefix="bench-replay-train-"))
    try:
        started = time.perf_counter()
        train_lora(load_config(root / "gradian.yaml"), scratch / "run", overwrite=True)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _epoch_steps(scenario: str) -> int:
    """Optimizer steps in one epoch of ``scenario``'s fine-tune (its rows over the step's rows)."""
    import math

    from gradian.config import load_config
    from gradian.tinyworld import write_scenario

    with tempfile.TemporaryDirectory(prefix="bench-replay-rows-") as scratch:
        write_scenario(scenario, Path(scratch))
        train = load_config(Path(scratch) / "gradian.yaml").train
        rows = sum(1 for line in (Path(scratch) / "train.jsonl").read_text().splitlines() if line.strip())
    return math.ceil(rows / (train.per_device_train_batch_size * train.gradient_accumulation_steps))


def replay_run(work: Path, scenario: str, seed: int, checkpoints: bool) -> tuple[Path, set[int], str]:
    """``bench_accused.prepare_run``'s fine-tune of ``scenario`` under ``seed``; with ``checkpoints``
    one keeping a trainer checkpoint at the end of every epoch (its folder ends in ``-ckpt``)."""
    keep = {"train.save_checkpoints": True, "train.save_steps": _epoch_steps(scenario)} if checkpoints else None
    return prepare_run(work, scenario, seed, keep, "-ckpt" if keep else "")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The fine-tunes a replay benchmark reads: ``--work`` (where they are cached), ``--scenarios``, ``--seeds``."""
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gradian-bench-replay")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seeds", default="0")


def _keys(args: argparse.Namespace) -> list[tuple[str, str, str, str | None]]:
    """The replays of each run, ``(key, horizon, start, scaling)``: the key is the horizon, then
    ``/<start>`` when other starts than ``auto`` are asked for, then ``/<scaling>`` when
    ``--scalings`` is given."""
    starts = args.starts.split(",")
    scalings: list[str | None] = [s for s in args.scalings.split(",") if s] or [None]
    out = []
    for h in args.horizons.split(","):
        for s in starts:
            for scaling in scalings:
                key = h if len(starts) == 1 and starts[0] == "auto" else f"{h}/{s}"
                out.append((key if scaling is None else f"{key}/{scaling}", h, s, scaling))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--horizons", default="epoch")
    parser.add_argument("--checkpoints", action="store_true",
                        help="keep a trainer checkpoint every epoch, so the replay starts from the run's own state")
    parser.add_argument("--starts", default="auto", help="engine.replay_start values, comma-separated")
    parser.add_argument("--scalings", default="", help="engine.replay_scaling values, comma-separated "
                        "(default: the configured one)")
    parser.add_argument("--no-cost", action="store_true",
                        help="AUCs and fidelity only: no timed gradian train and no graddot attribution")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results: list[dict[str, Any]] = []
    for scenario in args.scenarios.split(","):
        epoch_steps = _epoch_steps(scenario)
        for seed in [int(s) for s in args.seeds.split(",")]:
            root, planted, capability = replay_run(args.work, scenario, seed, args.checkpoints)
            train_s = None if args.no_cost else _train_seconds(root)
            ekfac, ekfac_s = _attribute(root, capability, "ekfac")
            graddot_s = None if args.no_cost else _attribute(root, capability, "graddot")[1]
            row: dict[str, Any] = {"scenario": scenario, "seed": seed,
                                   "train_seconds": None if train_s is None else round(train_s, 1),
                                   "ekfac_auc": round(_auc(ekfac.rankings, planted), 4),
                                   "ekfac_auc_influence": round(_auc(ekfac.rankings, planted, "score"), 4),
                                   "ekfac_seconds": round(ekfac_s, 1), "replay": {}}
            for horizon, steps, start, scaling in _keys(args):
                outcome, seconds = _attribute(root, capability, "replay", _horizon_steps(steps, epoch_steps), start,
                                              scaling)
                params = outcome.report.to_json()["manifest"]["engine_state"]["params"]
                row["replay"][horizon] = {
                    "auc": round(_auc(outcome.rankings, planted), 4),
                    "steps": params.get("replay_steps"), "horizon_steps": params.get("replay_horizon"),
                    "start_step": params.get("replay_start_step"),
                    "fidelity_rel_diff": params.get("replay_fidelity_rel_diff"),
                    "seconds": round(seconds, 1),
                    "training_runs": None if train_s is None or graddot_s is None
                    else round((seconds - graddot_s) / train_s, 2),
                }
            print(json.dumps(row), flush=True)
            results.append(row)
    print("\nmedian [min, max] over seeds:")
    for scenario in args.scenarios.split(","):
        rows = [r for r in results if r["scenario"] == scenario]
        ek = [r["ekfac_auc"] for r in rows]
        print(f"{scenario}: ekfac auc {np.median(ek):.3f} [{min(ek):.3f}, {max(ek):.3f}]")
        for horizon, *_ in _keys(args):
            auc = [r["replay"][horizon]["auc"] for r in rows]
            cost = [r["replay"][horizon]["training_runs"] for r in rows if r["replay"][horizon]["training_runs"] is not None]
            priced = f", cost {np.median(cost):.2f} [{min(cost):.2f}, {max(cost):.2f}] training runs" if cost else ""
            print(f"  replay horizon {horizon}: auc {np.median(auc):.3f} [{min(auc):.3f}, {max(auc):.3f}]{priced}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
