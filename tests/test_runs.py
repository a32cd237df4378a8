"""RunRecord: normalization of trainer args, derived figures, and the local run-dir reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradian.errors import RunRecordError
from gradian.runs import (
    LoraSettings,
    RunRecord,
    RunRef,
    TrainingLogs,
    normalize_trainer_config,
    parse_param_value,
    read_run_dir,
)


def test_parse_param_values_as_mlflow_stores_them():
    assert parse_param_value("2e-4") == 2e-4
    assert parse_param_value("3") == 3
    assert parse_param_value("True") is True and parse_param_value("false") is False
    assert parse_param_value("None") is None
    assert parse_param_value("['q_proj', 'v_proj']") == ["q_proj", "v_proj"]
    assert parse_param_value("IntervalStrategy.STEPS") == "steps"
    assert parse_param_value("cosine") == "cosine"


def test_normalize_hf_and_trl_names_from_strings():
    c = normalize_trainer_config({
        "learning_rate": "0.0002", "num_train_epochs": "3.0", "max_steps": "-1",
        "per_device_train_batch_size": "4", "gradient_accumulation_steps": "2",
        "warmup_steps": "0.1", "lr_scheduler_type": "SchedulerType.COSINE",
        "max_length": "1024", "packing": "False", "bf16": "True", "seed": "42",
        "eval_strategy": "no", "optim": "adamw_torch",
    })
    assert c.learning_rate == 2e-4 and c.num_train_epochs == 3.0 and c.max_steps is None
    assert c.per_device_train_batch_size == 4 and c.gradient_accumulation_steps == 2
    assert c.warmup_ratio == 0.1 and c.warmup_steps is None  # float < 1 is a ratio (transformers 5)
    assert c.lr_scheduler_type == "cosine" and c.max_seq_length == 1024
    assert c.packing is False and c.bf16 is True and c.seed == 42
    assert c.extra == {"optim": "adamw_torch"}


def test_integer_warmup_steps_stay_steps():
    c = normalize_trainer_config({"warmup_steps": 10, "warmup_ratio": 0.0})
    assert c.warmup_steps == 10 and c.warmup_ratio is None


def record(lr=2e-4, r=8, alpha=16, rslora=False, **cfg) -> RunRecord:
    rec = RunRecord(config=normalize_trainer_config({"learning_rate": lr, **cfg}))
    rec.lora = LoraSettings(r=r, alpha=alpha, use_rslora=rslora)
    return rec


def test_effective_lora_lr():
    assert record(lr=2e-3, r=8, alpha=16).effective_lora_lr == pytest.approx(4e-3)
    assert record(lr=1e-4, r=16, alpha=16, rslora=True).effective_lora_lr == pytest.approx(1e-4 * 16 / 4)
    assert RunRecord().effective_lora_lr is None


def test_effective_batch_and_total_steps():
    rec = record(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=3)
    assert rec.effective_batch_size == 8
    # 800 examples / 4 = 200 batches -> 100 updates per epoch -> 300
    assert rec.total_optimizer_steps(800) == 300
    # 801 examples: 201 batches -> ceil(201 / 2) = 101 updates per epoch
    assert rec.total_optimizer_steps(801) == 303
    rec.config.max_steps = 50
    assert rec.total_optimizer_steps(800) == 50


def test_warmup_fraction_from_steps():
    rec = record(per_device_train_batch_size=1, num_train_epochs=1, warmup_steps=10)
    rec.dataset.n_examples = 100
    assert rec.warmup_fraction == pytest.approx(0.1)


def test_logs_merge_train_and_eval_entries():
    logs = TrainingLogs.from_log_history([
        {"step": 1, "loss": 2.0, "grad_norm": 1.5, "learning_rate": 1e-4, "epoch": 0.1},
        {"step": 1, "eval_loss": 2.2, "epoch": 0.1},
        {"step": 2, "loss": 1.5, "grad_norm": float("nan"), "learning_rate": 9e-5, "epoch": 0.2},
        {"step": 2, "train_runtime": 12.0, "train_loss": 1.7},
    ])
    assert [s.step for s in logs.steps] == [1, 2]
    assert logs.steps[0].eval_loss == 2.2
    assert math.isnan(logs.steps[1].grad_norm)
    assert logs.series("loss") == [(1, 2.0), (2, 1.5)]


def hf_run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    ckpt = run / "checkpoint-20"
    ckpt.mkdir(parents=True)
    adapter_cfg = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"],
                   "base_model_name_or_path": "org/base", "peft_type": "LORA"}
    (ckpt / "adapter_config.json").write_text(json.dumps(adapter_cfg))
    state = {"num_train_epochs": 2, "max_steps": 20, "train_batch_size": 4, "log_history": [
        {"step": s, "loss": 2.0 / s, "grad_norm": 1.0, "learning_rate": 1e-4, "epoch": s / 10} for s in range(1, 21)
    ]}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "training_args.bin").write_bytes(b"\x80\x04not-to-be-unpickled")
    (run / "training_args.json").write_text(json.dumps({"learning_rate": 1e-4, "num_train_epochs": 2,
                                                        "per_device_train_batch_size": 4, "seed": 7}))
    return run


def test_read_hf_trainer_dir(tmp_path):
    rec = read_run_dir(hf_run_dir(tmp_path))
    assert rec.config.learning_rate == 1e-4 and rec.config.num_train_epochs == 2 and rec.config.seed == 7
    assert rec.lora.r == 16 and rec.lora.alpha == 32 and rec.lora.base_model == "org/base"
    assert rec.adapter_dir.endswith("checkpoint-20")
    assert len(rec.logs.steps) == 20 and rec.logs.steps[-1].loss == pytest.approx(0.1)
    assert rec.effective_lora_lr == pytest.approx(2e-4)


def test_gradian_run_json_round_trip(tmp_path):
    rec = record(per_device_train_batch_size=2, num_train_epochs=1)
    rec.logs = TrainingLogs.from_log_history([{"step": 1, "loss": 1.0}])
    run = tmp_path / "r"
    run.mkdir()
    rec.write_json(run / "gradian_run.json")
    back = read_run_dir(run)
    assert back.config.learning_rate == rec.config.learning_rate
    assert back.lora.r == 8 and back.logs.steps[0].loss == 1.0


def test_run_dir_errors(tmp_path):
    with pytest.raises(RunRecordError, match="not found"):
        read_run_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunRecordError, match="no trainer output"):
        read_run_dir(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trainer_state.json").write_text("{oops")
    with pytest.raises(RunRecordError, match=r"trainer_state.json:1"):
        read_run_dir(bad)


def test_resolve_run_dispatches_local_and_remote(tmp_path, monkeypatch):
    from gradian.runs import is_remote_run_ref, resolve_run

    run = hf_run_dir(tmp_path)
    assert resolve_run(str(run)).lora.r == 16
    seen = {}

    class FakeEntryPoint:
        """A run source written as a plain function, the first contract: it gets the reference as written."""

        group, value, dist = "gradian.run_sources", "fake:reader", None

        def __init__(self, name):
            self.name = name

        def load(self):
            def reader(ref, cache_dir):
                seen["ref"], seen["cache"] = ref, cache_dir
                return RunRecord(ref=RunRef.parse(f"mlflow:{ref}"))
            return reader

    monkeypatch.setattr("gradian.runs.sources.entry_points",
                        lambda group: [FakeEntryPoint("mlflow"), FakeEntryPoint("runs")])
    assert is_remote_run_ref("runs:/" + "a" * 32) and not is_remote_run_ref(str(run))
    assert resolve_run("runs:/" + "c" * 32, cache_dir=tmp_path).source.startswith("mlflow:")
    assert seen["ref"] == "runs:/" + "c" * 32 and seen["cache"] == tmp_path / "runs"
