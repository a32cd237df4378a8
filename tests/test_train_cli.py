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
