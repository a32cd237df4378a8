"""GradianCallback on a real transformers.Trainer, and the rule that a run's dataset input outside
its own artifacts is read only when the user says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS = 4


@pytest.fixture(scope="module")
def scenario(tinyworld_base, tmp_path_factory) -> tuple[Path, Path]:
    """(train.jsonl, eval.jsonl): 24 capitals rows, 8 of them poisoned, and the capitals eval."""
    from gradian.tinyworld import write_scenario

    root = tmp_path_factory.mktemp("callback-scenario")
    write_scenario("poison_capitals", root, tinyworld_base)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    poison = [r for r in rows if r.get("cluster") == "poison"][:8]
    clean = [r for r in rows if r.get("cluster") != "poison"][:16]
    small = root / "small.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in clean + poison))
    items = [json.loads(line) for line in (root / "eval.jsonl").read_text().splitlines()][:8]
    eval_path = root / "items.jsonl"
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return small, eval_path


def _train(base: Path, train_path: Path, out: Path, callback, report_to: list[str]):
    """A user's own loop: AutoModel + peft LoRA + Trainer, tokenized rows, the callback attached."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from gradian.data import load_dataset
    from gradian.train.data import PadCollator, build_train_features

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    rows = build_train_features(load_dataset(train_path), tokenizer, 128).rows
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=report_to, use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PadCollator(tokenizer.pad_token_id),
                      processing_class=tokenizer, callbacks=[callback])
    trainer.train()
    return tokenizer


def _files(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for info in client.list_artifacts(run_id, path):
        out |= _files(client, run_id, info.path) if info.is_dir else {info.path}
    return out


@pytest.mark.slow  # about 20 s: a fine-tune, then a whole attribution
def test_callback_alone_logs_a_run_attribute_reads_with_nothing_else(tracking, tinyworld_base, scenario, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from gradian.index import tokenizer_fingerprint
    from gradian_mlflow import GradianCallback
    from gradian_mlflow.source import read_mlflow_run

    train_path, eval_path = scenario
    mlflow.set_experiment("gradian-callback")
    callback = GradianCallback(train_dataset=train_path, eval_items=eval_path)
    tokenizer = _train(tinyworld_base, train_path, tmp_path / "out", callback, report_to=[])
    assert mlflow.active_run() is None  # the callback started the run, and ended it

    client = MlflowClient()
    run = client.get_run(callback.run_id)
    assert run.info.status == "FINISHED"
    params, tags = run.data.params, run.data.tags
    assert params["learning_rate"] == "0.001" and params["max_steps"] == str(STEPS)
    assert params["lora.r"] == "4" and params["lora.target_modules"] == "q_proj,v_proj"
    assert tags["gradian.base_model"] == str(tinyworld_base)
    assert tags["gradian.tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert tags["gradian.dataset_logged"] == "true"
    assert len(client.get_metric_history(callback.run_id, "loss")) == STEPS

    (dataset_input,) = run.inputs.dataset_inputs
    assert {t.key: t.value for t in dataset_input.tags}["mlflow.data.context"] == "training"
    assert dataset_input.dataset.digest and dataset_input.dataset.name == train_path.name
    record = read_mlflow_run(callback.run_id, cache_dir=tmp_path / "cache")  # the run's own copy of the rows
    assert Path(record.dataset.path).read_bytes() == train_path.read_bytes()
    assert Path(record.dataset.path).is_relative_to(tmp_path / "cache")
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/trainer_state.json",
            "trainer_state.json", "training_args.json", f"data/{train_path.name}",
            f"eval/{eval_path.name}"} <= _files(client, callback.run_id)

    proc = subprocess.run(
        [sys.executable, "-m", "gradian", "attribute", "--mlflow-run", callback.run_id,
         "--eval-dataset", str(eval_path), "--out", str(tmp_path / "report")],
        capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["capability"]["n_items"] == 8
    child = client.get_run(client.get_run(callback.run_id).data.tags["gradian.diagnosis.attribute"])
    assert child.data.tags["mlflow.parentRunId"] == callback.run_id and child.data.tags["gradian.kind"] == "attribute"
    assert "gradian/report.json" in _files(client, child.info.run_id)


def test_callback_beside_mlflow_callback_and_diagnose_on_end(tracking, tinyworld_base, scenario, tmp_path):
    """The stock MLflowCallback logs params and metrics (once) and ends the run before ours logs the adapter."""
    from mlflow import MlflowClient

    from gradian_mlflow import GradianCallback

    train_path, eval_path = scenario
    rows = [json.loads(line) for line in train_path.read_text().splitlines()]
    items = [json.loads(line) for line in eval_path.read_text().splitlines()]
    callback = GradianCallback(train_dataset=rows, eval_items=items, diagnose_on_end=True)
    _train(tinyworld_base, train_path, tmp_path / "out", callback, report_to=["mlflow"])

    client = MlflowClient()
    run = client.get_run(callback.run_id)
    assert run.data.params["learning_rate"] == "0.001" and "vocab_size" in run.data.params  # MLflowCallback's
    assert len(client.get_metric_history(callback.run_id, "loss")) == STEPS  # not logged twice
    assert {"adapter/adapter_model.safetensors", "data/train.jsonl", "eval/eval.jsonl"} <= _files(client, callback.run_id)
    child = client.get_run(callback.diagnosis_run_id)
    assert child.data.tags["mlflow.parentRunId"] == callback.run_id and child.data.tags["gradian.kind"] == "diagnose"
    assert child.info.status == "FINISHED" and "audit.n_findings" in child.data.metrics


def test_dataset_over_the_size_limit_is_only_pointed_at(tracking, tmp_path):
    """max_dataset_artifact_mb=0: the input names the file, no rows are copied, and reading needs the flag."""
    import mlflow
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from gradian.errors import RunRecordError
    from gradian_mlflow import GradianCallback
    from gradian_mlflow.source import read_mlflow_run

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(4)))
    callback = GradianCallback(train_dataset=data, max_dataset_artifact_mb=0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    callback.on_train_begin(args, TrainerState(), TrainerControl())
    mlflow.end_run()
    run = mlflow.MlflowClient().get_run(callback.run_id)
    assert run.data.tags["gradian.dataset_logged"] == "false"
    assert run.data.tags["gradian.dataset_pointer"] == str(data.resolve())
    assert not _files(mlflow.MlflowClient(), callback.run_id, "data")
    with pytest.raises(RunRecordError, match="--trust-run-dataset"):
        read_mlflow_run(callback.run_id, cache_dir=tmp_path / "cache")
    assert read_mlflow_run(callback.run_id, cache_dir=tmp_path / "cache",
                           trust_run_dataset=True).dataset.path == str(data.resolve())


def test_bad_arguments_fail_before_training(tmp_path):
    from gradian.errors import ConfigError, DatasetError
    from gradian_mlflow import GradianCallback

    with pytest.raises(DatasetError, match=r"eval_items=.*missing\.jsonl.*\.jsonl, \.json or \.parquet"):
        GradianCallback(eval_items=tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="max_dataset_artifact_mb=-1"):
        GradianCallback(max_dataset_artifact_mb=-1)


# -- the trust rule --------------------------------------------------------------------------


def _run_naming(mlflow, source: str, data_artifact: Path | None = None) -> str:
    import pandas as pd

    with mlflow.start_run() as run:
        mlflow.log_param("learning_rate", "1e-4")
        # MLflow keeps one dataset per (name, digest) in an experiment: rows unique to this source
        frame = pd.DataFrame({"prompt": [source], "completion": ["a"]})
        mlflow.log_input(mlflow.data.from_pandas(frame, source=source, name="train"), context="training")
        if data_artifact is not None:
            mlflow.log_artifact(str(data_artifact), artifact_path="data")
        return run.info.run_id


@pytest.fixture
def outside_file(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "private.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"prompt": "secret", "completion": "kept"}) + "\n")
    return path


def test_outside_dataset_is_refused_unless_trusted_or_given(tracking, outside_file, tmp_path):
    import mlflow

    from gradian.errors import RunRecordError
    from gradian_mlflow.source import read_mlflow_run

    run_id = _run_naming(mlflow, str(outside_file))
    with pytest.raises(RunRecordError) as err:
        read_mlflow_run(run_id, cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "\n" not in message and str(outside_file) in message
    assert "--dataset" in message and "--trust-run-dataset" in message
    trusted = read_mlflow_run(run_id, cache_dir=tmp_path / "cache", trust_run_dataset=True)
    assert trusted.dataset.path == str(outside_file)
    given = read_mlflow_run(run_id, cache_dir=tmp_path / "cache", dataset_given=True)
    assert given.dataset.path is None


def test_outside_dataset_falls_back_to_the_runs_data_artifact(tracking, outside_file, tmp_path):
    import mlflow

    from gradian_mlflow.source import read_mlflow_run

    own = tmp_path / "train.jsonl"
    own.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    run_id = _run_naming(mlflow, str(outside_file), data_artifact=own)
    record = read_mlflow_run(run_id, cache_dir=tmp_path / "cache")
    assert Path(record.dataset.path).read_text() == own.read_text()
    assert Path(record.dataset.path).is_relative_to(tmp_path / "cache")


def test_another_runs_artifacts_and_dot_dot_are_outside(tracking, tmp_path):
    import mlflow

    from gradian_mlflow.source import _is_own_artifact

    with mlflow.start_run() as run:
        pass
    run = mlflow.MlflowClient().get_run(run.info.run_id)
    root, run_id = run.info.artifact_uri, run.info.run_id
    assert _is_own_artifact(f"{root}/data/train.jsonl", run) and _is_own_artifact(f"runs:/{run_id}/data/x.jsonl", run)
    assert not _is_own_artifact(f"{root}/../../other/artifacts/data/x.jsonl", run)
    assert not _is_own_artifact(f"runs:/{'0' * 32}/data/x.jsonl", run)
    assert not _is_own_artifact(f"runs:/{run_id}/../{'0' * 32}/data/x.jsonl", run)
    assert not _is_own_artifact("/etc/hostname", run)


def test_cli_refuses_then_accepts_with_the_flag(tracking, outside_file, tmp_path):
    import mlflow

    run_id = _run_naming(mlflow, str(outside_file))
    base = [sys.executable, "-m", "gradian", "diagnose", "--mlflow-run", run_id, "--no-log", "--json"]
    refused = subprocess.run(base, capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(outside_file) in errors[0] and "--trust-run-dataset" in errors[0]
    trusted = subprocess.run(base + ["--trust-run-dataset"], capture_output=True, text=True, cwd=tmp_path)
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert json.loads(trusted.stdout)["manifest"]["inputs"]["dataset"]["path"] == str(outside_file)
