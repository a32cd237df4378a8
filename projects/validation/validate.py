"""The validation suite on tinyworld: ``python validate.py {poison,badconfig,counterfactual,accused,fidelity,all}``.

Each experiment writes ``<workdir>/<experiment>/verdict.json`` (PASS, FAIL or INCONCLUSIVE, the
reason, the figures) and logs a run to MLflow. ``all`` runs the five in order under one parent
run and writes ``<workdir>/suite.json`` with every status and the wall times. ``--quick`` is the
CI-sized variant of each (see each module's docstring). The exit code is 0 unless an experiment
FAILs (1); INCONCLUSIVE exits 0 but says so.

    python projects/validation/validate.py all            # the whole suite
    python projects/validation/validate.py all --quick    # the CI smoke run
    python projects/validation/validate.py fidelity --scenario bestiary_poison_diets   # the other world
    mlflow run projects/validation -e fidelity --env-manager local
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the experiment modules beside this file

EXPERIMENTS = ("poison", "badconfig", "counterfactual", "accused", "fidelity")


def _bool(value: str) -> bool:
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _count(value: str) -> int:
    """A whole number; MLproject float parameters arrive as e.g. ``48.0``."""
    number = float(value)
    if number < 0 or not number.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value!r}")
    return int(number)


def _whole_numbers(parser: argparse.ArgumentParser, flag: str, text: str, unit: str, example: str) -> list[int]:
    """``text`` (comma-separated) as whole numbers of at least 1, or exit 2 naming ``flag``."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        parser.error(f"{flag} {text!r}: give whole numbers of {unit}, at least 1, separated by commas, e.g. {example}")
    return values


def _module(name: str):
    import importlib

    return importlib.import_module({"counterfactual": "recovery"}.get(name, name))


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="validate.py", description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=(*EXPERIMENTS, "all"))
    parser.add_argument("--quick", nargs="?", const=True, default=False, type=_bool,
                        help="CI-sized runs (also accepts --quick true/false, for MLproject parameters)")
    parser.add_argument("--workdir", default=".gradian/validation", help="Scenarios, fine-tunes, reports and verdicts")
    parser.add_argument("--fresh", nargs="?", const=True, default=False, type=_bool,
                        help="Delete the work folder first, so nothing is reused")
    parser.add_argument("--subsets", type=_count, default=0, help="fidelity: number of half-subset retrains (0: the mode's default)")
    parser.add_argument("--workers", type=_count, default=0, help="fidelity: parallel retrains (0: up to 2, one per core)")
    parser.add_argument("--scenario", default="poison_capitals",
                        help="fidelity: the poison scenario, of either world (poison_capitals, bestiary_poison_diets); "
                             "accused: a poison scenario with planted rows (accused.SCENARIOS)")
    parser.add_argument("--loco", nargs="?", const=True, default=None, type=_bool,
                        help="fidelity: leave-one-cluster-out retrains (default: on, off with --quick)")
    parser.add_argument("--seeds", default="", help="accused: comma-separated fine-tune seeds; each is fine-tuned "
                        "and attributed with every default and the capability retrained back round by round "
                        "(medians over seeds decide)")
    parser.add_argument("--replay-horizons", default="", help="fidelity: the replay scored again at each of these "
                        "horizons (optimizer steps from the end, comma-separated), as engines replay_h<steps>")
    parser.add_argument("--replay-scalings", default="", help="fidelity: the replay scored again under each of these "
                        "engine.replay_scaling values (exact, held; comma-separated), as engines replay_<scaling>")
    parser.add_argument("--factor-rows", default="", help="fidelity: EK-FAC scored again with its Kronecker factors "
                        "summed over about each of these many rows (engine.factor_rows; comma-separated), as engines "
                        "ekfac_rows<N>")
    parser.add_argument("--correction-rows", default="", help="fidelity: EK-FAC scored again with its eigenvalue "
                        "correction averaged over about each of these many rows (engine.correction_rows; "
                        "comma-separated), as engines ekfac_correction<N>")
    parser.add_argument("--fine-tune-seed", type=int, default=None,
                        help="fidelity: the seed of the reference fine-tune and every retrain (default: the scenario's)")
    parser.add_argument("--no-mlflow", action="store_true", help="Write verdict.json only; log nothing to MLflow")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give whole numbers separated by commas, e.g. 0,1,2")
    horizons = _whole_numbers(parser, "--replay-horizons", args.replay_horizons, "steps", "282,318")
    factor_rows = _whole_numbers(parser, "--factor-rows", args.factor_rows, "rows", "212,424")
    correction_rows = _whole_numbers(parser, "--correction-rows", args.correction_rows, "rows", "212,424")
    if args.fine_tune_seed is not None and args.fine_tune_seed < 0:
        parser.error(f"--fine-tune-seed {args.fine_tune_seed}: give a seed of 0 or more")
    scalings = [s.strip() for s in args.replay_scalings.split(",") if s.strip()]
    from gradian.replay.unrolled import SCALINGS

    if any(s not in SCALINGS for s in scalings):
        parser.error(f"--replay-scalings {args.replay_scalings!r}: give values among {', '.join(SCALINGS)}, "
                     "separated by commas")
    from fidelity import WORLD_RULES
    from gradian.errors import ConfigError
    from gradian.tinyworld.worlds import scenario_world

    try:
        world = scenario_world(args.scenario).name
    except ConfigError as exc:
        parser.error(str(exc))
    if world not in WORLD_RULES:
        parser.error(f"--scenario {args.scenario}: fidelity declares no clusters for the {world} world")
    if args.experiment == "accused":
        from accused import SCENARIOS as ACCUSED_SCENARIOS

        if args.scenario not in ACCUSED_SCENARIOS:
            parser.error(f"--scenario {args.scenario}: accused measures a poison scenario with planted rows, one of "
                         f"{', '.join(ACCUSED_SCENARIOS)}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    from tracking import log_result, suite_run
    from verdicts import combine_verdicts
    from workspace import Workspace

    workdir = Path(args.workdir).resolve()
    if args.fresh and workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    ws = Workspace(workdir, log=_say)
    names = EXPERIMENTS if args.experiment == "all" else (args.experiment,)
    options = {"quick": args.quick, "subsets": args.subsets or None, "workers": args.workers or None,
               "scenario": args.scenario, "leave_one_out": args.loco, "seeds": seeds or None,
               "replay_horizons": horizons, "fine_tune_seed": args.fine_tune_seed, "replay_scalings": scalings,
               "factor_rows": factor_rows, "correction_rows": correction_rows}
    started = time.time()
    results = []

    def run_one(name: str, nested: bool):
        _say(f"experiment {name}{' (quick)' if args.quick else ''}")
        result = _module(name).run(ws, **options)
        v = result.verdict
        _say(f"{name}: {v.status} in {v.seconds:.0f} s. {v.reason}")
        if not args.no_mlflow:
            run_id = log_result(result, nested=nested)
            _say(f"{name}: logged to MLflow run {run_id}")
        results.append(result)

    if args.experiment == "all" and not args.no_mlflow:
        with suite_run(args.quick) as parent:
            for name in names:
                run_one(name, nested=True)
            _finish(ws, results, started, args.quick, parent)
    else:
        for name in names:
            run_one(name, nested=False)
        if args.experiment == "all":
            _finish(ws, results, started, args.quick, None)
    status, _ = combine_verdicts([r.verdict for r in results])
    return 1 if status == "FAIL" else 0


def _finish(ws, results, started: float, quick: bool, parent) -> None:
    """``suite.json`` and, under MLflow, the suite's own metrics."""
    import platform

    from verdicts import combine_verdicts

    status, summary = combine_verdicts([r.verdict for r in results])
    wall = round(time.time() - started, 1)
    suite = {"status": status, "summary": summary, "quick": quick, "wall_seconds": wall,
             "cpus": os.cpu_count(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
             "python": platform.python_version(),
             "experiments": {r.verdict.experiment: {"status": r.verdict.status, "seconds": r.verdict.seconds,
                                                    "reason": r.verdict.reason} for r in results}}
    path = ws.write_json(ws.root / "suite.json", suite)
    _say(f"suite: {status} in {wall:.0f} s ({summary}); {path}")
    if parent is not None:
        import mlflow

        mlflow.set_tags({"validation.status": status, "mlflow.note.content": summary})
        mlflow.log_metrics({"validation.wall_seconds": wall,
                            "validation.pass": {"PASS": 1.0, "FAIL": 0.0}.get(status, -1.0)})
        mlflow.log_artifact(str(path), artifact_path="validation")


if __name__ == "__main__":
    sys.exit(main())
