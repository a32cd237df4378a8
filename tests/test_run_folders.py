"""Run folders as a real ``transformers.Trainer`` leaves them.

``training_args.bin`` is read through ``torch.load(weights_only=True)`` with an allowlist, and a
pickle naming anything else is refused without running it. Without arguments, the learning rate,
schedule and warmup are fitted to trainer_state.json's logged rates and labelled as inferred. The
ground truth is the arguments each fixture run was trained with (tests/plugins/hf_trainer_runs.py).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

from gradian.audit import run_audit
from gradian.runs import read_run_dir
from gradian.runs.schedule import fit_lr_schedule
from gradian.runs.training_args import TrainingArgsRefused, read_training_args
from tests.plugins.hf_trainer_runs import N_ROWS

LR_CHECKS = ["config.lr_too_high", "config.lr_too_low", "config.no_warmup", "config.small_effective_batch",
             "config.grad_clip_disabled"]


def _copy(src: Path, dst: Path, drop: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if drop:
        for path in dst.rglob(drop):
            path.unlink()
    return dst


def _fired(record, checks, n_examples=N_ROWS):
    from gradian.runs import DatasetRef

    record.dataset = DatasetRef(n_examples=n_examples)
    result = run_audit(run=record, checks=checks)
    assert sorted(result.ran) == sorted(checks), result.skipped
    return {f.id: f for f in result.findings}


# -- training_args.bin, read safely ------------------------------------------------------------

def test_plain_folder_with_only_training_args_bin(hf_trainer_runs, tmp_path):
    src, truth = hf_trainer_runs["planted"]
    run = _copy(src, tmp_path / "run", drop="trainer_state.json")
    assert sorted(p.name for p in run.iterdir() if p.suffix in (".bin", ".json")) == [
        "adapter_config.json", "training_args.bin"]

    record = read_run_dir(run)
    c = record.config
    assert c.learning_rate == truth["learning_rate"] and c.lr_scheduler_type == "linear"
    assert c.per_device_train_batch_size == 1 and c.gradient_accumulation_steps == 1 and c.world_size == 1
    assert c.warmup_steps == 0 and c.max_grad_norm == 0.0 and c.seed == truth["seed"]
    assert record.inferred == {} and record.notes == []

    fired = _fired(record, LR_CHECKS)
    assert set(fired) == {"config.lr_too_high", "config.no_warmup", "config.small_effective_batch",
                          "config.grad_clip_disabled"}
    assert fired["config.lr_too_high"].severity == "critical"  # 5e-3 x 8/4 = 1e-2
    assert fired["config.lr_too_high"].evidence["effective_lr"] == pytest.approx(1e-2)
    assert "inferred" not in fired["config.lr_too_high"].evidence


def test_checkpoint_folders_and_clipping(hf_trainer_runs, tmp_path):
    src, truth = hf_trainer_runs["clipped"]
    # the final training_args.bin removed: the newest checkpoint's is read, its trainer_state too
    run = _copy(src, tmp_path / "run")
    (run / "training_args.bin").unlink()
    record = read_run_dir(run)
    c = record.config
    assert c.learning_rate == truth["learning_rate"] and c.lr_scheduler_type == "cosine"
    assert c.warmup_steps == 3 and c.gradient_accumulation_steps == 2 and c.max_grad_norm == 1e-4
    assert record.planned_steps == 8 and len(record.logs.steps) == 8
    assert [Path(p).name for p in record.checkpoints] == ["checkpoint-4", "checkpoint-8"]

    fired = _fired(record, LR_CHECKS + ["dynamics.always_clipping", "dynamics.lr_schedule_incomplete"])
    assert set(fired) == {"config.lr_too_low", "dynamics.always_clipping"}
    assert fired["dynamics.always_clipping"].evidence["share"] == 1.0


def test_subclassed_arguments_are_refused_naming_the_class(tmp_path):
    import torch
    from transformers import TrainingArguments

    module = types.ModuleType("my_trainer_code")

    class MyArguments(TrainingArguments):
        pass

    MyArguments.__module__, MyArguments.__qualname__ = "my_trainer_code", "MyArguments"
    module.MyArguments = MyArguments
    sys.modules["my_trainer_code"] = module
    try:
        path = tmp_path / "training_args.bin"
        torch.save(MyArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True), path)
    finally:
        del sys.modules["my_trainer_code"]
    with pytest.raises(TrainingArgsRefused, match=r"names my_trainer_code\.MyArguments"):
        read_training_args(path)


class _Payload:
    """Pickles as a call to os.system: what a hostile training_args.bin would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_run(hf_trainer_runs, tmp_path):
    import torch

    src, truth = hf_trainer_runs["planted"]
    run = _copy(src, tmp_path / "run")
    marker = tmp_path / "pwned"
    torch.save({"learning_rate": 1.0, "payload": _Payload(marker)}, run / "training_args.bin")

    record = read_run_dir(run)
    assert not marker.exists()
    (note,) = record.notes
    assert "\n" not in note
    assert f"{os.system.__module__}.system" in note and "training_args.bin" in note
    assert "trainer_state.json instead" in note
    # the fallback: the rate and schedule fitted to the logs, not the pickle's 1.0
    assert record.config.learning_rate == pytest.approx(truth["learning_rate"], rel=1e-6)
    assert record.inferred["learning_rate"].startswith("fitted to 16 logged learning rates")


def test_trl_config_is_read_as_fields_when_trl_is_absent(tmp_path, monkeypatch):
    """TRL's SFTConfig pickles under trl's module name; without trl it is read as an inert record."""
    import torch
    from transformers import TrainingArguments

    class SFTConfig(TrainingArguments):
        pass

    SFTConfig.__module__, SFTConfig.__qualname__ = "trl.trainer.sft_config", "SFTConfig"
    fake = {name: types.ModuleType(name) for name in ("trl", "trl.trainer", "trl.trainer.sft_config")}
    fake["trl.trainer.sft_config"].SFTConfig = SFTConfig
    path = tmp_path / "training_args.bin"
    with monkeypatch.context() as m:
        for name, mod in fake.items():
            m.setitem(sys.modules, name, mod)
        args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, learning_rate=3e-4)
        args.max_length = 777  # an SFT-only field
        torch.save(args, path)
    with monkeypatch.context() as m:
        # where trl is not installed, importing it fails: a None entry does that even where it is
        for name in ("trl", "trl.trainer", "trl.trainer.sft_config", "trl.trainer.dpo_config"):
            m.setitem(sys.modules, name, None)
        from gradian.runs.training_args import _InertRecord, _trl_classes

        assert _trl_classes()["trl.trainer.sft_config.SFTConfig"] is _InertRecord  # the path without trl
        loaded = read_training_args(path)
    assert loaded["learning_rate"] == 3e-4 and loaded["max_length"] == 777
    assert loaded["lr_scheduler_type"] == "linear"


def test_a_real_trl_sft_config_is_read_with_its_own_fields(tmp_path):
    """Where trl is installed, a training_args.bin that TRL's SFTTrainer saved is read through the
    allowlist, SFT fields included."""
    import torch

    pytest.importorskip("trl")
    from trl import SFTConfig

    args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, learning_rate=3e-4,
                     max_length=777, packing=True)
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    loaded = read_training_args(path)
    assert loaded["learning_rate"] == 3e-4 and loaded["max_length"] == 777 and loaded["packing"] is True


def test_not_a_torch_archive_is_refused(tmp_path):
    path = tmp_path / "training_args.bin"
    path.write_bytes(b"\x80\x04not-a-pickle")
    with pytest.raises(TrainingArgsRefused, match="training_args.bin"):
        read_training_args(path)


# -- without arguments: the schedule fitted to the logged rates -----------------------------------

@pytest.mark.parametrize("name", ["planted", "clipped"])
def test_schedule_inferred_from_log_history_matches_the_arguments(hf_trainer_runs, tmp_path, name):
    src, truth = hf_trainer_runs[name]
    record = read_run_dir(_copy(src, tmp_path / "run", drop="training_args.bin"))
    c = record.config
    assert c.learning_rate == pytest.approx(truth["learning_rate"], rel=1e-6)
    assert c.lr_scheduler_type == truth["lr_scheduler_type"]
    assert c.warmup_steps == truth["warmup_steps"]
    assert set(record.inferred) == {"learning_rate", "lr_scheduler_type", "warmup_steps"}


def test_inferred_settings_drive_the_checks_and_are_labelled(hf_trainer_runs, tmp_path):
    src, _ = hf_trainer_runs["planted"]
    record = read_run_dir(_copy(src, tmp_path / "run", drop="training_args.bin"))
    assert record.config.max_grad_norm is None  # a clip threshold is not in the logs
    fired = _fired(record, ["config.lr_too_high", "config.no_warmup", "config.small_effective_batch"])
    assert set(fired) == {"config.lr_too_high", "config.no_warmup", "config.small_effective_batch"}
    assert set(fired["config.no_warmup"].evidence["inferred"]) == {"learning_rate", "warmup_steps"}
    assert "learning_rate" in fired["config.lr_too_high"].evidence["inferred"]
    assert "inferred" in fired["config.lr_too_high"].message
    batch = fired["config.small_effective_batch"].evidence
    assert batch["gradient_accumulation_steps"] == 1
    assert batch["gradient_accumulation_source"].startswith("inferred from the logged epoch")


def test_gradient_accumulation_inferred_from_epochs(hf_trainer_runs, tmp_path):
    src, truth = hf_trainer_runs["clipped"]
    record = read_run_dir(_copy(src, tmp_path / "run", drop="training_args.bin"))
    assert record.config.gradient_accumulation_steps is None
    assert record.inferred_gradient_accumulation(N_ROWS) == truth["gradient_accumulation_steps"]


# -- the fit itself, on schedules written out by hand ----------------------------------------------

def _rates(kind: str, peak: float, total: int, warmup: int, every: int = 1, first: int | None = None):
    out = []
    for k in range(first or every, total + 1, every):
        t = k - 1
        if t < warmup:
            f = t / max(1, warmup)
        elif kind == "linear":
            f = max(0.0, (total - t) / (total - warmup))
        elif kind == "cosine":
            f = 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))
        else:
            f = 1.0
        out.append((k, peak * f))
    return out


@pytest.mark.parametrize("kind, warmup", [("linear", 0), ("linear", 30), ("cosine", 12), ("constant", 0)])
def test_fit_recovers_peak_shape_and_warmup(kind, warmup):
    fit = fit_lr_schedule(_rates(kind, 2e-4, 300, warmup), total_steps=300)
    assert fit.peak_lr == pytest.approx(2e-4, rel=1e-9) and fit.kind == kind
    assert fit.warmup_steps == warmup


def test_warmup_hidden_before_the_first_log_stays_unknown():
    # logged every 10 steps from step 10: a warmup of up to 9 steps would look the same as none
    fit = fit_lr_schedule(_rates("linear", 2e-4, 300, 0, every=10), total_steps=300)
    assert fit.kind == "linear" and fit.warmup_steps is None
    assert fit.peak_lr == pytest.approx(2e-4, rel=0.05)
    # a warmup long enough to be seen rising is measured
    fit = fit_lr_schedule(_rates("cosine", 2e-4, 300, 40, every=10), total_steps=300)
    assert fit.kind == "cosine" and fit.warmup_steps == 40


def test_no_standard_shape_keeps_the_largest_rate_and_names_no_schedule():
    rates = [(k, 1e-4 * (1 + (k % 7))) for k in range(1, 60)]
    fit = fit_lr_schedule(rates, total_steps=60)
    assert fit.kind is None and fit.peak_lr == pytest.approx(7e-4)


def test_refused_pickle_without_logs_says_nothing_replaces_it(hf_trainer_runs, tmp_path):
    import torch

    src, _ = hf_trainer_runs["planted"]
    run = _copy(src, tmp_path / "run", drop="trainer_state.json")
    torch.save({"payload": _Payload(tmp_path / "pwned")}, run / "training_args.bin")
    record = read_run_dir(run)
    (note,) = record.notes
    assert "no trainer_state.json either" in note and record.config.learning_rate is None
    assert not (tmp_path / "pwned").exists()


def test_no_warmup_is_skipped_when_the_logs_start_too_late(hf_trainer_runs, tmp_path):
    import json

    src, _ = hf_trainer_runs["planted"]
    run = _copy(src, tmp_path / "run", drop="training_args.bin")
    state_path = run / "trainer_state.json"
    state = json.loads(state_path.read_text())
    # as with logging_steps=4: the first logged rate is at step 4
    state["log_history"] = [e for e in state["log_history"] if e.get("step", 0) % 4 == 0]
    state_path.write_text(json.dumps(state))
    record = read_run_dir(run)
    assert "learning_rate" in record.inferred and record.config.warmup_steps is None
    record.dataset.n_examples = N_ROWS
    result = run_audit(run=record, checks=["config.no_warmup"])
    ((_, reason),) = [(s.id, s.reason) for s in result.skipped]
    assert "start at step 4" in reason


class _CallsTheArguments:
    """Pickles as a call TrainingArguments(...): allowlisted class, but run with the file's values."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir

    def __reduce__(self):
        from transformers import TrainingArguments

        return (TrainingArguments, (self.output_dir,))


def test_an_allowlisted_class_may_be_rebuilt_but_not_called(tmp_path):
    import torch

    path = tmp_path / "training_args.bin"
    torch.save(_CallsTheArguments(str(tmp_path / "elsewhere")), path)
    with pytest.raises(TrainingArgsRefused, match="TrainingArguments is called in the pickle"):
        read_training_args(path)


def test_legacy_format_pickle_is_refused_too(tmp_path):
    import torch

    path, marker = tmp_path / "training_args.bin", tmp_path / "pwned"
    torch.save({"payload": _Payload(marker)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(TrainingArgsRefused, match=r"system"):
        read_training_args(path)
    assert not marker.exists()
