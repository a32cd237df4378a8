"""The learning-rate schedule a run followed, recovered from its logged learning rates.

Public interface: ``fit_lr_schedule(rates, total_steps) -> ScheduleFit | None`` and
``fill_config_from_logs(record)``, which fills a RunRecord's missing ``learning_rate``,
``lr_scheduler_type`` and warmup from the fit and says so in ``record.inferred``.

A run folder without its arguments (no JSON dump, a refused ``training_args.bin``) still has
``trainer_state.json``, whose ``log_history`` holds the learning rate of each logged step. The HF
Trainer logs, at optimizer step k, the rate used for that step: ``peak x f(k - 1)``, where f is
the schedule's multiplier after k - 1 scheduler steps (transformers' ``get_scheduler``):

- warmup, for t < w: ``t / max(1, w)``
- then ``linear``: ``(T - t) / (T - w)``; ``cosine``: ``(1 + cos(pi (t - w) / (T - w))) / 2``;
  ``constant``: 1

with T the planned optimizer steps (``max_steps`` in trainer_state.json). For each shape and each
candidate w the least-squares peak is ``<y, f> / <f, f>``; the shape and w with the smallest
relative residual win, and a fit counts only when that residual is small. Warmup is known when
the logs saw it (the rate still rising at the first logged step), or when logging began at step 1
with the rate already at its peak (then there was none); otherwise a warmup shorter than the gap
before the first log cannot be told apart from none, and it stays unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import numpy as np

    from gradian.runs.record import RunRecord

__all__ = ["ScheduleFit", "fit_lr_schedule", "fill_config_from_logs"]

#: a shape fits when the residual is below this share of the logged rates' norm
_FIT_TOLERANCE = 0.02
#: most warmup lengths tried; longer ranges are sampled evenly
_MAX_WARMUP_CANDIDATES = 2000
_SHAPES = ("linear", "cosine", "constant")


@dataclass
class ScheduleFit:
    """What the logged rates say about the schedule.

    ``peak_lr``: the fitted peak (the configured ``learning_rate``), or the largest logged rate
    when no shape fits. ``kind``: ``linear``, ``cosine``, ``constant`` or
    ``constant_with_warmup``; None when no shape fits. ``warmup_steps``: None when the logs cannot
    tell. ``relative_error``: the fit's residual norm over the logged rates' norm.
    """

    peak_lr: float
    kind: str | None
    warmup_steps: int | None
    total_steps: int
    relative_error: float
    first_logged_step: int
    n_points: int


def _multipliers(t: "np.ndarray", shape: str, w: int, total: int) -> "np.ndarray":
    import numpy as np

    ramp = t / max(1, w)
    span = max(1, total - w)
    if shape == "linear":
        after = np.clip((total - t) / span, 0.0, None)
    elif shape == "cosine":
        progress = np.clip((t - w) / span, 0.0, 1.0)
        after = 0.5 * (1.0 + np.cos(math.pi * progress))
    else:
        after = np.ones_like(t)
    return np.where(t < w, ramp, after)


def fit_lr_schedule(rates: Sequence[tuple[int, float]], total_steps: int | None = None) -> ScheduleFit | None:
    """Fit the logged ``(step, learning_rate)`` pairs; None when no rate above zero was logged."""
    import numpy as np

    points = sorted((int(s), float(v)) for s, v in rates if v is not None and math.isfinite(v))
    if not points or max(v for _, v in points) <= 0:
        return None
    steps = np.array([s for s, _ in points], dtype=float)
    y = np.array([v for _, v in points], dtype=float)
    first = int(steps[0])
    total = int(total_steps) if total_steps and total_steps >= steps[-1] else int(steps[-1])
    observed_peak = float(y.max())
    if len(points) < 3:  # too few points to tell a shape
        return ScheduleFit(observed_peak, None, None, total, math.inf, first, len(points))

    t = steps - 1.0  # the rate logged at step k was set after k - 1 scheduler steps
    peak_at = int(steps[int(y.argmax())])
    gap = int(steps[1] - steps[0])
    upper = min(total - 1, peak_at + gap)
    candidates: Sequence[int] = range(0, upper + 1)
    if len(candidates) > _MAX_WARMUP_CANDIDATES:
        candidates = sorted(set(np.linspace(0, upper, _MAX_WARMUP_CANDIDATES).round().astype(int).tolist()))
    norm = float(np.linalg.norm(y))
    best: tuple[float, str, int, float] | None = None
    for shape in _SHAPES:
        for w in candidates:
            f = _multipliers(t, shape, w, total)
            ff = float(f @ f)
            if ff <= 0:
                continue
            amp = float(f @ y) / ff
            err = float(np.linalg.norm(y - amp * f)) / norm
            if best is None or err < best[0] - 1e-12:
                best = (err, shape, w, amp)
    if best is None or best[0] > _FIT_TOLERANCE:
        err = best[0] if best else math.inf
        # no standard shape; still, a rate that rose to its peak after the first log was warmed up
        rising = first < peak_at and y[0] < 0.5 * observed_peak
        return ScheduleFit(observed_peak, None, peak_at - 1 if rising else None, total, err, first, len(points))
    err, shape, w, amp = best
    if w > first - 1:  # the logs saw the rate still rising: warmup is w steps
        warmup: int | None = w
    elif first == 1:  # logged from the very first step, already at the peak: no warmup
        warmup = 0
    else:  # a warmup over the steps before the first log would look the same as none
        warmup = None
    kind = shape
    if shape == "constant" and warmup:
        kind = "constant_with_warmup"
    return ScheduleFit(amp, kind, warmup, total, err, first, len(points))


def fill_config_from_logs(record: "RunRecord") -> ScheduleFit | None:
    """Fill the record's missing learning rate, schedule and warmup from its logged rates.

    Only fields the run left empty are set, and each one set is named in ``record.inferred`` with
    how it was found; the audit quotes that in the evidence of any finding that used it.
    """
    c = record.config
    need_warmup = c.warmup_steps is None and c.warmup_ratio is None
    if c.learning_rate is not None and c.lr_scheduler_type is not None and not need_warmup:
        return None
    fit = fit_lr_schedule(record.logs.series("learning_rate"), record.planned_steps)
    if fit is None:
        return None
    how = (f"fitted to {fit.n_points} logged learning rates ({fit.kind} schedule, residual "
           f"{fit.relative_error:.1%})" if fit.kind else
           f"largest of {fit.n_points} logged learning rates (no standard schedule fits)")
    if c.learning_rate is None:
        c.learning_rate = fit.peak_lr
        record.inferred["learning_rate"] = how
    if c.lr_scheduler_type is None and fit.kind is not None:
        c.lr_scheduler_type = fit.kind
        record.inferred["lr_scheduler_type"] = how
    if need_warmup and fit.warmup_steps is not None:
        c.warmup_steps = fit.warmup_steps
        seen = "the logged rate rising to its peak" if fit.warmup_steps else "the rate at its peak from the first logged step"
        record.inferred["warmup_steps"] = f"{how}; {seen}"
    return fit
