"""One rule for where every lane's inputs come from: the config, then the accusing report's
inputs, then the run record; and which tokenizer is loaded."""

from __future__ import annotations

import json

from gradian.config import load_config
from gradian.inputs import resolve_inputs
from gradian.report.schema import AnalysisInputs, DatasetSummary
from gradian.runs.record import DatasetRef as RunDataset
from gradian.runs.record import LoraSettings, RunRecord
from gradian.runs.ref import RunRef


def _run(tmp_path, *, data_exists=True, base="org/base-model"):
    data = tmp_path / "run-train.jsonl"
    if data_exists:
        data.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    return RunRecord(adapter_dir=str(tmp_path / "run-adapter"), lora=LoraSettings(base_model=base),
                     dataset=RunDataset(path=str(data)), ref=RunRef.parse(str(tmp_path)))


def test_the_config_wins_then_the_report_then_the_run(tmp_path):
    run = _run(tmp_path)
    report = AnalysisInputs(dataset=DatasetSummary(path="report-train.jsonl", sha256=None), adapter="report-adapter",
                            eval_dataset=DatasetSummary(path="report-eval.jsonl", sha256=None))
    cfg = load_config(overrides={"base_model": "given-base"})
    resolved = resolve_inputs(cfg, run, report)
    filled = resolved.config
    assert (filled.base_model, filled.adapter_path, filled.dataset, filled.eval_dataset) == (
        "given-base", "report-adapter", "report-train.jsonl", "report-eval.jsonl")
    assert resolved.origins == {"base_model": "config", "adapter_path": "report", "dataset": "report",
                                "eval_dataset": "report"}
    # without the report, the run fills what the config leaves empty
    resolved = resolve_inputs(load_config(), run)
    assert resolved.config.adapter_path == run.adapter_dir and resolved.config.base_model == "org/base-model"
    assert resolved.config.dataset == run.dataset.path and resolved.config.eval_dataset is None
    assert resolved.origins == {"adapter_path": "run", "base_model": "run", "dataset": "run"}
    assert cfg.adapter_path is None  # the given config is left as it was


def test_a_run_dataset_that_is_not_reachable_is_not_filled_in(tmp_path):
    resolved = resolve_inputs(load_config(), _run(tmp_path, data_exists=False))
    assert resolved.config.dataset is None and "dataset" not in resolved.origins


def test_the_tokenizer_is_the_configs_then_the_base_then_the_adapters_base(tmp_path):
    run = _run(tmp_path)
    named = resolve_inputs(load_config(overrides={"tokenizer": "tok", "base_model": "b"}), run)
    assert (named.tokenizer_name, named.tokenizer_given) == ("tok", True)
    given = resolve_inputs(load_config(overrides={"base_model": "b"}), run)
    assert (given.tokenizer_name, given.tokenizer_origin, given.tokenizer_given) == ("b", "--base-model", True)
    from_run = resolve_inputs(load_config(), run)
    assert (from_run.tokenizer_name, from_run.tokenizer_given, from_run.tokenizer_is_local) == (
        "org/base-model", False, False)
    local_base = tmp_path / "base"
    local_base.mkdir()
    assert resolve_inputs(load_config(), _run(tmp_path, base=str(local_base))).tokenizer_is_local
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(local_base),
                                                             "peft_type": "LORA", "r": 4}))
    from_adapter = resolve_inputs(load_config(overrides={"adapter_path": str(adapter)}))
    assert (from_adapter.tokenizer_name, from_adapter.tokenizer_given) == (str(local_base), False)
    assert from_adapter.tokenizer_origin == "adapter_config.json base_model_name_or_path"
    assert resolve_inputs(load_config()).tokenizer_name is None
