"""LDS of engine settings against the half-subset retrains a fidelity run already made.

``validate.py fidelity --subsets K`` retrains on K random halves of the training rows and measures
the query loss of each; the LDS of an engine is the Spearman correlation between those losses and
the losses its scores predict for each half. Retraining is the expensive part, and it does not
depend on the engine, so this benchmark scores the same fine-tune under other settings (an
``engine.*`` mode per ``--mode``) and computes their LDS against the retrains on disk, with the
same bootstrap as the fidelity experiment. Nothing is retrained. The LDS is of the scores (the
influence, in loss units); when the rows are ordered by something else (EK-FAC's RelatIF ranking,
``rank_score``), the LDS of those ranking values is listed too, as ``<mode> (ranking)``.

A mode is ``+``-separated ``key=value`` engine settings: ``default`` (the config as it is),
``normalize_train=none``, ``checkpoints=all``, ``checkpoints=all+normalize_train=relatif``,
``name=datainf``. The fidelity run must have saved its reference run's checkpoints for
``checkpoints=all`` to differ from the final adapter.

Run: ``python projects/benchmarks/bench_lds_modes.py --workdir W --scenario poison_capitals
--mode default --mode normalize_train=relatif [--out lds.json]`` after ``python
projects/validation/validate.py fidelity --workdir W --scenario poison_capitals --subsets 64``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np


#: where validate.py keeps its work when no --workdir is given
DEFAULT_WORKDIR = ".gradian/validation"


class NoFidelityRun(Exception):
    """The work folder holds no finished fidelity run of the scenario."""


def mode_overrides(mode: str) -> dict[str, str]:
    """``checkpoints=all+normalize_train=relatif`` -> ``{"engine.checkpoints": "all", ...}``."""
    if mode == "default":
        return {}
    out = {}
    for part in mode.split("+"):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise SystemExit(f"--mode {mode!r}: write engine settings as key=value joined by '+'")
        out[f"engine.{key}"] = value
    return out


def measure(workdir: Path, scenario: str, modes: list[str]) -> dict[str, Any]:
    from gradian.attribution import rank_values, run_attribution
    from gradian.config import load_config
    from gradian.counterfactual.datamodel import lds_table, sample_subsets
    from gradian.report.schema import Report

    root = workdir / "scenarios" / f"fidelity-{scenario}"
    reference, data = root / "fidelity" / "run", root / "fidelity" / "train.jsonl"
    verdicts = sorted(workdir.glob("fidelity*/verdict.json"))
    if not verdicts or not data.is_file():
        raise NoFidelityRun(f"{workdir}: no fidelity run of {scenario} there; run projects/validation/validate.py "
                            f"fidelity --workdir {workdir} --scenario {scenario} first")
    params = json.loads(verdicts[0].read_text())["params"]
    k, seed = int(params["subsets"]), int(params["seed"])
    n = sum(1 for line in data.read_text().splitlines() if line.strip())
    masks = sample_subsets(n, k, seed=seed)
    retrains = root / "fidelity" / "retrains"
    losses = [json.loads((retrains / f"subset-{i:03d}" / "result.json").read_text())["query_loss"] for i in range(k)]
    capability = json.loads((root / "scenario.json").read_text())["capability"]["name"]
    base = {"cache_dir": str(workdir / "cache"), "dataset": str(data), "run": str(reference),
            "adapter_path": str(reference / "adapter"), "clustering.method": "declared"}
    scores, runs = {}, {}
    for mode in modes:
        cfg = load_config(root / "gradian.yaml", overrides={**base, **mode_overrides(mode)})
        started = time.perf_counter()
        outcome = run_attribution(cfg, capability=capability, cross_check=None)
        seconds = time.perf_counter() - started
        rankings = outcome.rankings
        if not (rankings["row_index"].to_numpy() == np.arange(n)).all():
            raise SystemExit("the rankings are not in row order; cannot pair them with the subsets")
        scores[mode] = rankings["score"].to_numpy(dtype=np.float64)
        if "rank_score" in rankings.columns:  # EK-FAC's RelatIF order: how well the ranking values predict, too
            scores[f"{mode} (ranking)"] = rank_values(rankings)
        attribution = Report.of(outcome.report).attribution
        runs[mode] = {"seconds": round(seconds, 1), "query_signal": attribution.query_signal if attribution else None}
        print(f"  {mode}: scored in {seconds:.0f} s", flush=True)
    table = lds_table(losses, masks, scores, n_bootstrap=2000, seed=seed)
    return {"scenario": scenario, "subsets": k, "table": table, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help=f"the validate.py --workdir of a finished fidelity run (default: {DEFAULT_WORKDIR}, "
                        "where it is skipped when no fidelity run is there, as under run_all.py)")
    parser.add_argument("--scenario", default="poison_capitals")
    parser.add_argument("--mode", action="append", default=[], help="engine settings to score (repeatable)")
    parser.add_argument("--out", help="also write the figures here as JSON")
    args = parser.parse_args()
    try:
        result = measure(Path(args.workdir or DEFAULT_WORKDIR), args.scenario, args.mode or ["default"])
    except NoFidelityRun as err:
        if args.workdir:
            parser.exit(2, f"error: {err}\n")
        print(f"skipped: {err}")
        return
    for mode, row in result["table"]["engines"].items():
        low, high = row["ci"]
        run = result["runs"][mode.removesuffix(" (ranking)")]
        print(f"{mode:45s} LDS {row['spearman']:+.3f} [{low:+.3f}, {high:+.3f}]  {run}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
