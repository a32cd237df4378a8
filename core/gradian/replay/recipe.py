"""The recipe of a recorded fine-tune, as the replay needs it: learning rate per step, optimizer, data order.

Interface: ``run_trainer_config(config)`` is the run's trainer arguments or the replay's refusal
of a run without them; ``replay_max_seq_length(config, fallback)`` and
``trained_positions(supervised, max_seq_length)`` say which rows the run trained on, as the
trainer cut and dropped them; ``recipe_from_run(config, n_rows) -> RunRecipe`` reads a ``TrainerConfig`` (the run's
trainer arguments, as every run source records them) and returns the per-step learning rates, the
optimizer settings and the rows of each optimizer step, in the trainer's own order; it raises a
``ConfigError`` naming the setting when the run trained in a way the replay cannot reproduce.

The order is the one the HF Trainer (and TRL's SFTTrainer, which inherits its loop) draws: in
epoch ``e`` the rows are ``torch.randperm(n)`` of a generator seeded with ``data_seed + e``
(``data_seed`` defaults to ``seed``; accelerate's seedable sampler, the Trainer's default), cut into
batches of ``per_device_train_batch_size``, the last one shorter; ``gradient_accumulation_steps``
consecutive batches make one optimizer step, an epoch's leftover batches one more. The learning
rates come from transformers' own scheduler of that name, stepped once per optimizer step.
What cannot be reproduced is refused: several processes, a length-grouped sampler, packing, label
smoothing, an optimizer other than AdamW or SGD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gradian.errors import ConfigError
from gradian.replay.unrolled import Recipe

if TYPE_CHECKING:
    from gradian.runs import TrainerConfig

__all__ = ["RunRecipe", "recipe_from_run", "learning_rates", "run_trainer_config", "replay_max_seq_length",
           "trained_positions"]

#: ``optim`` values of the HF Trainer that are AdamW as torch computes it (fused or not)
_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")
_SGD = ("sgd",)


@dataclass(frozen=True)
class RunRecipe:
    """A run's replayable recipe: the optimizer and schedule, the rows of each step, the seed."""

    recipe: Recipe
    #: per optimizer step, the indices of its rows among the rows the trainer saw
    batches: list[list[int]]
    seed: int
    data_seed: int
    epochs: float
    #: optimizer steps in one full epoch
    steps_per_epoch: int
    #: what the replay assumes that the run did not record, for the report
    notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.batches)


def _setting(config: TrainerConfig, key: str, default: object = None) -> Any:
    """A trainer setting as the run recorded it (a field, else the verbatim ``extra``), of whatever type it
    was written in: the caller converts it."""
    value = getattr(config, key, None)
    if value is None:
        value = (config.extra or {}).get(key)
    return default if value is None else value


def learning_rates(scheduler: str, peak: float, warmup: int, total: int,
                   kwargs: Mapping[str, object] | None = None) -> list[float]:
    """The learning rate of each of ``total`` optimizer steps under transformers' scheduler ``scheduler``."""
    import torch
    from transformers import get_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    try:
        sched = get_scheduler(scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                              scheduler_specific_kwargs=dict(kwargs or {}))
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"lr_scheduler_type {scheduler!r}: transformers cannot build it ({err}); the replay "
                          "needs the run's scheduler") from None
    out = []
    for _ in range(total):
        out.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        sched.step()
    return out


def _order(n_rows: int, batch_size: int, accumulation: int, epochs: float, max_steps: int, data_seed: int,
           drop_last: bool) -> tuple[list[list[int]], int]:
    """(rows of each optimizer step, optimizer steps per epoch), drawn as the Trainer draws them."""
    import torch

    per_epoch_batches = n_rows // batch_size if drop_last else math.ceil(n_rows / batch_size)
    if per_epoch_batches == 0:
        raise ConfigError(f"per_device_train_batch_size={batch_size} with dataloader_drop_last leaves no batch of "
                          f"the {n_rows} training rows; nothing to replay")
    per_epoch_steps = max(per_epoch_batches // accumulation + int(per_epoch_batches % accumulation > 0), 1)
    total = max_steps if max_steps > 0 else math.ceil(epochs * per_epoch_steps)
    steps: list[list[int]] = []
    epoch = 0
    while len(steps) < total:
        generator = torch.Generator()
        generator.manual_seed(data_seed + epoch)
        perm = torch.randperm(n_rows, generator=generator).tolist()
        batches = [perm[i:i + batch_size] for i in range(0, n_rows, batch_size)]
        if drop_last and len(batches[-1]) < batch_size:
            batches = batches[:-1]
        for start in range(0, len(batches), accumulation):
            steps.append([r for b in batches[start:start + accumulation] for r in b])
            if len(steps) == total:
                break
        epoch += 1
    return steps, per_epoch_steps


def run_trainer_config(config: TrainerConfig | None) -> TrainerConfig:
    """``config``, the run's trainer arguments; without them the replay has no recipe to retrain
    by, and this is its refusal (the engine's and the planner's alike)."""
    if config is None:
        raise ConfigError("engine.name replay retrains the run from its trainer arguments (learning rate, epochs, "
                          "batch size, seed): pass the training run with --run OUTPUT_DIR or --mlflow-run ID, "
                          "or choose engine.name: ekfac")
    return config


def replay_max_seq_length(config: TrainerConfig, fallback: int | None) -> int | None:
    """The length the run cut its rows at: its own ``max_seq_length``, else ``fallback``
    (``grads.max_seq_length``) when it records none."""
    return config.max_seq_length if config.max_seq_length is not None else fallback


def trained_positions(supervised: Sequence[int], max_seq_length: int | None) -> list[int]:
    """The dataset positions of the rows the run trained on: those keeping a supervised token at
    ``max_seq_length`` (``supervised``: each row's supervised tokens there), as the trainer drops
    the others. Refused when no row keeps one."""
    kept = [j for j, n in enumerate(supervised) if n > 0]
    if not kept:
        raise ConfigError(f"replay: no training row keeps a supervised token at max_seq_length={max_seq_length}")
    return kept


def recipe_from_run(config: TrainerConfig | None, n_rows: int) -> RunRecipe:
    """The replayable recipe of the run whose trainer arguments are ``config`` (a ``TrainerConfig``),
    trained on ``n_rows`` rows (those with a supervised token, in dataset order)."""
    config = run_trainer_config(config)
    notes: list[str] = []
    lr = _setting(config, "learning_rate")
    batch = _setting(config, "per_device_train_batch_size")
    seed = _setting(config, "seed")
    missing = [k for k, v in (("learning_rate", lr), ("per_device_train_batch_size", batch), ("seed", seed))
               if v is None]
    if missing:
        raise ConfigError(f"engine.name replay: the run does not record {', '.join(missing)}; the replay cannot "
                          "retrain it. Choose another engine.name (ekfac) for this run")
    world = int(_setting(config, "world_size", 1) or 1)
    if world > 1:
        raise ConfigError(f"engine.name replay: the run trained on {world} processes (world_size); the replay "
                          "reproduces single-process runs only. Choose engine.name: ekfac")
    sampling = str(_setting(config, "train_sampling_strategy", "random"))
    if sampling != "random" or _setting(config, "group_by_length", False):
        raise ConfigError(f"engine.name replay: the run drew batches by {sampling if sampling != 'random' else 'length'} "
                          "(train_sampling_strategy / group_by_length); the replay reproduces the random order "
                          "only. Choose engine.name: ekfac")
    if _setting(config, "packing", False):
        raise ConfigError("engine.name replay: the run packed rows together (packing: true); the replay trains "
                          "row by row. Choose engine.name: ekfac")
    if float(_setting(config, "label_smoothing_factor", 0.0) or 0.0) != 0.0:
        raise ConfigError("engine.name replay: the run smoothed labels (label_smoothing_factor); the replay's loss "
                          "is plain cross-entropy. Choose engine.name: ekfac")
    optim = str(_setting(config, "optim", "adamw_torch"))
    if optim in _ADAMW:
        optimizer = "adamw"
    elif optim in _SGD:
        optimizer = "sgd"
    else:
        raise ConfigError(f"engine.name replay: optim {optim!r} is not one the replay can differentiate (AdamW: "
                          f"{', '.join(_ADAMW)}; or sgd). Choose engine.name: ekfac")
    seed = int(seed)
    data_seed = _setting(config, "data_seed")
    if data_seed is None:
        notes.append(f"the run records no data_seed; its batches are drawn from seed {seed}, as the trainer does")
        data_seed = seed
    accumulation = int(_setting(config, "gradient_accumulation_steps", 1) or 1)
    epochs = float(_setting(config, "num_train_epochs", 3.0))
    max_steps = int(_setting(config, "max_steps", -1) or -1)
    drop_last = bool(_setting(config, "dataloader_drop_last", False))
    batches, per_epoch = _order(n_rows, int(batch), accumulation, epochs, max_steps, int(data_seed), drop_last)
    total = len(batches)
    warmup_steps = _setting(config, "warmup_steps")
    if warmup_steps is not None and float(warmup_steps) >= 1:
        warmup = int(warmup_steps)
    else:
        ratio = float(warmup_steps if warmup_steps is not None else _setting(config, "warmup_ratio", 0.0) or 0.0)
        warmup = math.ceil(total * ratio)
    scheduler = str(_setting(config, "lr_scheduler_type", "linear"))
    kwargs = _setting(config, "lr_scheduler_kwargs") or {}
    schedule = learning_rates(scheduler, float(lr), warmup, total, kwargs if isinstance(kwargs, dict) else {})
    recipe = Recipe(
        schedule=schedule,
        optimizer=optimizer,
        betas=(float(_setting(config, "adam_beta1", 0.9)), float(_setting(config, "adam_beta2", 0.999))),
        eps=float(_setting(config, "adam_epsilon", 1e-8)),
        weight_decay=float(_setting(config, "weight_decay", 0.0) or 0.0),
        max_grad_norm=float(_setting(config, "max_grad_norm", 1.0) or 0.0),
        reduction="tokens",
    )
    recipe.check(len(batches))
    return RunRecipe(recipe=recipe, batches=batches, seed=seed, data_seed=int(data_seed), epochs=epochs,
                     steps_per_epoch=per_epoch, notes=notes)
