"""`gradian diagnose` and `gradian checks` end to end, on a run directory written as the HF Trainer
writes one (string-free JSON args, trainer_state.json log_history, adapter_config.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradian.cli import app
from tests.test_audit_checks import HEALTHY_LORA, _CLEAN, _EVAL, healthy_logs, tokenizer

runner = CliRunner(env={"COLUMNS": "240"})

TRAINING_ARGS = {
    "learning_rate": 2e-4, "num_train_epochs": 2, "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2, "warmup_steps": 0.05, "lr_scheduler_type": "linear",
    "max_grad_norm": 1.0, "seed": 42, "max_length": 512, "packing": False, "bf16": True,
    "fp16": False, "eval_strategy": "steps", "max_steps": -1, "completion_only_loss": True,
}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_run_dir(path: Path, args: dict | None = None, logs: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "training_args.json").write_text(json.dumps({**TRAINING_ARGS, **(args or {})}))
    (path / "adapter_config.json").write_text(json.dumps({**HEALTHY_LORA, "peft_type": "LORA"}))
    if logs:
        history = [{k: v for k, v in asdict(s).items() if v is not None} for s in healthy_logs()]
        (path / "trainer_state.json").write_text(json.dumps({"log_history": history, "global_step": 100}))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("diagnose")
    tok_dir = root / "tiny-base"
    tokenizer().save_pretrained(tok_dir)
    return {
        "root": root,
        "train": _jsonl(root / "train.jsonl", _CLEAN),
        "eval": _jsonl(root / "eval.jsonl", _EVAL),
        "contaminated_eval": _jsonl(root / "eval_bad.jsonl", _CLEAN[:20]),
        "tokenizer": tok_dir,
        "run": write_run_dir(root / "run"),
    }


def _diagnose(*args: str):
    return runner.invoke(app, ["diagnose", *args])


def test_checks_lists_all_41():
    result = runner.invoke(app, ["checks"])
    assert result.exit_code == 0, result.output
    ids = [w for w in result.output.split() if w.startswith(("config.", "data.", "dynamics."))]
    assert len(set(ids)) == 41
    assert "41 diagnostic checks" in result.output


def test_healthy_diagnose_writes_report(files, tmp_path):
    out = tmp_path / "out"
    result = _diagnose("-d", str(files["train"]), "--eval-dataset", str(files["eval"]), "-r", str(files["run"]),
                       "-m", str(files["tokenizer"]), "-o", str(out), "--fail-on", "high")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "diagnose.json").read_text())
    assert set(report) >= {"capability", "findings", "attribution", "verdict", "skipped", "manifest"}
    assert report["skipped"] == []
    assert not [f for f in report["findings"] if f["severity"] in ("critical", "high")]
    assert report["manifest"]["inputs"]["dataset"]["n_examples"] == 300
    assert report["manifest"]["inputs"]["max_seq_length"] == 512
    assert (out / "diagnose.md").read_text().startswith("# Gradian diagnosis")


def test_broken_run_leads_with_critical_and_fails_the_gate(files, tmp_path):
    run = write_run_dir(tmp_path / "run_hot", {"learning_rate": 2e-3})
    out = tmp_path / "out"
    result = _diagnose("-d", str(files["train"]), "--eval-dataset", str(files["contaminated_eval"]),
                       "-r", str(run), "-m", str(files["tokenizer"]), "-o", str(out), "--fail-on", "critical")
    assert result.exit_code == 1, result.output
    first = result.output.strip().splitlines()[0]
    assert "2 critical issue(s) invalidate or dominate this run: fix these first" in first
    report = json.loads((out / "diagnose.json").read_text())
    assert [f["id"] for f in report["findings"][:2]] == ["config.lr_too_high", "data.train_eval_contamination"]
    assert report["verdict"]["kind"] == "mixed"
    md = (out / "diagnose.md").read_text()
    assert "`config.lr_too_high`" in md and "lr=0.002 x alpha/r=2 = 0.004" in md


def test_run_without_logs_still_runs_data_checks(files, tmp_path):
    run = write_run_dir(tmp_path / "run_nologs", logs=False)
    out = tmp_path / "out"
    result = _diagnose("-d", str(files["train"]), "-r", str(run), "-o", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads((out / "diagnose.json").read_text())
    skipped = {s["id"]: s["reason"] for s in report["skipped"]}
    dynamics = [i for i in skipped if i.startswith("dynamics.")]
    assert len(dynamics) == 8 and all("no logged steps" in skipped[i] for i in dynamics)
    assert "tokenizer" in skipped["data.missing_eos"]
    assert "eval" in skipped["data.train_eval_contamination"]
    ran = report["manifest"]["checks_run"]
    assert "data.duplicates" in ran and "config.lr_too_high" in ran
    assert "Skipped checks" in result.output


def test_dataset_only_diagnose(files):
    result = _diagnose("-d", str(files["train"]))
    assert result.exit_code == 0, result.output
    assert "Skipped checks" in result.output


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", *args],
                          capture_output=True, text=True)


def test_bad_input_exits_2_with_one_line(files, tmp_path):
    proc = _main("diagnose", "-d", str(files["train"]), "--fail-on", "severe")
    assert proc.returncode == 2 and "--fail-on" in proc.stderr and "Traceback" not in proc.stderr
    proc = _main("diagnose", "-d", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr
    proc = _main("diagnose", "-d", str(files["train"]), "-m", str(tmp_path / "no-such-model"))
    assert proc.returncode == 2 and "--base-model" in proc.stderr and "Traceback" not in proc.stderr
