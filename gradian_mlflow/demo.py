"""The demo: a poisoned fine-tune logged to MLflow, then diagnosed and attributed as child runs.

Runs on the embedded store (``sqlite:///mlflow.db`` in the working directory) unless
``MLFLOW_TRACKING_URI`` says otherwise. Every step is a real command a user would run:

1. build (or reuse) the tinyworld base model, a tiny Llama trained locally on a synthetic world;
2. write the ``poison_capitals`` scenario: ~800 clean rows plus planted wrong capitals;
3. fine-tune a LoRA adapter with the HF Trainer, logged to MLflow by its MLflowCallback (the
   experiment, created here, is tagged as a model-training experiment);
4. ``gradian diagnose --mlflow-run <id>``: the audit, logged as a child run;
5. ``gradian attribute --mlflow-run <id>``: evaluation, attribution and the report, logged as a
   child run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_demo"]

EXPERIMENT = "gradian-demo"


def _say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def _gradian(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gradian", *args], check=True)


def run_demo(workdir: str | Path = ".demo", scenario: str = "poison_capitals") -> str:
    """Run the whole demo; returns the training run id."""
    import mlflow

    from gradian.redact import redact
    from gradian.tinyworld import ensure_base_model
    from gradian.tinyworld import write_scenario
    from gradian_mlflow.experiment import training_view_url
    from gradian_mlflow.training import train_and_log

    started = time.time()
    work = Path(workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    mlflow.set_tracking_uri(uri)

    _say("tinyworld base model (built once, then cached; a few minutes the first time)")
    base = ensure_base_model(verbose=True)
    print(f"base model: {base}")

    _say(f"scenario '{scenario}'")
    info = write_scenario(scenario, work / "scenario", base_model=base)
    planted = info.get("planted") or {}
    print(f"{info['n_train']} training rows, {planted.get('n', 0)} of them planted; eval: {info['capability']}")

    _say("fine-tuning a LoRA adapter with the HF Trainer, logged to MLflow")
    run_id = train_and_log(work / "scenario" / "gradian.yaml", work / "run", experiment=EXPERIMENT,
                           run_name=f"finetune-{scenario}")
    print(f"training run: {run_id}")

    # The diagnosis reads adapter, data, params and logs from MLflow: keep the scenario's settings
    # (metric, clustering, thresholds) but none of its local paths to the run.
    config = str(_diagnosis_config(work / "scenario" / "gradian.yaml", work / "diagnosis.yaml"))
    _say("gradian diagnose (the audit; no weights loaded)")
    _gradian("diagnose", "--mlflow-run", run_id, "--config", config, "--out", str(work / "diagnose"))

    _say("gradian attribute (evaluate, gate, index, query, score, cluster, report)")
    _gradian("attribute", "--mlflow-run", run_id, "--config", config, "--capability", "capitals",
             "--out", str(work / "report"))

    minutes = (time.time() - started) / 60
    _say(f"done in {minutes:.1f} minutes")
    print(f"report: {work / 'report' / 'report.html'}")
    experiment_id = mlflow.get_run(run_id).info.experiment_id
    if uri.startswith(("http://", "https://")):
        print(f"see the runs: {training_view_url(redact(uri), experiment_id, run_id)}")
    else:
        print(f"see the runs: mlflow ui --backend-store-uri {redact(uri)}   (experiment '{EXPERIMENT}')")
        print(f"then open {training_view_url('http://127.0.0.1:5000', experiment_id, run_id)}")
    return run_id


def _diagnosis_config(scenario_config: Path, out: Path) -> Path:
    import yaml

    data = yaml.safe_load(scenario_config.read_text())
    for key in ("adapter_path", "run", "dataset"):
        data.pop(key, None)
    data["cache_dir"] = str(out.parent / ".gradian")
    out.write_text("# The demo's diagnosis settings: the run itself comes from MLflow.\n" + yaml.safe_dump(data, sort_keys=False))
    return out
