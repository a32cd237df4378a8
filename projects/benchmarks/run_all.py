"""Run every benchmark in this folder (and the demo), and log every figure to MLflow.

Each ``bench_*.py`` beside this file runs in its own process from the repository root. A script
that takes ``--out`` writes its figures as JSON there; otherwise its output is read: a JSON
document if it printed one, else every ``label: number [unit]`` pair and ``N thing/second`` rate
in its lines. The demo (``python -m gradian_mlflow.entry demo``) is timed end to end on a
throwaway MLflow store. Everything lands in one MLflow run (experiment ``gradian-benchmarks``, or
the project's run under ``mlflow run``): metrics ``<script>.<figure>`` and ``<script>.wall_seconds``,
each script's output and JSON as artifacts, and ``results.json`` with it all.

    python projects/benchmarks/run_all.py [--quick] [--only bench_grads] [--skip-demo] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
EXPERIMENT_NAME = "gradian-benchmarks"
#: extra arguments for --quick, for scripts whose size flag is not --quick
QUICK_ARGS = {"bench_diagnose": ["--rows", "2000"]}

_PAIR = re.compile(r"([A-Za-z][A-Za-z0-9_ ./()=-]*?)\s*:\s*(-?[\d,]*\.?\d+(?:[eE][-+]?\d+)?)\s*(ms|s|%|MB|GB|KB|B)?(?![\w/])")
_RATE = re.compile(r"(-?[\d,]*\.?\d+)\s+([A-Za-z]+)/(second|s)\b")
_TIMING = re.compile(r"^\s+([\w.:-]+)\s+(-?\d+\.?\d*)\s*(ms|s)\s*$")


def discover() -> list[Path]:
    return sorted(p for p in HERE.glob("bench_*.py") if p.is_file())


def _slug(text: str) -> str:
    return re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9_./-]", "_", text.strip().lower())).strip("_")


def flatten_numbers(data: Any, prefix: str = "") -> dict[str, float]:
    """Finite numbers in nested dicts and short lists, keyed by their dotted path (MLflow-safe)."""
    from gradian.report.tracker import flatten_numbers as flatten

    return flatten(data, prefix, key=_slug, max_list=16)


def _last_json(text: str) -> Any:
    """The last top-level JSON object printed, or None."""
    start = text.rfind("\n{")
    candidates = [text.strip()] + ([text[start + 1:].strip()] if start >= 0 else [])
    for candidate in candidates:
        if candidate.startswith("{"):
            try:
                return json.loads(candidate)
            except json.JSONDecodeError:
                continue
    return None


def figures_from_text(text: str) -> dict[str, float]:
    """``label: number [unit]`` pairs, ``N thing/second`` rates and indented ``name  N s`` timings."""
    figures: dict[str, float] = {}
    for line in text.splitlines():
        timing = _TIMING.match(line)
        if timing:
            figures[f"{_slug(timing.group(1))}_{timing.group(3)}"] = float(timing.group(2))
            continue
        for label, number, unit in _PAIR.findall(line):
            key = _slug(label) + (f"_{unit.lower()}" if unit and unit != "%" else ("_pct" if unit else ""))
            figures[key] = float(number.replace(",", ""))
        for number, thing, _ in _RATE.findall(line):
            figures[f"{_slug(thing)}_per_second"] = float(number.replace(",", ""))
    return figures


def run_script(script: Path, quick: bool, out_dir: Path, timeout: float) -> dict[str, Any]:
    source = script.read_text()
    json_out = out_dir / f"{script.stem}.json"
    cmd = [sys.executable, str(script)]
    if quick and '"--quick"' in source:
        cmd.append("--quick")
    if quick:
        cmd += QUICK_ARGS.get(script.stem, [])
    if '"--out"' in source:
        cmd += ["--out", str(json_out)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as err:
        code, stdout, stderr = -1, err.stdout or "", f"timed out after {timeout:.0f} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    wall = time.time() - started
    (out_dir / f"{script.stem}.stdout.txt").write_text(stdout + ("\n--- stderr ---\n" + stderr[-20000:] if stderr else ""))
    data = None
    if code == 0 and json_out.is_file():
        data = json.loads(json_out.read_text())
    elif code == 0:
        data = _last_json(stdout)
    figures = flatten_numbers(data) if isinstance(data, dict) else figures_from_text(stdout)
    if data is not None and not json_out.is_file():
        json_out.write_text(json.dumps(data, indent=2) + "\n")
    return {"script": script.name, "command": " ".join(cmd[1:]), "returncode": code, "wall_seconds": round(wall, 2),
            "figures": figures, "error": stderr.strip().splitlines()[-1] if code != 0 and stderr.strip() else None}


def run_demo(out_dir: Path, timeout: float) -> dict[str, Any]:
    """The demo end to end on a throwaway embedded MLflow store."""
    with tempfile.TemporaryDirectory(prefix="gradian-bench-demo-") as tmp:
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{Path(tmp) / 'mlflow.db'}"}
        env.pop("MLFLOW_RUN_ID", None)  # the demo's runs are its own, not this run's
        cmd = [sys.executable, "-m", "gradian_mlflow.entry", "demo", "--workdir", str(Path(tmp) / "demo")]
        started = time.time()
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout, env=env)
            code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            code, stdout, stderr = -1, "", f"timed out after {timeout:.0f} s"
        wall = time.time() - started
    (out_dir / "demo.stdout.txt").write_text(stdout + ("\n--- stderr ---\n" + stderr[-20000:] if stderr else ""))
    return {"script": "demo", "command": " ".join(cmd[1:4]), "returncode": code, "wall_seconds": round(wall, 2),
            "figures": {}, "error": stderr.strip().splitlines()[-1] if code != 0 and stderr.strip() else None}


def log_to_mlflow(results: dict[str, Any], out_dir: Path, quick: bool) -> str:
    import mlflow

    if not os.environ.get("MLFLOW_RUN_ID") and not (
            os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID")):
        from gradian_mlflow.experiment import use_training_experiment

        use_training_experiment(EXPERIMENT_NAME)  # created as a model-training experiment for the UI
    with mlflow.start_run(run_name="benchmarks" + ("-quick" if quick else "")) as run:
        mlflow.set_tags({"gradian.kind": "benchmarks"})
        # prefixed: under `mlflow run` the entry point's own `quick` parameter is logged already
        mlflow.log_params({"benchmarks.quick": quick, "benchmarks.cpus": os.cpu_count(),
                           "benchmarks.scripts": ",".join(results["runs"])})
        metrics: dict[str, float] = {}
        for name, r in results["runs"].items():
            metrics[f"{name}.wall_seconds"] = r["wall_seconds"]
            metrics[f"{name}.ok"] = float(r["returncode"] == 0)
            for key, value in r["figures"].items():
                metrics[f"{name}.{key}"[:250]] = value
        mlflow.log_metrics(metrics)
        for path in sorted(out_dir.iterdir()):
            if path.is_file():
                mlflow.log_artifact(str(path), artifact_path="benchmarks")
        return run.info.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", nargs="?", const=True, default=False,
                        type=lambda v: str(v).lower() in ("1", "true", "yes", "on"),
                        help="Smaller sizes where a script offers them (also --quick true/false)")
    parser.add_argument("--only", action="append", default=[], help="Run only this script (stem or file name); repeatable")
    parser.add_argument("--skip-demo", action="store_true", help="Do not time the demo")
    parser.add_argument("--timeout", type=float, default=1800, help="Seconds allowed per script")
    parser.add_argument("--out", type=Path, default=None, help="Also write every result as JSON here")
    parser.add_argument("--no-mlflow", action="store_true", help="Print and write only; log nothing")
    args = parser.parse_args(argv)

    scripts = discover()
    if args.only:
        wanted = {Path(o).stem for o in args.only}
        unknown = wanted - {s.stem for s in scripts} - {"demo"}
        if unknown:
            parser.error(f"--only {', '.join(sorted(unknown))}: not a benchmark here ({', '.join(s.stem for s in scripts)}, demo)")
        scripts = [s for s in scripts if s.stem in wanted]
    run_demo_too = not args.skip_demo and (not args.only or "demo" in {Path(o).stem for o in args.only})
    out_dir = Path(tempfile.mkdtemp(prefix="gradian-benchmarks-"))
    results: dict[str, Any] = {"quick": args.quick, "cpus": os.cpu_count(), "runs": {}}
    started = time.time()
    for script in scripts:
        print(f"==> {script.name}", flush=True)
        r = run_script(script, args.quick, out_dir, args.timeout)
        results["runs"][script.stem] = r
        print(f"    {'ok' if r['returncode'] == 0 else 'FAILED: ' + str(r['error'])} in {r['wall_seconds']:.0f} s, "
              f"{len(r['figures'])} figures", flush=True)
    if run_demo_too:
        print("==> demo", flush=True)
        r = run_demo(out_dir, args.timeout)
        results["runs"]["demo"] = r
        print(f"    {'ok' if r['returncode'] == 0 else 'FAILED: ' + str(r['error'])} in {r['wall_seconds']:.0f} s", flush=True)
    results["wall_seconds"] = round(time.time() - started, 2)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not args.no_mlflow:
        run_id = log_to_mlflow(results, out_dir, args.quick)
        print(f"logged to MLflow run {run_id}")
    failed = [k for k, r in results["runs"].items() if r["returncode"] != 0]
    print(f"done in {results['wall_seconds']:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
