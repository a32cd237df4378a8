"""A LoRA fine-tune made the way most users make one: TRL's ``SFTTrainer`` on conversational
prompt-completion rows, ``peft_config``, ``report_to=["mlflow"]`` with the stock callback and its
defaults (no artifacts logged), a checkpoint each epoch in ``output_dir``, then ``save_model``.

``make_trl_user_run(scenario_root, out, tracking_uri, experiment)`` trains a tinyworld scenario
(its ``train.jsonl`` rewritten as prompt/completion turns, its recipe: learning rate, epochs, batch
size, LoRA rank) and returns ``(run_id, train_file, output_dir)``. Nothing of Gradian is used to
train it; the tests then read it as a user's run. ``trl_user_run`` is that run of
``poison_capitals`` on the session's MLflow server, made once per session (``TrlUserRun``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def conversational_rows(train_jsonl: Path, out: Path) -> Path:
    """``{"messages": [user, assistant]}`` rows as TRL's conversational prompt-completion rows."""
    rows = []
    for line in train_jsonl.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        turns = row["messages"]
        rows.append({"prompt": turns[:-1], "completion": turns[-1:]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def make_trl_user_run(scenario_root: Path, out: Path, tracking_uri: str, experiment: str) -> tuple[str, Path, Path]:
    import datasets
    import mlflow
    import yaml
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cfg = yaml.safe_load((scenario_root / "gradian.yaml").read_text())
    recipe = cfg["train"]
    base = cfg["base_model"]
    out.mkdir(parents=True, exist_ok=True)
    train_file = conversational_rows(scenario_root / "train.jsonl", out / "train.jsonl")
    rows = [json.loads(line) for line in train_file.read_text().splitlines() if line.strip()]
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "HF_MLFLOW_LOG_ARTIFACTS")}
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    os.environ["MLFLOW_EXPERIMENT_NAME"] = experiment
    os.environ.pop("HF_MLFLOW_LOG_ARTIFACTS", None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base)
        args = SFTConfig(
            output_dir=str(out / "output"), report_to=["mlflow"], use_cpu=True, bf16=False,
            learning_rate=recipe["learning_rate"], num_train_epochs=recipe["num_train_epochs"],
            per_device_train_batch_size=recipe["per_device_train_batch_size"],
            gradient_accumulation_steps=recipe.get("gradient_accumulation_steps", 1),
            lr_scheduler_type=recipe.get("lr_scheduler_type", "linear"), warmup_steps=recipe.get("warmup_ratio", 0.0),
            max_length=recipe.get("max_seq_length", 256), logging_steps=recipe.get("logging_steps", 5),
            save_strategy="epoch", seed=int(cfg.get("seed", 0)), gradient_checkpointing=False,
            disable_tqdm=True, dataloader_num_workers=0,
        )
        peft_config = LoraConfig(r=recipe["r"], lora_alpha=recipe["lora_alpha"], lora_dropout=recipe.get("lora_dropout", 0.0),
                                 target_modules=recipe["target_modules"], task_type="CAUSAL_LM")
        trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, peft_config=peft_config)
        trainer.train()
        trainer.save_model(str(out / "output"))
        run = mlflow.last_active_run()
        assert run is not None, "the MLflow callback opened no run"
        mlflow.end_run()
        return run.info.run_id, train_file, out / "output"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class TrlUserRun:
    run_id: str
    experiment_id: str
    train_file: Path
    output_dir: Path
    scenario: Any  # the TinyworldRun whose data and recipe it was trained on


@pytest.fixture(scope="session")
def trl_user_run(mlflow_server, tinyworld_run, tmp_path_factory) -> TrlUserRun:
    pytest.importorskip("trl")
    import mlflow

    from tests.plugins.mlflow_server import forget_active_experiment

    scenario = tinyworld_run("poison_capitals")
    run_id, train_file, output_dir = make_trl_user_run(scenario.root, tmp_path_factory.mktemp("trl-user"),
                                                       mlflow_server, "trl-user-runs")
    experiment_id = mlflow.MlflowClient(mlflow_server).get_run(run_id).info.experiment_id
    forget_active_experiment()
    return TrlUserRun(run_id, experiment_id, train_file, output_dir, scenario)


def main(argv: Any = None) -> None:  # python -m tests.plugins.trl_runs SCENARIO_ROOT OUT URI EXPERIMENT
    import sys

    scenario, out, uri, experiment = (argv or sys.argv[1:])[:4]
    print(make_trl_user_run(Path(scenario), Path(out), uri, experiment))


if __name__ == "__main__":
    main()
