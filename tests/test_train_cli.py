"""The `gradian tinyworld` and `gradian train` commands."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gradian.cli import app

runner = CliRunner()


def test_scenario_list_names_every_scenario():
    from gradian.tinyworld.scenarios import SCENARIOS

    result = runner.invoke(app, ["tinyworld", "scenario", "list"])
    assert result.exit_code == 0, result.output
    assert all(name in result.output for name in SCENARIOS)


def test_unknown_scenario_is_refused(tmp_path, tinyworld_base):
    result = runner.invoke(app, ["tinyworld", "scenario", "nope", "--out", str(tmp_path),
                                 "--base-model", str(tinyworld_base)])
    assert result.exit_code != 0
    assert "unknown tinyworld scenario" in str(result.exception)


def test_train_refuses_a_missing_backend_before_loading_anything(tmp_path):
    from gradian.train import backend_status

    if backend_status()["unsloth"] is None:
        pytest.skip("unsloth is installed here")
    config = tmp_path / "gradian.yaml"
    config.write_text("base_model: does/not/exist\n")
    result = runner.invoke(app, ["train", "-c", str(config), "-b", "unsloth", "-o", str(tmp_path / "run")])
    assert result.exit_code != 0
    assert "unsloth" in str(result.exception)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_build_scenario_and_train_from_the_command_line(tmp_path, tinyworld_base, monkeypatch):
    monkeypatch.setenv("GRADIAN_TINYWORLD_CACHE", str(tinyworld_base.parent))
    built = runner.invoke(app, ["tinyworld", "build", "--quiet"])
    assert built.exit_code == 0, built.output
    assert built.output.strip() == str(tinyworld_base)

    scen = tmp_path / "scen"
    wrote = runner.invoke(app, ["tinyworld", "scenario", "poison_duplicates", "--out", str(scen)])
    assert wrote.exit_code == 0, wrote.output
    info = json.loads((scen / "scenario.json").read_text())
    assert info["planted"]["n"] == 51 and len(info["planted"]["duplicate_indices"]) == 6

    lines = (scen / "train.jsonl").read_text().splitlines()[:24]
    (scen / "small.jsonl").write_text("\n".join(lines) + "\n")
    trained = runner.invoke(app, ["train", "-c", str(scen / "gradian.yaml"), "-d", str(scen / "small.jsonl"),
                                  "-o", str(scen / "run")])
    assert trained.exit_code == 0, trained.output
    assert "adapter:" in trained.output
    record = json.loads((scen / "run" / "gradian_run.json").read_text())
    assert record["dataset"]["n_examples"] == 24
    assert record["lora"]["r"] == 8

    again = runner.invoke(app, ["train", "-c", str(scen / "gradian.yaml"), "-d", str(scen / "small.jsonl"),
                                "-o", str(scen / "run")])
    assert again.exit_code != 0 and "--overwrite" in str(again.exception)


def test_train_with_the_trl_backend_trains_what_the_hf_backend_trains(tinyworld_run, tmp_path):
    """``gradian train --backend trl`` (TRL's SFTTrainer, offline) on a tinyworld scenario: the same
    rows, masks and recipe as the hf backend, so the adapter matches the hf one of the same run to
    float rounding, and TRL's own defaults (bfloat16, gradient checkpointing) are not switched on."""
    import numpy as np
    from safetensors.numpy import load_file

    pytest.importorskip("trl")
    run = tinyworld_run("poison_capitals")
    out = tmp_path / "trl-run"
    result = runner.invoke(app, ["train", "-c", str(run.config_path), "-b", "trl", "-o", str(out)],
                           env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert result.exit_code == 0, result.output
    record = json.loads((out / "gradian_run.json").read_text())
    assert record["config"]["extra"]["backend"] == "trl"
    args = json.loads((out / "training_args.json").read_text())
    assert args["backend"] == "trl" and "dataset_text_field" in args  # TRL's SFTConfig, with its own fields
    assert args["bf16"] is False and args["gradient_checkpointing"] is False  # the hf defaults, not TRL's
    trl_weights = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    hf_weights = load_file(str(run.root / "run" / "adapter" / "adapter_model.safetensors"))
    assert set(trl_weights) == set(hf_weights)
    worst = max(float(np.abs(trl_weights[k] - hf_weights[k]).max() / np.abs(hf_weights[k]).max()) for k in hf_weights)
    assert worst < 1e-2, worst
    # and the weights did move: the comparison is not between two untrained adapters
    assert any(float(np.abs(v).max()) > 0 for k, v in hf_weights.items() if "lora_B" in k)
