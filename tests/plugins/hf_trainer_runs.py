"""Output folders written by a real transformers ``Trainer`` on a tiny LoRA model (CPU, seconds).

``hf_trainer_runs`` trains two runs once per session and returns their folders with the
arguments they were given (the ground truth a reader must recover):

- ``planted``: lr 5e-3 at alpha/r = 2 (effective 1e-2), no warmup, batch 1 without accumulation,
  clipping off (max_grad_norm 0), linear schedule, logged from step 1; no checkpoints, then
  ``save_model`` and ``save_state`` (trainer_state.json at the top level).
- ``clipped``: lr 1e-6 (effective 2e-6), cosine with 3 warmup steps, batch 2 x accumulation 2,
  max_grad_norm 1e-4 (so every step clips), a checkpoint every 4 steps, then ``save_model`` only:
  trainer_state.json lives in the checkpoints alone.

Tests copy a folder before removing files from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

N_ROWS = 16

PLANTED_ARGS: dict[str, Any] = dict(
    learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=0, per_device_train_batch_size=1,
    gradient_accumulation_steps=1, max_grad_norm=0.0, num_train_epochs=1, seed=11, logging_steps=1,
    save_strategy="no",
)
CLIPPED_ARGS: dict[str, Any] = dict(
    learning_rate=1e-6, lr_scheduler_type="cosine", warmup_steps=3, per_device_train_batch_size=2,
    gradient_accumulation_steps=2, max_grad_norm=1e-4, num_train_epochs=2, seed=12, logging_steps=1,
    save_strategy="steps", save_steps=4,
)


def train_tiny_run(out: Path, **args: Any) -> Path:
    """Fine-tune a tiny Llama with LoRA (r=4, alpha=8) through ``transformers.Trainer``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from tests.plugins.tiny_lora import build_tiny_base

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return N_ROWS

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    model = get_peft_model(build_tiny_base("llama", seed=0).train(),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    save_state = args.pop("save_state", False)
    training_args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, disable_tqdm=True, **args)
    trainer = Trainer(model=model, args=training_args, train_dataset=Rows())
    trainer.train()
    trainer.save_model()
    if save_state:
        trainer.save_state()
    return out


@pytest.fixture(scope="session")
def hf_trainer_runs(tmp_path_factory) -> dict[str, tuple[Path, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf_trainer")
    return {
        "planted": (train_tiny_run(root / "planted", save_state=True, **PLANTED_ARGS), PLANTED_ARGS),
        "clipped": (train_tiny_run(root / "clipped", **CLIPPED_ARGS), CLIPPED_ARGS),
    }
