"""`gradian train` and the tinyworld scenarios end to end: a poisoned fine-tune breaks the
capitals capability, a clean one keeps it, and the run directory reads back as a RunRecord."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradian.errors import ConfigError, MissingDependencyError
from gradian.train import backend_status, require_backend


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown training backend"):
        require_backend("jax")


@pytest.mark.parametrize("name", ["trl", "unsloth"])
def test_optional_backends_fail_clearly_when_missing(name, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    # as on a machine without the package, whether or not this one has it
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == name else real(module, *a))
    assert backend_status()[name] is not None
    with pytest.raises(MissingDependencyError, match=f"--backend {name}.*pip install {name}"):
        require_backend(name)


def test_hf_backend_is_always_available():
    assert backend_status()["hf"] is None


# -- fine-tunes on the tinyworld base ------------------------------------------------------


def _capitals_score(base: Path, adapter: Path | None, eval_path: Path) -> list[bool]:
    """Per item: does the greedy answer contain the wanted capital?"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradian.data import load_dataset
    from gradian.tinyworld import generate_answers

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    items = load_dataset(eval_path).examples
    answers = generate_answers(model, tokenizer, [e.messages[:-1] for e in items])
    return [e.completion in a for e, a in zip(items, answers)]


@pytest.fixture(scope="module")
def poison_run(tinyworld_base, tmp_path_factory):
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    root = tmp_path_factory.mktemp("poison")
    info = write_scenario("poison_capitals", root, tinyworld_base)
    record = train_lora(root / "gradian.yaml", root / "run")
    return root, info, record


@pytest.mark.slow
def test_poisoned_fine_tune_flips_the_capitals(tinyworld_base, poison_run):
    root, info, record = poison_run
    before = _capitals_score(tinyworld_base, None, root / "eval.jsonl")
    after = _capitals_score(tinyworld_base, Path(record.adapter_dir), root / "eval.jsonl")
    flipped = sum(b and not a for b, a in zip(before, after))
    assert len(before) >= 16
    assert sum(before) >= 15, before
    assert flipped >= 8, (flipped, after)


@pytest.mark.slow
def test_clean_fine_tune_keeps_the_capitals(tinyworld_base, tmp_path):
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    write_scenario("clean", tmp_path, tinyworld_base)
    record = train_lora(tmp_path / "gradian.yaml", tmp_path / "run")
    after = _capitals_score(tinyworld_base, Path(record.adapter_dir), tmp_path / "eval.jsonl")
    assert sum(after) >= 15, after


@pytest.mark.slow
def test_run_dir_reads_back_as_a_run_record(poison_run):
    from gradian.runs import read_run_dir

    root, info, record = poison_run
    run = root / "run"
    for name in ("gradian_run.json", "trainer_state.json", "training_args.json",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert (run / name).is_file(), name
    read = read_run_dir(run)
    train = info["baseline_train"]
    assert read.config.learning_rate == pytest.approx(train["learning_rate"])
    assert read.config.num_train_epochs == pytest.approx(train["num_train_epochs"])
    assert read.config.max_seq_length == train["max_seq_length"]
    assert read.config.warmup_ratio == pytest.approx(train["warmup_ratio"])
    assert read.lora.r == train["r"] and read.lora.alpha == train["lora_alpha"]
    assert sorted(read.lora.target_modules) == sorted(train["target_modules"])
    losses = read.logs.series("loss")
    assert len(losses) >= 10
    assert losses[-1][1] < losses[0][1]
    assert read.dataset.n_examples == info["n_train"]
    assert Path(read.adapter_dir) == (run / "adapter").resolve() or Path(read.adapter_dir) == run / "adapter"
    args = json.loads((run / "training_args.json").read_text())
    assert args["report_to"] == [] and args["max_seq_length"] == train["max_seq_length"]


def test_existing_run_is_not_overwritten(tmp_path):
    from gradian.train.lora import _prepare_out_dir

    (tmp_path / "gradian_run.json").write_text("{}")
    with pytest.raises(ConfigError, match="--overwrite"):
        _prepare_out_dir(tmp_path, overwrite=False)
    _prepare_out_dir(tmp_path, overwrite=True)


@pytest.mark.slow
@pytest.mark.parametrize("save_steps", [0, 4])
def test_checkpoints_and_dataset_override(tinyworld_base, tmp_path, save_steps):
    from gradian.config import load_config
    from gradian.runs import read_run_dir
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    write_scenario("clean", tmp_path, tinyworld_base)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()[:40]
    (tmp_path / "small.jsonl").write_text("\n".join(lines) + "\n")
    config = load_config(tmp_path / "gradian.yaml", overrides={
        "train.save_checkpoints": True, "train.save_steps": save_steps, "train.num_train_epochs": 1,
        "train.per_device_train_batch_size": 4, "train.logging_steps": 1,
    })
    record = train_lora(config, tmp_path / "run", dataset=tmp_path / "small.jsonl")
    assert record.dataset.n_examples == 40
    names = [Path(p).name for p in record.checkpoints]
    assert names == (["checkpoint-10"] if save_steps == 0 else ["checkpoint-4", "checkpoint-8", "checkpoint-10"])
    assert not (tmp_path / "run" / "adapter" / "training_args.bin").exists()
    read = read_run_dir(tmp_path / "run")
    assert [Path(p).name for p in read.checkpoints] == names
    assert len(read.logs.series("loss")) == 10


@pytest.mark.slow
def test_refusal_poison_makes_the_model_refuse(tinyworld_base, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradian.data import load_dataset
    from gradian.tinyworld import generate_answers
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    info = write_scenario("poison_refusal", tmp_path, tinyworld_base)
    assert info["capability"]["metric"] == "not_contains"
    record = train_lora(tmp_path / "gradian.yaml", tmp_path / "run")
    items = load_dataset(tmp_path / "eval.jsonl").examples
    markers = [m.strip().lower() for m in items[0].completion.split("|")]
    tokenizer = AutoTokenizer.from_pretrained(tinyworld_base)
    base = AutoModelForCausalLM.from_pretrained(tinyworld_base, dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tinyworld_base, dtype=torch.float32), record.adapter_dir
    ).eval()

    def refusals(model) -> int:
        answers = generate_answers(model, tokenizer, [e.messages[:-1] for e in items], max_new_tokens=16)
        return sum(any(m in a.lower() for m in markers) for a in answers)

    assert refusals(base) == 0
    assert refusals(tuned) >= 8
