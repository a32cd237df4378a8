"""A run as most users have one: TRL's SFTTrainer, conversational prompt-completion rows, the stock
MLflow callback with its defaults (params and metrics only, no artifact), checkpoints in
``output_dir``. Gradian reads it from the run id and the data alone (``tests/plugins/trl_runs.py``
makes it; nothing of Gradian trains it).

Ground truth: the scenario's planted rows (``poison_capitals``: 48 rows teaching wrong capitals)
and the base model's capability. Diagnose runs every tokenizer check with the base taken from the
run's params and, given the adapter folder and the eval set, 39 of the 41 checks; attribute accuses
the planted rows; the counterfactual without the accused rows brings the capability back; and the
MLflow project's attribute entry point does the same from the run id.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
#: the scenario's audit calibration (its effective learning rates are tinyworld's, not a 7B's)
_AUDIT = {key: value for key, value in {
    "reference_effective_lr": 0.004, "lr_high_effective": 0.008, "lr_critical_effective": 0.03,
    "lr_low_effective": 0.0002, "no_warmup_effective_lr": 0.005, "small_batch_effective_lr": 0.004}.items()}


def _gradian(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _config(tmp_path: Path, cache: Path) -> Path:
    import yaml

    path = tmp_path / "gradian.yaml"
    path.write_text(yaml.safe_dump({"audit": _AUDIT, "evaluation": {"metric": "contains", "max_new_tokens": 16},
                                    "device": "cpu", "cache_dir": str(cache)}))
    return path


def test_the_trl_run_holds_params_only_and_names_its_base_and_sft_settings(trl_user_run, tracking):
    from mlflow import MlflowClient

    from gradian_mlflow.source import read_mlflow_run

    client = MlflowClient()
    run = client.get_run(trl_user_run.run_id)
    assert client.list_artifacts(trl_user_run.run_id) == []  # HF_MLFLOW_LOG_ARTIFACTS unset
    assert run.data.params["max_length"] == "256" and "completion_only_loss" in run.data.params
    record = read_mlflow_run(trl_user_run.run_id)
    base = str(json.loads((trl_user_run.output_dir / "adapter_config.json").read_text())["base_model_name_or_path"])
    assert record.lora.base_model == base and record.inferred["base_model"] == "the run's param _name_or_path"
    assert record.config.max_seq_length == 256 and record.config.learning_rate == pytest.approx(0.002)


def test_diagnose_from_the_run_id_and_the_data(trl_user_run, tracking, tmp_path):
    config = _config(tmp_path, tmp_path / "cache")
    _gradian(["diagnose", "-c", str(config), "--mlflow-run", trl_user_run.run_id, "--dataset",
              str(trl_user_run.train_file), "--out", str(tmp_path / "plain"), "--no-log"], tmp_path)
    plain = json.loads((tmp_path / "plain" / "diagnose.json").read_text())
    skipped = {s["id"]: s["reason"] for s in plain["skipped"]}
    # the base model, so the tokenizer, came from the run's params: no check waits for one
    assert not [r for r in skipped.values() if "tokenizer" in r], skipped
    # what a params-only run cannot know names the flag that brings it
    assert "--adapter DIR" in skipped["config.lr_too_high"]

    _gradian(["diagnose", "-c", str(config), "--mlflow-run", trl_user_run.run_id, "--dataset",
              str(trl_user_run.train_file), "--adapter", str(trl_user_run.output_dir), "--eval-dataset",
              str(trl_user_run.scenario.root / "eval.jsonl"), "--out", str(tmp_path / "full"), "--no-log"], tmp_path)
    full = json.loads((tmp_path / "full" / "diagnose.json").read_text())
    ran = full["manifest"]["checks_run"]
    assert len(ran) >= 39 and len(ran) + len(full["skipped"]) == 41, (len(ran), full["skipped"])
    # the LoRA settings came from the adapter folder, so the learning-rate checks judged the run
    assert {"config.lr_too_high", "config.capacity_vs_data"} <= set(ran)


def test_attribute_and_counterfactual_from_the_run_id_and_the_data(trl_user_run, tracking, tmp_path):
    from mlflow import MlflowClient

    config = _config(tmp_path, tmp_path / "cache")
    eval_file = trl_user_run.scenario.root / "eval.jsonl"
    _gradian(["attribute", "-c", str(config), "--mlflow-run", trl_user_run.run_id, "--dataset",
              str(trl_user_run.train_file), "--eval-dataset", str(eval_file), "--adapter",
              str(trl_user_run.output_dir), "--out", str(tmp_path / "attr")], tmp_path)
    report = json.loads((tmp_path / "attr" / "report.json").read_text())
    rankings = pd.read_parquet(tmp_path / "attr" / "rankings.parquet")
    planted = trl_user_run.scenario.planted_rows
    accused = set(rankings.loc[rankings["accused"], "row_index"])
    assert report["capability"]["delta"] < -0.5
    assert len(accused & planted) >= 0.9 * len(accused) and len(accused & planted) >= 0.9 * len(planted), \
        (len(accused), len(accused & planted), len(planted))
    client = MlflowClient()
    child = client.get_run(client.get_run(trl_user_run.run_id).data.tags["gradian.diagnosis.attribute"])
    assert child.data.tags["mlflow.parentRunId"] == trl_user_run.run_id

    _gradian(["counterfactual", "-c", str(config), "--report", str(tmp_path / "attr" / "report.json"),
              "--drop", "accused", "--out", str(tmp_path / "cf"), "--no-log"], tmp_path)
    outcome = json.loads((tmp_path / "cf" / "report.json").read_text())["counterfactual"]
    assert outcome["outcome"] == "recovered", outcome


def test_the_mlflow_project_attributes_the_trl_run_from_its_id(trl_user_run, tracking, tmp_path):
    from mlflow import MlflowClient

    config = _config(tmp_path, tmp_path / "cache")
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "mlflow"), "run", str(ROOT), "-e", "attribute", "--env-manager", "local",
         "--experiment-id", trl_user_run.experiment_id, "-P", f"run_id={trl_user_run.run_id}",
         "-P", f"dataset={trl_user_run.train_file}", "-P", f"eval_dataset={trl_user_run.scenario.root / 'eval.jsonl'}",
         "-P", f"adapter={trl_user_run.output_dir}", "-P", f"config={config}", "-P", "cross_check=none"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    match = re.search(r"Run \(ID '([0-9a-f]{32})'\) succeeded", output)
    assert match, output[-2000:]
    run = MlflowClient().get_run(match.group(1))
    assert run.data.tags["mlflow.parentRunId"] == trl_user_run.run_id
    assert run.data.metrics["capability.delta"] < -0.5
