"""The 17 ``config.*`` checks: the trainer and adapter settings a run recorded.

They read the normalized ``RunRecord`` only (and, for a few, the dataset size or the tokenizer).
Derived figures (effective batch size, effective LoRA learning rate, planned optimizer steps,
warmup fraction) come from ``RunRecord`` and are never recomputed here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from gradian.audit.context import AuditContext
from gradian.audit.registry import CheckOutcome, CheckSkipped, register

if TYPE_CHECKING:
    from gradian.runs import RunRecord

__all__: list[str] = []

#: module names of attention projections across common architectures (Llama, Mistral, Qwen,
#: GPT-2/NeoX, Falcon, Phi, OPT, T5)
_ATTENTION_MODULES = {
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "c_attn", "query_key_value",
    "query", "key", "value", "q", "k", "v", "o", "out_proj", "wq", "wk", "wv", "wo", "Wqkv",
}


def _run(ctx: AuditContext) -> RunRecord:
    if ctx.run is None:  # the runner only calls a check whose inputs exist
        raise CheckSkipped("no training run")
    return ctx.run


def _rate_figures(ctx: AuditContext) -> tuple[float, float, float, str]:
    """(configured lr, alpha/r scale, effective lr, how the scale was computed)."""
    run = _run(ctx)
    lr = run.config.learning_rate
    if lr is None:
        raise CheckSkipped("the run did not record learning_rate")
    scale = run.lora.scaling
    if scale is None:
        raise CheckSkipped("LoRA r and alpha are unknown (no adapter_config.json in the run: pass --adapter DIR or --run OUTPUT_DIR)")
    label = "alpha/sqrt(r)" if run.lora.use_rslora else "alpha/r"
    effective = run.effective_lora_lr
    assert effective is not None  # known whenever learning_rate and the scale are
    return lr, scale, effective, label


def _rate_text(lr: float, scale: float, effective: float, label: str) -> str:
    return f"lr={lr:g} x {label}={scale:g} = {effective:g}"


def _inferred_note(ctx: AuditContext, *names: str) -> str:
    """A sentence naming the settings this finding used that the run did not record."""
    used = [name for name in names if name in _run(ctx).inferred]
    if not used:
        return ""
    return (f" ({', '.join(used)} not recorded by the run: inferred from its logged learning rates; "
            "see evidence.inferred.)")


def _epochs(ctx: AuditContext) -> float | None:
    """Passes over the data: ``max_steps`` converted when it overrides the epoch count."""
    run = _run(ctx)
    c = run.config
    if c.max_steps and c.max_steps > 0:
        n, batch = ctx.n_examples, run.effective_batch_size
        if n and batch:
            return c.max_steps * batch / n
        return None
    return c.num_train_epochs


@register("config.attention_only_targets", "LoRA adapts attention projections only, no MLP", needs=("run",))
def attention_only_targets(ctx: AuditContext) -> CheckOutcome:
    targets = _run(ctx).lora.target_modules
    if not targets:
        raise CheckSkipped("target_modules unknown (no adapter_config.json in the run: pass --adapter DIR or --run OUTPUT_DIR)")
    if any(t in ("all-linear", "all_linear") for t in targets):
        return None
    short = {t.rsplit(".", 1)[-1] for t in targets}
    if not short <= _ATTENTION_MODULES:
        return None
    shown = sorted(targets)
    return ctx.finding(
        "medium",
        f"LoRA targets attention only: {shown}",
        f"The adapter only touches the attention projections {shown}; the MLP blocks, where much "
        "factual and task knowledge is stored, cannot adapt. That is a legitimate memory-saving "
        "choice, but worth revisiting when a capability regressed or failed to improve.",
        "Add the MLP projections (e.g. target_modules=['q_proj','k_proj','v_proj','o_proj',"
        "'gate_proj','up_proj','down_proj'] or 'all-linear') and retrain.",
        evidence={"target_modules": shown},
    )


def _model_key(name: str) -> str:
    return name.strip().rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].lower()


@register("config.base_model_mismatch", "Adapter's recorded base model differs from the one given", needs=("run",))
def base_model_mismatch(ctx: AuditContext) -> CheckOutcome:
    recorded = _run(ctx).lora.base_model
    if not recorded:
        raise CheckSkipped("the adapter config records no base_model_name_or_path")
    given = ctx.base_model
    if not given:
        raise CheckSkipped("no base model given to compare against (pass --base-model)")
    # A local copy of a hub model keeps the hub name as its last path component.
    if _model_key(recorded) == _model_key(given):
        return None
    # A local directory under another name may still be a copy of the recorded model: say so,
    # at a lower severity, rather than accuse it outright.
    local = Path(given).is_dir()
    return ctx.finding(
        "medium" if local else "high",
        f"Adapter was trained on {recorded!r}, not {given!r}",
        f"adapter_config.json says the adapter belongs to {recorded!r}, but this analysis uses "
        f"{given!r}. An adapter applied to a different base computes something else entirely, so "
        "every tokenizer-based figure and any attribution would describe the wrong model."
        + (" (The given path is a local directory; if it is a copy of the recorded model under "
           "another name, this finding can be ignored.)" if local else ""),
        f"Pass --base-model {recorded} (or a local copy of it), or check that the run directory is "
        "the one you meant.",
        evidence={"adapter_base_model": recorded, "given_base_model": given},
    )


@register("config.capacity_vs_data", "LoRA rank high for the number of training rows", needs=("run",))
def capacity_vs_data(ctx: AuditContext) -> CheckOutcome:
    r = _run(ctx).lora.r
    if not r:
        raise CheckSkipped("LoRA rank unknown (no adapter_config.json in the run: pass --adapter DIR or --run OUTPUT_DIR)")
    n = ctx.n_examples
    if not n:
        raise CheckSkipped("dataset size unknown (pass --dataset)")
    needed = r * ctx.config.capacity_min_examples_per_rank
    if n >= needed:
        return None
    return ctx.finding(
        "low",
        f"LoRA rank {r} is large for {n} examples",
        f"Rank {r} over {n} rows is {n / r:.1f} rows per unit of rank (threshold "
        f"{ctx.config.capacity_min_examples_per_rank:g}). Spare capacity lets the adapter memorize "
        "individual rows instead of learning the pattern.",
        f"Lower r (e.g. r={max(1, 2 ** int(math.log2(max(1, n / ctx.config.capacity_min_examples_per_rank))))}) "
        "or add data.",
        evidence={"r": r, "n_examples": n, "rows_per_rank": round(n / r, 3)},
    )


@register("config.fp16_precision", "Trained in fp16 where bf16 is safer", needs=("run",))
def fp16_precision(ctx: AuditContext) -> CheckOutcome:
    c = _run(ctx).config
    if c.fp16 is None and c.bf16 is None:
        raise CheckSkipped("the run recorded neither fp16 nor bf16")
    if not c.fp16 or c.bf16:
        return None
    return ctx.finding(
        "low",
        "Trained in fp16 instead of bf16",
        "fp16 has a narrow exponent range; with a loss scaler it usually works, but overflowing "
        "activations or gradients turn into skipped steps or NaN losses that bf16 would not produce.",
        "Use bf16=True on hardware that supports it (Ampere or newer GPUs); otherwise keep fp16 and "
        "watch for NaN losses and skipped steps.",
        evidence={"fp16": True, "bf16": bool(c.bf16)},
    )


@register("config.grad_clip_disabled", "max_grad_norm turns gradient clipping off", needs=("run",))
def grad_clip_disabled(ctx: AuditContext) -> CheckOutcome:
    max_norm = _run(ctx).config.max_grad_norm
    if max_norm is None:
        raise CheckSkipped("the run did not record max_grad_norm")
    if max_norm > 0 and math.isfinite(max_norm) and max_norm < 1e6:
        return None
    return ctx.finding(
        "medium",
        f"Gradient clipping is disabled (max_grad_norm={max_norm:g})",
        f"max_grad_norm={max_norm:g} turns clipping off, so one batch with an outsized gradient "
        "can move the adapter far in a single step.",
        "Set max_grad_norm=1.0 (the transformers default).",
        evidence=_run(ctx).label_inferred({"max_grad_norm": max_norm}, "max_grad_norm"),
    )


@register("config.high_lora_dropout", "Heavy LoRA dropout on a small dataset", needs=("run",))
def high_lora_dropout(ctx: AuditContext) -> CheckOutcome:
    dropout = _run(ctx).lora.dropout
    if dropout is None:
        raise CheckSkipped("lora_dropout unknown (no adapter_config.json in the run: pass --adapter DIR or --run OUTPUT_DIR)")
    n = ctx.n_examples
    if not n:
        raise CheckSkipped("dataset size unknown (pass --dataset)")
    cfg = ctx.config
    if dropout <= cfg.high_lora_dropout or n >= cfg.dropout_small_dataset:
        return None
    return ctx.finding(
        "low",
        f"LoRA dropout {dropout:g} on {n} examples",
        f"lora_dropout={dropout:g} is above {cfg.high_lora_dropout:g} while the dataset has only {n} "
        f"rows (small below {cfg.dropout_small_dataset}); with few steps, heavy dropout mostly "
        "adds noise to an adapter that has little signal to begin with.",
        "Use lora_dropout between 0 and 0.1 for small datasets.",
        evidence={"lora_dropout": dropout, "n_examples": n},
    )


@register("config.lr_too_high", "Effective LoRA learning rate (lr x alpha/r) above the usual range", needs=("run",))
def lr_too_high(ctx: AuditContext) -> CheckOutcome:
    lr, scale, effective, label = _rate_figures(ctx)
    cfg = ctx.config
    if effective <= cfg.lr_high_effective:
        return None
    severity = "critical" if effective > cfg.lr_critical_effective else "high"
    usual_lr = cfg.reference_effective_lr / scale
    return ctx.finding(
        severity,
        f"Effective LoRA learning rate is high ({_rate_text(lr, scale, effective, label)})",
        f"LoRA scales its update by {label}, so the configured {lr:g} acts like {effective:g}: "
        f"{effective / cfg.reference_effective_lr:.1f}x the usual {cfg.reference_effective_lr:g} "
        f"(2e-4 at alpha = 2r). Rates this high overwrite what the base model knew."
        + _inferred_note(ctx, "learning_rate"),
        f"Lower learning_rate to about {usual_lr:.2g} at this {label} (or lower alpha), and keep "
        "warmup on.",
        evidence=_run(ctx).label_inferred({
            "learning_rate": lr,
            "scale": scale,
            "effective_lr": effective,
            "reference_effective_lr": cfg.reference_effective_lr,
            "use_rslora": _run(ctx).lora.use_rslora,
        }, "learning_rate"),
    )


@register("config.lr_too_low", "Effective LoRA learning rate too small to move the adapter", needs=("run",))
def lr_too_low(ctx: AuditContext) -> CheckOutcome:
    lr, scale, effective, label = _rate_figures(ctx)
    cfg = ctx.config
    if effective >= cfg.lr_low_effective:
        return None
    return ctx.finding(
        "medium",
        f"Effective LoRA learning rate is low ({_rate_text(lr, scale, effective, label)})",
        f"An effective rate of {effective:g} is below {cfg.lr_low_effective:g}, about "
        f"{cfg.reference_effective_lr / effective:.0f}x under the usual {cfg.reference_effective_lr:g}; "
        "LoRA's zero-initialized B matrix barely moves at such rates, so the adapter may have learned "
        "almost nothing." + _inferred_note(ctx, "learning_rate"),
        f"Raise learning_rate toward {cfg.reference_effective_lr / scale:.2g} at this {label}.",
        evidence=_run(ctx).label_inferred({"learning_rate": lr, "scale": scale, "effective_lr": effective},
                                          "learning_rate"),
    )


@register("config.max_seq_length_vs_data", "max_seq_length below the tokenized length most rows need", needs=("dataset", "tokenizer"))
def max_seq_length_vs_data(ctx: AuditContext) -> CheckOutcome:
    limit = ctx.max_seq_length
    if not limit:
        raise CheckSkipped("no max_seq_length (pass --max-seq-length, or a run that recorded it)")
    lengths = sorted(t.n_tokens_full for t in ctx.tokenized)
    if not lengths:
        return None
    q = ctx.config.seq_length_quantile
    quantile = _quantile(lengths, q)
    if limit >= quantile:
        return None
    over = sum(1 for n in lengths if n > limit)
    pct = round(q * 100)
    return ctx.finding(
        "high",
        f"max_seq_length={limit} is below the dataset's p{pct} length ({quantile} tokens)",
        f"Rendered with the chat template, {over} of {len(lengths)} rows "
        f"({over / len(lengths):.1%}) are longer than {limit} tokens; median {_quantile(lengths, 0.5)}, "
        f"p{pct} {quantile}, longest {lengths[-1]}. The cut falls on the answers, which sit at the end.",
        f"Set max_seq_length to at least {quantile} (the longest row needs {lengths[-1]}), or drop "
        "or shorten the longest rows.",
        evidence={
            "max_seq_length": limit,
            "quantile": q,
            "quantile_length": quantile,
            "median_length": _quantile(lengths, 0.5),
            "max_length": lengths[-1],
            "n_over": over,
        },
    )


def _quantile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank quantile of an ascending list."""
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


@register("config.no_eval_set", "No evaluation ran during training", needs=("run",))
def no_eval_set(ctx: AuditContext) -> CheckOutcome:
    run = _run(ctx)
    strategy = run.config.eval_strategy
    has_eval_logs = any(s.eval_loss is not None for s in run.logs.steps)
    if has_eval_logs or (strategy is not None and strategy != "no"):
        return None
    return ctx.finding(
        "low",
        "No evaluation during training",
        f"eval_strategy={strategy!r} and no eval_loss was logged, so nothing during training "
        "showed whether held-out loss was still falling; overfitting goes unseen.",
        "Hold out 5-10% of the data and set eval_strategy='steps' with eval_steps near your "
        "logging interval.",
        evidence={"eval_strategy": strategy},
    )


@register("config.no_warmup", "High learning rate from the very first step (no warmup)", needs=("run",))
def no_warmup(ctx: AuditContext) -> CheckOutcome:
    _, _, effective, _ = _rate_figures(ctx)
    run = _run(ctx)
    warmup = run.warmup_fraction
    if warmup is None:
        rates = run.logs.series("learning_rate")
        if rates and rates[0][0] > 1 and run.config.warmup_steps is None:
            raise CheckSkipped(
                f"the run recorded neither warmup_steps nor warmup_ratio, and its logged rates start at "
                f"step {rates[0][0]}: a warmup over the steps before cannot be told from none"
            )
        raise CheckSkipped("the run recorded neither warmup_steps nor warmup_ratio")
    threshold = ctx.config.no_warmup_effective_lr
    if warmup > 0 or effective <= threshold:
        return None
    return ctx.finding(
        "medium",
        f"No warmup at effective learning rate {effective:g}",
        f"The first optimizer steps run at the full effective rate {effective:g} (above "
        f"{threshold:g}) while Adam's moment estimates are still empty; that is when early loss "
        "spikes and divergence happen." + _inferred_note(ctx, "learning_rate", "warmup_steps"),
        "Set warmup_steps to 3-10% of the run (transformers 5 reads a float below 1 as a ratio, e.g. "
        "warmup_steps=0.05).",
        evidence=_run(ctx).label_inferred({"warmup_fraction": warmup, "effective_lr": effective},
                                          "learning_rate", "warmup_steps"),
    )


@register("config.overtraining", "Epoch count high for the dataset size", needs=("run",))
def overtraining(ctx: AuditContext) -> CheckOutcome:
    epochs = _epochs(ctx)
    if epochs is None:
        raise CheckSkipped("neither num_train_epochs nor max_steps with a known dataset size")
    n = ctx.n_examples
    if not n:
        raise CheckSkipped("dataset size unknown (pass --dataset)")
    cfg = ctx.config
    if epochs >= cfg.overtraining_epochs_high:
        severity = "high"
    elif epochs >= cfg.overtraining_epochs_medium and n < cfg.overtraining_small_dataset:
        severity = "medium"
    else:
        return None
    small = n < cfg.overtraining_small_dataset
    return ctx.finding(
        severity,
        f"{epochs:g} epochs over {n} examples risks memorization",
        f"Every row was seen {epochs:g} times. On {n} rows, repeated passes push the adapter to "
        "memorize their exact wording and drift away from what the base model did well.",
        ("Hold out an eval set and stop on eval loss (load_best_model_at_end), train fewer "
         "epochs" + (" (1-2 on a set this small)" if small else " (1-3)") + ", and add data rather "
         "than epochs."),
        evidence={"epochs": epochs, "n_examples": n,
                  "epochs_threshold": cfg.overtraining_epochs_high if severity == "high" else cfg.overtraining_epochs_medium,
                  "small_dataset_below": cfg.overtraining_small_dataset},
    )


@register("config.packing_with_completion_loss", "Sequence packing together with completion-only loss", needs=("run",))
def packing_with_completion_loss(ctx: AuditContext) -> CheckOutcome:
    c = _run(ctx).config
    if c.packing is None:
        raise CheckSkipped("the run did not record packing")
    if not (c.packing and c.completion_only_loss):
        return None
    return ctx.finding(
        "high",
        "Packing is combined with completion-only loss",
        "packing=True concatenates several rows into one sequence while completion-only masking "
        "assumes each sequence is one row; unless the collator keeps per-row boundaries, the mask "
        "lands on the wrong tokens and the model trains on prompts or skips answers.",
        "Turn packing off, or use a padding-free collator that keeps per-example position ids "
        "and masks, and check the masked tokens of a packed batch by hand.",
        evidence={"packing": True, "completion_only_loss": True},
    )


@register("config.pad_equals_eos", "Tokenizer pads with its EOS token (or has no pad token)", needs=("tokenizer",))
def pad_equals_eos(ctx: AuditContext) -> CheckOutcome:
    tok = ctx.tokenizer
    eos = getattr(tok, "eos_token_id", None)
    if tok is None or eos is None:  # no tokenizer has no EOS id either
        raise CheckSkipped("the tokenizer has no EOS token")
    pad = getattr(tok, "pad_token_id", None)
    if pad is not None and pad != eos:
        return None
    what = "has no pad token (trainers then reuse EOS)" if pad is None else f"uses EOS ({tok.eos_token!r}) as its pad token"
    return ctx.finding(
        "medium",
        "The pad token is the EOS token",
        f"The tokenizer {what}. Collators that mask padding out of the labels then mask every EOS "
        "as well, and a model that never sees EOS supervised never learns to stop.",
        "Give the tokenizer a dedicated pad token (a reserved/unused special token), or make sure "
        "the collator masks padding by attention mask, not by token id.",
        evidence={"pad_token_id": pad, "eos_token_id": eos},
    )


@register("config.seed_unset", "Run recorded no seed", needs=("run",))
def seed_unset(ctx: AuditContext) -> CheckOutcome:
    if _run(ctx).config.seed is not None:
        return None
    return ctx.finding(
        "low",
        "No seed recorded for the run",
        "The run's config has no seed, so its data order and LoRA initialization cannot be "
        "reproduced, and a retrain to test a fix will differ for reasons other than the fix.",
        "Set seed (and data_seed) explicitly in the trainer arguments and log them.",
    )


@register("config.small_effective_batch", "Effective batch of 1-2 at a high learning rate", needs=("run",))
def small_effective_batch(ctx: AuditContext) -> CheckOutcome:
    run = _run(ctx)
    c = run.config
    if c.per_device_train_batch_size is None:
        raise CheckSkipped("the run did not record per_device_train_batch_size")
    lr, _, effective, _ = _rate_figures(ctx)
    accumulation, how = c.gradient_accumulation_steps, "recorded"
    if accumulation is None:
        # A run folder without its arguments (trainer_state.json only) does not say; the logged
        # epoch per step and the dataset size do. Failing that, the trainers' default of 1.
        accumulation = run.inferred_gradient_accumulation(ctx.n_examples)
        how = ("inferred from the logged epoch per step and the dataset size" if accumulation is not None
               else "not recorded; the trainers' default of 1 assumed")
        accumulation = accumulation or 1
    batch = c.per_device_train_batch_size * accumulation * (c.world_size or 1)
    cfg = ctx.config
    if batch > cfg.small_batch_max or effective <= cfg.small_batch_effective_lr:
        return None
    evidence: dict[str, object] = {"effective_batch_size": batch, "learning_rate": lr, "effective_lr": effective,
                "gradient_accumulation_steps": accumulation}
    if how != "recorded":
        evidence["gradient_accumulation_source"] = how
    return ctx.finding(
        "medium",
        f"Effective batch size {batch} with lr={lr:g} is unstable",
        f"Each update follows {batch} example(s) (per-device {c.per_device_train_batch_size} x "
        f"accumulation {accumulation} x {c.world_size or 1} device(s)) at an "
        f"effective rate of {effective:g}; single-example gradients are noisy and at this rate "
        "each one pulls the adapter hard in its own direction."
        + ("" if how == "recorded" else f" (Gradient accumulation {how}.)")
        + _inferred_note(ctx, "learning_rate"),
        "Raise gradient_accumulation_steps so the effective batch is 8-32, or halve the learning "
        "rate for each halving of the batch.",
        evidence=run.label_inferred(evidence, "learning_rate"),
    )


@register("config.undertrained", "Run planned very few optimizer steps", needs=("run",))
def undertrained(ctx: AuditContext) -> CheckOutcome:
    steps = _run(ctx).total_optimizer_steps(ctx.n_examples)
    if steps is None:
        raise CheckSkipped("cannot tell the number of optimizer steps (no max_steps, epochs with a dataset size, or logs)")
    threshold = ctx.config.undertrained_min_steps
    if steps >= threshold:
        return None
    return ctx.finding(
        "medium",
        f"Only {steps} optimizer steps",
        f"The run takes {steps} optimizer steps (fewer than {threshold}); an adapter starts from a "
        "zero update, so this few steps rarely moves it far enough to change behaviour reliably.",
        "Train for more steps: more epochs on small data, or a smaller effective batch with the "
        "learning rate lowered to match.",
        evidence={"optimizer_steps": steps},
    )
