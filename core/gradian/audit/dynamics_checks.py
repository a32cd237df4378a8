"""The 8 ``dynamics.*`` checks: what the trainer's logged metrics say about the optimization.

They read ``RunRecord.logs`` (per-step ``loss``, ``grad_norm``, ``learning_rate``, ``eval_loss``).
The HF Trainer logs ``grad_norm`` before clipping, which is what makes the clipping rate
measurable; it also replaces a NaN training loss by a running average (``logging_nan_inf_filter``),
so a diverged run can show a harmless-looking loss next to a NaN grad norm.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

from gradian.audit.context import AuditContext
from gradian.audit.registry import CheckOutcome, CheckSkipped, register

if TYPE_CHECKING:
    from gradian.runs.record import LogStep, RunRecord

__all__: list[str] = []

#: schedules that are meant to end near zero (or a small floor)
_DECAYING_SCHEDULES = {
    "linear", "cosine", "cosine_with_restarts", "polynomial", "cosine_with_min_lr",
    "warmup_stable_decay", "cosine_warmup_with_min_lr",
}
_FLAT_SCHEDULES = {"constant", "constant_with_warmup", "reduce_lr_on_plateau", "inverse_sqrt"}


def _run(ctx: AuditContext) -> "RunRecord":
    if ctx.run is None:
        raise CheckSkipped("no training run")
    return ctx.run


def _steps(ctx: AuditContext) -> "list[LogStep]":
    return _run(ctx).logs.steps


def _finite_series(ctx: AuditContext, name: str) -> list[tuple[int, float]]:
    if ctx.run is None:
        raise CheckSkipped("no training run")
    return [(s, v) for s, v in ctx.run.logs.series(name) if math.isfinite(v)]


def _need(series: list, minimum: int, what: str) -> None:
    if len(series) < minimum:
        raise CheckSkipped(f"only {len(series)} logged {what} values; need at least {minimum}")


@register("dynamics.always_clipping", "Grad norm at or above max_grad_norm on nearly every step", needs=("logs",))
def always_clipping(ctx: AuditContext) -> CheckOutcome:
    max_norm = ctx.run.config.max_grad_norm if ctx.run else None
    if max_norm is None:
        raise CheckSkipped("the run did not record max_grad_norm")
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise CheckSkipped(f"clipping is disabled (max_grad_norm={max_norm:g})")
    norms = _finite_series(ctx, "grad_norm")
    _need(norms, ctx.config.min_logged_steps, "grad_norm")
    clipped = [step for step, g in norms if g >= max_norm]
    share = len(clipped) / len(norms)
    if share < ctx.config.clipping_share:
        return None
    median = statistics.median(g for _, g in norms)
    return ctx.finding(
        "medium",
        f"Gradient norm was at the clip threshold for {share:.0%} of logged steps",
        f"{len(clipped)} of {len(norms)} logged steps had a pre-clip grad_norm at or above "
        f"max_grad_norm={max_norm:g} (median grad_norm {median:.3g}). Clipping on nearly every step "
        "means every update has the same length and the learning rate no longer sets the step size.",
        "Lower the learning rate, raise the effective batch size, or both, until clipping is "
        "occasional; do not simply raise max_grad_norm.",
        evidence=_run(ctx).label_inferred({
            "clipped_steps": len(clipped),
            "logged_steps": len(norms),
            "share": round(share, 4),
            "max_grad_norm": max_norm,
            "median_grad_norm": median,
        }, "max_grad_norm"),
    )


@register("dynamics.grad_norm_explosion", "Grad norm far above the run's median", needs=("logs",))
def grad_norm_explosion(ctx: AuditContext) -> CheckOutcome:
    norms = _finite_series(ctx, "grad_norm")
    _need(norms, ctx.config.min_logged_steps, "grad_norm")
    median = statistics.median(g for _, g in norms)
    if median <= 0:
        return None
    factor = ctx.config.grad_explosion_factor
    blown = [(step, g) for step, g in norms if g > factor * median]
    if not blown:
        return None
    worst_step, worst = max(blown, key=lambda item: item[1])
    # An isolated spike that clipping caught is worth a look, not an explanation of a regression;
    # repeated blowups, or any blowup with clipping off, are.
    clip = ctx.run.config.max_grad_norm if ctx.run is not None else None
    sustained = len(blown) >= ctx.config.grad_explosion_sustained_steps
    severity = "high" if sustained or not clip else "medium"
    return ctx.finding(
        severity,
        f"Gradient norm blew up to {worst:.3g} at step {worst_step} ({worst / median:.0f}x the median)",
        f"{len(blown)} logged step(s) had a grad_norm above {factor:g}x the run's median of "
        f"{median:.3g}, the largest {worst:.3g} at step {worst_step}. Blowups like this precede "
        "divergence, or mark batches whose rows are very unlike the rest.",
        "Lower the learning rate, keep clipping at max_grad_norm=1.0, add warmup, and inspect the "
        "rows of the batches at the listed steps.",
        evidence={
            "steps": [s for s, _ in blown][:50],
            "max_grad_norm_logged": worst,
            "median_grad_norm": median,
            "n_blowups": len(blown),
            "max_grad_norm": clip,
        },
    )


@register("dynamics.loss_plateau", "Training loss hardly fell", needs=("logs",))
def loss_plateau(ctx: AuditContext) -> CheckOutcome:
    losses = [v for _, v in _finite_series(ctx, "loss")]
    _need(losses, ctx.config.min_logged_steps, "loss")
    k = max(1, len(losses) // 10)
    first = sum(losses[:k]) / k
    last = sum(losses[-k:]) / k
    if first <= 0:
        raise CheckSkipped(f"the first logged losses average {first:g}; a relative drop is undefined")
    drop = (first - last) / first
    threshold = ctx.config.plateau_min_relative_drop
    if drop >= threshold:
        return None
    return ctx.finding(
        "medium",
        f"Training loss barely moved ({first:.4g} -> {last:.4g}, {drop:+.1%})",
        f"The mean loss of the last tenth of the logs ({last:.4g}) is within {threshold:.0%} of the "
        f"first tenth ({first:.4g}). The adapter hardly learned: the rate may be too low, the "
        "adapter may not be attached to trainable modules, or the loss mask may leave almost "
        "nothing to learn.",
        "Check that the LoRA parameters are trainable (print_trainable_parameters), that the "
        "learning rate is in the usual range, and that the loss mask covers the answers.",
        evidence={"first_mean_loss": first, "last_mean_loss": last, "relative_drop": round(drop, 5), "window": k},
    )


@register("dynamics.loss_spike", "Loss jumps above its rolling median", needs=("logs",))
def loss_spike(ctx: AuditContext) -> CheckOutcome:
    series = _finite_series(ctx, "loss")
    _need(series, ctx.config.min_logged_steps, "loss")
    window = ctx.config.spike_window
    factor = ctx.config.spike_factor
    spikes = []
    for i in range(3, len(series)):
        previous = [v for _, v in series[max(0, i - window) : i]]
        median = statistics.median(previous)
        step, value = series[i]
        if median > 0 and value > factor * median:
            spikes.append({"step": step, "loss": value, "rolling_median": median})
    if not spikes:
        return None
    worst = max(spikes, key=lambda s: s["loss"] / s["rolling_median"])
    return ctx.finding(
        "medium",
        f"{len(spikes)} loss spike(s) above {factor:g}x the rolling median loss",
        f"{len(spikes)} logged loss value(s) exceeded {factor:g}x the median of the previous "
        f"{window}; the largest, {worst['loss']:.4g} at step {worst['step']}, was "
        f"{worst['loss'] / worst['rolling_median']:.1f}x its median {worst['rolling_median']:.4g}. "
        "Spikes come from a learning rate too high for the batch size, or from unusual rows.",
        "Lower the learning rate or raise the effective batch size; look at the rows trained at the "
        "listed steps.",
        evidence={"spikes": spikes[:50], "n_spikes": len(spikes)},
    )


@register("dynamics.lr_schedule_incomplete", "Decaying LR schedule ended far above zero", needs=("logs",))
def lr_schedule_incomplete(ctx: AuditContext) -> CheckOutcome:
    kind = ctx.run.config.lr_scheduler_type if ctx.run else None
    if kind is None:
        raise CheckSkipped("the run did not record lr_scheduler_type")
    if kind in _FLAT_SCHEDULES or kind not in _DECAYING_SCHEDULES:
        return None
    rates = _finite_series(ctx, "learning_rate")
    _need(rates, 2, "learning_rate")
    peak = max(v for _, v in rates)
    last_step, last = rates[-1]
    if peak <= 0:
        return None
    fraction = last / peak
    if fraction <= ctx.config.lr_end_fraction:
        return None
    return ctx.finding(
        "medium",
        f"The {kind} schedule stopped at {fraction:.0%} of its peak rate",
        f"The last logged learning rate ({last:.3g} at step {last_step}) is still {fraction:.0%} of "
        f"the peak {peak:.3g}; a {kind} schedule should end near zero. The run stopped early, or "
        "max_steps/epochs planned a longer run than the one that happened, so the low-rate phase "
        "that settles the adapter never came."
        + (" (The run did not record its scheduler; the shape was fitted to the logged rates.)"
           if "lr_scheduler_type" in _run(ctx).inferred else ""),
        "Let the run finish, or set max_steps/num_train_epochs to the length you actually train so "
        "the schedule reaches its end.",
        evidence=_run(ctx).label_inferred({"scheduler": kind, "peak_lr": peak, "final_lr": last,
                                         "final_step": last_step, "final_fraction": round(fraction, 4)},
                                        "lr_scheduler_type"),
    )


@register("dynamics.nan_loss", "NaN/inf loss or grad norm, including NaN hidden behind loss 0.0", needs=("logs",))
def nan_loss(ctx: AuditContext) -> CheckOutcome:
    bad_loss, hidden, bad_norm, bad_eval = [], [], [], []
    for s in _steps(ctx):
        loss_bad = s.loss is not None and not math.isfinite(s.loss)
        norm_bad = s.grad_norm is not None and not math.isfinite(s.grad_norm)
        if loss_bad:
            bad_loss.append(s.step)
        elif norm_bad and s.loss == 0.0:
            hidden.append(s.step)
        elif norm_bad:
            bad_norm.append(s.step)
        if s.eval_loss is not None and not math.isfinite(s.eval_loss):
            bad_eval.append(s.step)
    steps = sorted(set(bad_loss + hidden + bad_norm + bad_eval))
    if not steps:
        return None
    parts = []
    if bad_loss:
        parts.append(f"{len(bad_loss)} step(s) logged a NaN/inf loss")
    if hidden:
        parts.append(
            f"{len(hidden)} step(s) logged loss 0.0 next to a NaN/inf grad_norm (the trainer's "
            "NaN filter hides the divergence in the loss column)"
        )
    if bad_norm:
        parts.append(f"{len(bad_norm)} step(s) had a NaN/inf grad_norm")
    if bad_eval:
        parts.append(f"{len(bad_eval)} eval(s) returned a NaN/inf eval_loss")
    return ctx.finding(
        "critical",
        f"Training diverged to NaN/inf from step {steps[0]}",
        "; ".join(parts) + ". Updates after the first non-finite value are garbage, and the "
        "adapter's weights may be NaN.",
        "Lower the learning rate, use bf16 instead of fp16, keep clipping on, and drop rows with "
        "no supervised tokens (a mean over zero tokens is NaN); then retrain.",
        evidence={
            "first_step": steps[0],
            "nan_loss_steps": bad_loss[:50],
            "zero_loss_nan_grad_steps": hidden[:50],
            "nan_grad_norm_steps": bad_norm[:50],
            "nan_eval_loss_steps": bad_eval[:50],
        },
    )


@register("dynamics.overfitting", "Eval loss rising while train loss falls", needs=("logs",))
def overfitting(ctx: AuditContext) -> CheckOutcome:
    evals = _finite_series(ctx, "eval_loss")
    if len(evals) < 3:
        raise CheckSkipped(f"only {len(evals)} logged eval_loss values; need at least 3")
    best_step, best = min(evals, key=lambda item: item[1])
    last_step, last = evals[-1]
    if best <= 0 or best_step == last_step:
        return None
    rise = (last - best) / best
    cfg = ctx.config
    if rise < cfg.overfit_min_rise:
        return None
    train = _finite_series(ctx, "loss")
    before = [v for s, v in train if s <= best_step][-3:]
    after = [v for s, v in train if s > best_step][-3:]
    if not before or not after:
        raise CheckSkipped("no training loss logged on both sides of the best eval step")
    train_then, train_now = sum(before) / len(before), sum(after) / len(after)
    if train_now >= train_then:
        return None
    severity = "high" if rise >= cfg.overfit_high_rise else "medium"
    return ctx.finding(
        severity,
        f"Eval loss rose {rise:.0%} from its best while train loss kept falling",
        f"eval_loss bottomed at {best:.4g} (step {best_step}) and ended at {last:.4g} (step "
        f"{last_step}), while the training loss went from {train_then:.4g} to {train_now:.4g}: "
        "the adapter is memorizing the training rows instead of generalizing.",
        f"Use the checkpoint near step {best_step} (load_best_model_at_end=True), or train fewer "
        "epochs / at a lower rate.",
        evidence={"best_eval_step": best_step, "best_eval_loss": best, "final_eval_loss": last,
                  "relative_rise": round(rise, 4), "train_loss_at_best": train_then,
                  "train_loss_final": train_now},
    )


@register("dynamics.too_few_steps", "Too few logged loss values to judge the curve", needs=("logs",))
def too_few_steps(ctx: AuditContext) -> CheckOutcome:
    losses = _finite_series(ctx, "loss")
    minimum = ctx.config.min_logged_steps
    if len(losses) >= minimum:
        return None
    return ctx.finding(
        "low",
        f"Only {len(losses)} logged training loss value(s)",
        f"The logs hold {len(losses)} loss value(s) (fewer than {minimum}), too few to judge the "
        "loss curve; the curve checks (plateau, spikes, clipping) could not say much.",
        "Log more often (logging_steps=1 for short runs, or about 1% of the run).",
        evidence={"logged_loss_values": len(losses)},
    )
