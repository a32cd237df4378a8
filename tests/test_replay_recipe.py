"""The replay reads a run's recipe and retrains it as the HF Trainer did (gradian.replay.recipe).

Ground truth: real ``transformers.Trainer`` runs on a tiny Llama with LoRA. The replay starts from
the LoRA tensors the trainer started from and follows ``recipe_from_run`` (rows of each step,
learning rate of each step, AdamW settings, clipping, the token-mean loss); its final adapter must
equal the trainer's to float32 rounding. A wrong row order, a step too many or a learning rate off
by one step moves the adapter by orders of magnitude more.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.errors import ConfigError  # noqa: E402
from gradian.replay import replay  # noqa: E402
from gradian.replay.recipe import learning_rates, recipe_from_run  # noqa: E402
from gradian.runs import normalize_trainer_config  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

ROWS = [{"prompt": f"question {k} about {'abcdefghi'[k]} ?", "completion": " ".join(["answer"] * (1 + k % 3))}
        for k in range(9)]

CASES = {
    # 9 rows in batches of 2 (the last one 1 row), 2 batches a step: an epoch is 3 steps, the last of one batch
    "accumulated-cosine-clipped": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                       num_train_epochs=2, lr_scheduler_type="cosine", warmup_steps=2,
                                       learning_rate=3e-2, max_grad_norm=0.05, weight_decay=0.01, seed=5),
    # a data_seed of its own and a fractional epoch count
    "data-seed-linear": dict(per_device_train_batch_size=3, num_train_epochs=1.5, lr_scheduler_type="linear",
                             warmup_steps=0.2, learning_rate=2e-2, max_grad_norm=1.0, seed=3, data_seed=8),
    # max_steps past one epoch wins over the epoch count
    "max-steps": dict(per_device_train_batch_size=4, max_steps=5, num_train_epochs=1, learning_rate=1e-2,
                      lr_scheduler_type="constant", seed=1),
}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = [{"input_ids": list(r.input_ids), "labels": list(r.labels)} for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.fixture(scope="module")
def rows(chat_tokenizer):
    return tokenize_examples(dataset_from_rows(ROWS).examples, chat_tokenizer, 64)


def _trained(tmp_path, rows, pad_id, args):
    from transformers import Trainer, TrainingArguments

    from gradian.train.data import PadCollator

    model = build_tiny_lora("llama", target_modules=["q_proj", "v_proj"])
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    training_args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True,
                                      save_strategy="no", logging_steps=1, remove_unused_columns=False, **args)
    trainer = Trainer(model=model.train(), args=training_args, train_dataset=_Rows(rows),
                      data_collator=PadCollator(pad_id))
    trainer.train()
    config = normalize_trainer_config(json.loads(json.dumps(training_args.to_dict(), default=str)))
    lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    return model.eval(), init, config, trainer.state.global_step, lrs


@pytest.mark.parametrize("case", list(CASES))
def test_the_replayed_run_is_the_trainers_run(tmp_path, rows, chat_tokenizer, case):
    model, init, config, global_step, logged = _trained(tmp_path, rows, chat_tokenizer.pad_token_id, CASES[case])
    recipe = recipe_from_run(config, len(rows))
    assert recipe.steps == global_step
    # the trainer logs the learning rate of the step it just took
    assert recipe.recipe.schedule == pytest.approx(logged, rel=1e-9, abs=1e-15)
    lora = {n: p for n, p in model.named_parameters() if n in init}
    final = replay(model, {n: init[n] for n in lora}, rows, recipe.batches, torch.ones(len(rows)), recipe.recipe,
                   pad_id=chat_tokenizer.pad_token_id)
    num = sum(float(((final[n] - p.detach()) ** 2).sum()) for n, p in lora.items()) ** 0.5
    den = sum(float(((p.detach() - init[n]) ** 2).sum()) for n, p in lora.items()) ** 0.5
    assert den > 0, "the run did not move the adapter"
    assert num / den < 1e-4, f"replayed adapter off the run's by {num / den:.2e} of the update"


def test_every_row_once_per_epoch_in_the_trainers_batches(rows):
    config = normalize_trainer_config(dict(CASES["accumulated-cosine-clipped"], output_dir="x"))
    recipe = recipe_from_run(config, len(rows))
    assert recipe.steps == 6 and recipe.steps_per_epoch == 3
    assert [len(step) for step in recipe.batches] == [4, 4, 1, 4, 4, 1]
    for epoch in (recipe.batches[:3], recipe.batches[3:]):
        assert sorted(r for step in epoch for r in step) == list(range(len(rows)))
    assert recipe.batches[:3] != recipe.batches[3:]


def test_learning_rates_follow_the_named_scheduler():
    assert learning_rates("linear", 1.0, 2, 6) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    with pytest.raises(ConfigError, match="lr_scheduler_type 'no-such'"):
        learning_rates("no-such", 1.0, 0, 3)


@pytest.mark.parametrize("change, message", [
    ({"world_size": 2}, "world_size"),
    ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy"),
    ({"packing": True}, "packing"),
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
    ({"optim": "adafactor"}, "optim 'adafactor'"),
    ({"seed": None}, "seed"),
])
def test_a_run_the_replay_cannot_reproduce_is_refused_naming_why(change, message):
    raw = dict(CASES["data-seed-linear"], output_dir="x")
    raw.update(change)
    config = normalize_trainer_config({k: v for k, v in raw.items() if v is not None})
    with pytest.raises(ConfigError, match=message):
        recipe_from_run(config, 9)
    with pytest.raises(ConfigError, match="--run OUTPUT_DIR or --mlflow-run ID"):
        recipe_from_run(None, 9)
