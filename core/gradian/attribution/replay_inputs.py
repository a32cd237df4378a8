"""What the replay engine is handed: the run's recipe, its initial LoRA tensors and the rows as the trainer saw them.

Interface: ``replay_inputs(cfg, gm, tokenizer, dataset, run) -> ReplayInputs``. The lane gathers
everything that touches the model or the run here, so the engine stays math over what it is given:

- the recipe (learning rate per step, optimizer, rows of each step) from the run's trainer
  arguments (``gradian.replay.recipe.recipe_from_run``);
- the rows tokenized at the run's own ``max_seq_length``, those without a supervised token left
  out as the trainer left them out;
- the initial LoRA tensors: peft's initialization of the adapter's LoRA settings drawn right after
  seeding with the run's seed, as ``gradian train`` (and a trainer seeded before it wraps the
  model) draws them; the torch random state is restored afterwards;
- under ``engine.replay_start: auto``, the run's latest trainer checkpoint at or before the first
  differentiated step whose LoRA tensors and optimizer moments agree with the recipe
  (``gradian.replay.trainer_checkpoint``): the replay starts from it, retraining only the steps after;
- where the replay keeps its states (``<cache_dir>/replay``, in a folder named by everything the
  replay computes from, the base model's and tokenizer's fingerprints among them), and the
  interval between them (``engine.replay_checkpoint_every``);
- the check, before any step, that the replay fits the memory free on its device: the plan's
  pricing of this replay (``gradian.plan.replay.replay_cost``) beyond the weights already loaded,
  against the free device memory (CUDA) or the host memory available (``check_replay_memory``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from gradian.errors import ConfigError
from gradian.replay.engine import ReplayInputs, window_start
from gradian.replay.recipe import recipe_from_run, replay_max_seq_length, run_trainer_config, trained_positions
from gradian.replay.trainer_checkpoint import StartChoice, choose_start

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset, TokenizedExample
    from gradian.grads import GradientModel
    from gradian.runs import RunRecord

__all__ = ["check_replay_memory", "replay_inputs"]

_INIT_ADAPTER = "gradian-replay-init"


def replay_inputs(cfg: GradianConfig, gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset,
                  run: RunRecord | None, tokenized: Sequence[TokenizedExample] | None = None) -> ReplayInputs:
    """``tokenized``: the rows as the lane tokenized them (at ``grads.max_seq_length``), reused when
    the run truncated at the same length."""
    from gradian.data import tokenize_examples

    config = run_trainer_config(getattr(run, "config", None))
    notes: list[str] = []
    max_seq_length = replay_max_seq_length(config, cfg.grads.max_seq_length)
    if config.max_seq_length is None:
        notes.append(f"the run records no max_seq_length; rows are truncated at grads.max_seq_length={max_seq_length}")
    if tokenized is not None and max_seq_length == cfg.grads.max_seq_length:
        rows = list(tokenized)
    else:
        rows = tokenize_examples(dataset.examples, tokenizer, max_seq_length)
    positions = trained_positions([row.n_supervised for row in rows], max_seq_length)
    run_recipe = recipe_from_run(config, len(positions))
    model = gm.model
    adapter = gm.adapter_name
    lora = _adapter_tensors(model, adapter)
    peft_config = model.peft_config[adapter]
    dropout = float(getattr(peft_config, "lora_dropout", 0.0) or 0.0)
    if dropout > 0:
        notes.append(f"the run trained with lora_dropout {dropout:g}; the replay trains without dropout, so it "
                     "cannot match the run's random masks")
    init = _initial_tensors(model, adapter, run_recipe.seed)
    missing = sorted(set(lora) - set(init))
    if missing:
        raise ConfigError(f"replay: peft's initialization of the adapter has no tensor {missing[0]}; the adapter's "
                          "LoRA settings cannot be re-created")
    choice = StartChoice()
    if cfg.engine.replay_start == "auto":
        choice = choose_start(list(getattr(run, "checkpoints", None) or []), lora, adapter, run_recipe.recipe,
                              window_start(run_recipe, cfg.engine.replay_horizon))
        notes.extend(choice.notes)
    if choice.start is not None:
        notes.append(f"started from the run's own state in {choice.path} (its LoRA tensors and optimizer moments "
                     f"after step {choice.start.step}); the steps before it were not retrained")
    from gradian.index.manifest import tokenizer_fingerprint

    base = gm.fingerprints.get("base")
    inputs = ReplayInputs(model=model, lora_params=lora, init={n: init[n] for n in lora},
                          rows=[rows[j] for j in positions], positions=positions, n_examples=len(rows),
                          run_recipe=run_recipe, pad_id=tokenizer.pad_token_id, tokenizer=tokenizer,
                          query_max_seq_length=cfg.grads.max_seq_length, notes=notes,
                          checkpoint_every=cfg.engine.replay_checkpoint_every, horizon=cfg.engine.replay_horizon,
                          # a model loaded without a fingerprint has no name to key its states by
                          state_dir=Path(cfg.cache_dir) / "replay" if base else None,
                          identity={"base": base or "", "tokenizer": tokenizer_fingerprint(tokenizer)},
                          start=choice.start, start_params=choice.params, scaling=cfg.engine.replay_scaling)
    if base is None:
        notes.append("the base model has no content fingerprint, so the replay's states are held in memory, "
                     "not written under cache_dir, and an interrupted replay starts over")
    check_replay_memory(cfg, inputs)
    return inputs


def check_replay_memory(cfg: GradianConfig, inputs: ReplayInputs) -> None:
    """Refuse, before any step, a replay that cannot fit the memory free on its device.

    What the replay adds to the loaded model is priced as ``gradian plan`` prices it (the states
    held at once, the row weights and their gradient, one differentiated step's graph on the run's
    widest step) and compared with the free memory of the CUDA device the model is on, or the host
    memory available on a CPU. A model whose shape the planner cannot read is not checked (a note
    says so)."""
    import torch

    from gradian.errors import ConfigError
    from gradian.plan.memory import CaptureSettings
    from gradian.plan.replay import replay_cost
    from gradian.plan.shapes import AdapterShape, read_model_shape
    from gradian.sizes import available_memory, format_size

    model = inputs.model
    peft_config = model.peft_config[model.active_adapter]
    targets = peft_config.target_modules
    some = next(iter(inputs.lora_params.values()))
    try:
        shape = read_model_shape(model.get_base_model().config.to_dict())
        adapter = AdapterShape(int(peft_config.r), targets if isinstance(targets, str) else tuple(sorted(targets)),
                               dtype=str(some.dtype).removeprefix("torch."))
        dtype = str(next(model.get_base_model().parameters()).dtype).removeprefix("torch.")
        cost = replay_cost(inputs.run_recipe, shape, adapter, [len(r.input_ids) for r in inputs.rows],
                           [r.n_supervised for r in inputs.rows],
                           CaptureSettings(dtype=dtype, attn_implementation=cfg.attn_implementation),
                           inputs.horizon, checkpoint_every=inputs.checkpoint_every,
                           on_disk=inputs.state_dir is not None, start_step=inputs.start_step)
    except (ConfigError, KeyError, TypeError, ValueError) as err:
        inputs.notes.append(f"the replay's memory was not checked before it started: the planner cannot read this "
                            f"model's shape ({err})")
        return
    need = cost.peak - cost.weights - cost.adapter  # the model and its adapter are loaded already
    device = some.device
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"is free on {device}"
    else:
        free, where = available_memory(), "of host memory is available"
    if need > free:
        w = cost.widest_step
        raise ConfigError(
            f"engine.name replay needs about {format_size(need)} beside the loaded model ({cost.peak_states + 2} "
            f"states of {format_size(cost.state_bytes)}, the interval between kept states being {cost.checkpoint_every} "
            f"steps; one differentiated step's graph {format_size(cost.step_graph)} on the run's widest step, "
            f"{w.rows} rows x {w.width} tokens), and {format_size(free)} {where}: set "
            "engine.replay_checkpoint_every lower (fewer states held at once), free memory, or choose engine.name: ekfac")


def _adapter_tensors(model: PeftModel, adapter: str) -> dict[str, torch.nn.Parameter]:
    """Every LoRA A/B tensor of ``adapter``: the replay trains what the run trained, whatever
    ``grads.module_filter`` selected for the index."""
    marker = f".{adapter}."
    out = {name: param for name, param in model.named_parameters()
           if marker in name and (".lora_A." in name or ".lora_B." in name)}
    if not out:
        raise ConfigError(f"replay: the model has no LoRA tensor of adapter {adapter!r}")
    return out


def _initial_tensors(model: PeftModel, adapter: str, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's LoRA tensors as peft initializes them right after ``set_seed(seed)``."""
    import copy

    import torch
    import transformers

    state = torch.random.get_rng_state()
    # adding and switching adapters changes which tensors are trainable; the index's choice stays
    trainable = {name: param.requires_grad for name, param in model.named_parameters()}
    config = copy.deepcopy(model.peft_config[adapter])
    config.lora_dropout = 0.0
    config.inference_mode = False
    try:
        transformers.set_seed(seed)
        model.add_adapter(_INIT_ADAPTER, config)
        marker = f".{_INIT_ADAPTER}."
        out = {name.replace(marker, f".{adapter}."): param.detach().clone()
               for name, param in model.named_parameters() if marker in name}
    finally:
        if _INIT_ADAPTER in model.peft_config:
            model.delete_adapter(_INIT_ADAPTER)
        model.set_adapter(adapter)
        for name, param in model.named_parameters():
            param.requires_grad_(trainable.get(name, False))
        torch.random.set_rng_state(state)
    return out
