"""Reverse mode through a whole LoRA fine-tune: d(measurement) / d(per-row weights), exactly.

The run is replayed from its initial LoRA tensors with a weight ``w_r`` on each training row
(all ones reproduces the run). Every step is written as a differentiable function of the
current LoRA tensors, the optimizer state and ``w``:

* loss of a step: ``L_t = (1/B) sum_{r in step} w_r * l_r(theta_t)``, with ``l_r`` the row's mean
  next-token loss over its supervised tokens (a mean over rows of per-row means; B the step's
  row count, not the weighted sum);
* ``g_t = dL_t/dtheta_t`` taken with ``create_graph=True`` so it stays a function of ``w``;
* optional clipping by global norm, as ``torch.nn.utils.clip_grad_norm_`` does it:
  ``g <- g * min(1, c / (||g|| + 1e-6))``;
* SGD ``theta <- theta - lr_t (g + wd theta)`` or AdamW as ``torch.optim.AdamW`` (decoupled weight
  decay, bias-corrected moments), written out in tensors (see ``_adamw``).

Two ways back. ``checkpoint_every=None`` keeps the whole graph and ``torch.autograd.grad(measure,
w)`` walks it back once: memory O(steps x one step's double-backward graph). ``checkpoint_every=k``
sweeps back one step at a time (``_segmented``): the state every k steps is kept from a plain
forward replay, each segment is recomputed from its first state, and each step is rebuilt with its
graph and pulled back with the adjoint of the state after it; memory is O(steps / k + k) states
plus one step's graph. Scaled-dot-product attention runs on its plain math kernel during the
training steps (the fused kernels cannot be differentiated twice). The model is called through
``torch.func.functional_call`` with the replayed LoRA tensors in place of its parameters, so the
model object itself is never modified.

The per-row loss here is plain ``log_softmax`` + gather rather than ``gradian.grads.loss.
per_example_loss``: that one's chunked cross-entropy has a first-order-only backward (it
recomputes the softmax in place without a graph), and a step's update needs the second
derivative. The two agree to rounding (tests/test_replay.py checks it); ``collate`` is shared.

``scaling="held"`` differentiates a run whose step sizes are those of the run: AdamW's second
moments ``v`` and the clipping factor are taken as the constants the unweighted replay computed,
so a row's weight acts through its gradient (the first moment, the trajectory after it) and not
through how it rescales every later step. The value and the replayed tensors are the run's either
way; only the derivative differs (``"exact"`` follows the rescaling too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from gradian.data import IGNORE_INDEX
from gradian.errors import ConfigError
from gradian.grads.loss import collate

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers.utils import ModelOutput

    from gradian.data import TokenizedExample
    from gradian.replay.states import ReplayStates

    #: the optimizer state between steps: ``(theta, m, v)``, each one tensor per LoRA tensor
    State = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]

__all__ = ["OPTIMIZERS", "REDUCTIONS", "SCALINGS", "Recipe", "ReplayResult", "ReplayStart", "checkpoint_interval",
           "checkpoint_starts", "metagradient", "replay", "row_losses", "sweep_segments"]

OPTIMIZERS = ("sgd", "adamw")
#: how a step's rows make its loss (``Recipe.reduction``)
REDUCTIONS = ("rows", "tokens")

#: what the derivative does with the step sizes: ``exact`` follows how a weight changes AdamW's
#: second moments and the clipping factor; ``held`` takes them as the run's constants
SCALINGS = ("exact", "held")

#: the constant ``torch.nn.utils.clip_grad_norm_`` adds to the norm before dividing
CLIP_EPS = 1e-6


@dataclass(frozen=True)
class Recipe:
    """How the run trained: one learning rate per step and the optimizer's settings."""

    schedule: Sequence[float]
    optimizer: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: clip the global gradient norm to this; 0 = no clipping
    max_grad_norm: float = 0.0
    #: a step's loss: ``rows`` (mean over rows of each row's mean token loss) or ``tokens`` (one mean
    #: over every supervised token of the step, as the HF Trainer and TRL compute it)
    reduction: str = "rows"

    def check(self, steps: int) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"replay optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if len(self.schedule) != steps:
            raise ConfigError(f"replay schedule has {len(self.schedule)} learning rates for {steps} steps; "
                              "give one per step")
        for i, lr in enumerate(self.schedule):
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
                raise ConfigError(f"replay schedule[{i}] must be a finite learning rate >= 0, got {lr!r}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"replay betas must each lie in [0, 1), got {self.betas!r}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ConfigError(f"replay eps must be > 0, got {self.eps!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"replay weight_decay must be >= 0, got {self.weight_decay!r}")
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"replay max_grad_norm must be >= 0 (0 = off), got {self.max_grad_norm!r}")
        if self.reduction not in REDUCTIONS:
            raise ConfigError(f"replay reduction must be one of {REDUCTIONS}, got {self.reduction!r}")


@dataclass
class ReplayStart:
    """Where a replay starts when not from the first step: the optimizer state after ``step`` of the
    run's steps (the LoRA tensors are the ``lora_params`` handed in beside it), as a trainer
    checkpoint holds it. ``m`` and ``v``: AdamW's moments by LoRA tensor name (empty under SGD)."""

    step: int
    m: dict[str, torch.Tensor] = field(default_factory=dict)
    v: dict[str, torch.Tensor] = field(default_factory=dict)

    def check(self, names: Sequence[str], params: Mapping[str, torch.Tensor], steps: int, optimizer: str) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step < steps:
            raise ConfigError(f"replay start step must be an integer in 0..{steps - 1}, got {self.step!r}")
        if optimizer != "adamw":
            return
        for moments, what in ((self.m, "m"), (self.v, "v")):
            for name in names:
                held = moments.get(name)
                if held is None or tuple(held.shape) != tuple(params[name].shape):
                    raise ConfigError(f"replay start: AdamW's {what} for {name} is missing or of another shape "
                                      f"than the tensor ({tuple(params[name].shape)})")


@dataclass
class ReplayResult:
    """The measurement after the replayed run, its gradient in the row weights, the final LoRA tensors."""

    value: float
    grad: torch.Tensor
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    #: with states on disk: "reused" (a finished replay read back), what an interrupted one resumed, or None
    resumed: str | None = None


class ReplayedModel:
    """Calls the model with the replayed LoRA tensors in place of its own (``measure`` gets one)."""

    def __init__(self, model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.params = dict(params)

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> ModelOutput:
        from torch.func import functional_call

        return functional_call(self.model, self.params, args, kwargs)


def row_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss per row over its supervised tokens (0 for a row with none); twice differentiable."""
    total, count = _row_token_losses(logits, labels)
    return total / count.clamp(min=1)


def _row_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed next-token loss over its supervised tokens, and how many there are."""
    import torch

    upcast = torch.promote_types(logits.dtype, torch.float32)
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    logp = torch.log_softmax(logits[:, :-1].to(upcast), dim=-1)
    picked = logp.gather(2, shifted.clamp(min=0).unsqueeze(2)).squeeze(2)
    return -(picked * keep.to(upcast)).sum(dim=1), keep.sum(dim=1).to(upcast)


def _check_inputs(model: nn.Module, lora_params: Mapping[str, torch.Tensor], rows: Sequence[TokenizedExample],
                  batches: Sequence[Sequence[int]], weights: torch.Tensor) -> None:
    import torch

    named = dict(model.named_parameters())
    for name in lora_params:
        if name not in named:
            raise ConfigError(f"replay lora_params names {name!r}, which is not a parameter of the model")
    trainable = [n for n, p in named.items() if p.requires_grad]
    missing = [n for n in trainable if n not in lora_params]
    if missing:
        raise ConfigError(f"replay: the model trains {missing[0]!r} (and {len(missing) - 1} more) outside "
                          "lora_params; freeze it or pass it, or the replay would not be the run")
    if not lora_params:
        raise ConfigError("replay lora_params is empty: there is nothing to train")
    if not isinstance(weights, torch.Tensor) or weights.dim() != 1 or not weights.is_floating_point():
        raise ConfigError("replay weights must be a 1-D floating tensor, one weight per training row")
    if weights.shape[0] != len(rows):
        raise ConfigError(f"replay weights has {weights.shape[0]} entries for {len(rows)} training rows")
    if not batches:
        raise ConfigError("replay batches is empty: give the training order, one list of row indices per step")
    for t, step in enumerate(batches):
        if len(step) == 0:
            raise ConfigError(f"replay batches[{t}] is empty; every step needs at least one row")
        for r in step:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < len(rows):
                raise ConfigError(f"replay batches[{t}] holds row {r!r}, outside 0..{len(rows) - 1}")


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(x)`` whose derivative at 0 is 0 instead of inf (an entry whose gradient was always 0)."""
    import torch

    pos = x > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, x, torch.ones_like(x))), torch.zeros_like(x))


def _clip(grads: list[torch.Tensor], max_norm: float, held: bool = False) -> list[torch.Tensor]:
    """Clip by global norm; ``held``: the factor is a constant of the derivative."""
    import torch

    norm = torch.sqrt(sum((g * g).sum() for g in ([g.detach() for g in grads] if held else grads)))
    coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    return [g * coef for g in grads]


def _adamw(theta: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
           recipe: Recipe, held: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One ``torch.optim.AdamW`` step (``step`` counts from 1), returned as new tensors.

    ``theta <- theta (1 - lr wd)``; ``m <- b1 m + (1 - b1) g``; ``v <- b2 v + (1 - b2) g^2``;
    ``theta <- theta - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. ``held``: ``v``
    is a constant of the derivative (same values, no graph).
    """
    b1, b2 = recipe.betas
    theta = theta * (1.0 - lr * recipe.weight_decay)
    m = b1 * m + (1.0 - b1) * g
    if held:
        g = g.detach()
        v = v.detach()
    v = b2 * v + (1.0 - b2) * g * g
    denom = _safe_sqrt(v) / math.sqrt(1.0 - b2**step) + recipe.eps
    theta = theta - (lr / (1.0 - b1**step)) * m / denom
    return theta, m, v


class _Steps:
    """The replayed run as a function of the state before each step: ``step(t, state, w)``.

    A state is ``(theta, m, v)``, each a list of tensors in ``names`` order (``m`` and ``v`` stay
    zeros under SGD). ``create_graph`` keeps the new state a differentiable function of the old
    one and of ``w`` (for the reverse sweep); without it the step is a plain training step.
    """

    def __init__(self, model: nn.Module, names: list[str], rows: Sequence[TokenizedExample],
                 batches: Sequence[Sequence[int]], recipe: Recipe, pad_id: int, scaling: str = "exact") -> None:
        self.model, self.names, self.rows, self.batches = model, names, rows, batches
        self.recipe, self.pad_id, self.held = recipe, pad_id, scaling == "held"

    def loss(self, t: int, theta: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        step = self.batches[t]
        device = theta[0].device
        batch = collate([self.rows[r] for r in step], self.pad_id, device)
        # the fused attention kernels (flash, memory-efficient) have first-order backwards only
        with sdpa_kernel(SDPBackend.MATH):
            out = ReplayedModel(self.model, dict(zip(self.names, theta)))(input_ids=batch.input_ids,
                                                                         attention_mask=batch.attention_mask)
        total, count = _row_token_losses(out.logits, batch.labels)
        index = torch.tensor(list(step), dtype=torch.long, device=device)
        weights = w.index_select(0, index).to(total.dtype)
        if self.recipe.reduction == "tokens":
            return (weights * total).sum() / count.sum().clamp(min=1)
        return (weights * (total / count.clamp(min=1))).sum() / len(step)

    def step(self, t: int, state: State, w: torch.Tensor, *, create_graph: bool) -> State:
        import torch

        theta, m, v = state
        recipe = self.recipe
        with torch.enable_grad():
            if not create_graph:
                theta = [p.detach().requires_grad_(True) for p in theta]
            grads = list(torch.autograd.grad(self.loss(t, theta, w), theta, create_graph=create_graph))
            if not create_graph:
                theta = [p.detach() for p in theta]
                grads = [g.detach() for g in grads]
            if recipe.max_grad_norm > 0:
                grads = _clip(grads, recipe.max_grad_norm, self.held)
            lr = float(recipe.schedule[t])
            if recipe.optimizer == "sgd":
                return [p - lr * (g + recipe.weight_decay * p) for p, g in zip(theta, grads)], m, v
            new = [_adamw(p, g, mi, vi, t + 1, lr, recipe, self.held) for p, g, mi, vi in zip(theta, grads, m, v)]
            return [n[0] for n in new], [n[1] for n in new], [n[2] for n in new]


def _initial_state(lora_params: Mapping[str, torch.Tensor], start: ReplayStart | None = None) -> tuple[list[str], State]:
    """The state the replay starts from: ``lora_params`` with zero moments, or ``start``'s moments."""
    import torch

    names = list(lora_params)
    theta = [lora_params[n].detach().clone() for n in names]

    def moments(held: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return [held[n].detach().to(p).clone() if n in held else torch.zeros_like(p) for n, p in zip(names, theta)]

    if start is None:
        return names, (theta, moments({}), moments({}))
    return names, (theta, moments(start.m), moments(start.v))


def _unroll(model: nn.Module, lora_params: Mapping[str, torch.Tensor], rows: Sequence[TokenizedExample],
            batches: Sequence[Sequence[int]], w: torch.Tensor, recipe: Recipe, pad_id: int,
            start: ReplayStart | None = None, scaling: str = "exact") -> dict[str, torch.Tensor]:
    """The final LoRA tensors as a differentiable function of ``w`` (and of the initial tensors)."""
    names, (theta, m, v) = _initial_state(lora_params, start)
    # leaves that require grad, so each step's gradient in theta exists; never written back
    state = ([p.requires_grad_(True) for p in theta], m, v)
    steps = _Steps(model, names, rows, batches, recipe, pad_id, scaling)
    for t in range(start.step if start is not None else 0, len(batches)):
        state = steps.step(t, state, w, create_graph=True)
    return dict(zip(names, state[0]))


def _detached(state: State) -> State:
    return tuple([x.detach() for x in part] for part in state)  # type: ignore[return-value]


def checkpoint_interval(steps: int, checkpoint_every: int | None = None) -> int:
    """The steps between the states the forward replay keeps: ``checkpoint_every``, else
    ``ceil(sqrt(steps))``, which makes the kept states (``steps / k``) and the states a segment
    recomputes (``k``) about as many."""
    return checkpoint_every or max(1, math.isqrt(max(steps - 1, 0)) + 1)


def checkpoint_starts(steps: int, every: int, begin: int = 0) -> list[int]:
    """The steps whose incoming state the forward replay keeps (step ``begin``'s is the state it
    starts from: the initial one, or a trainer checkpoint's)."""
    return list(range(begin, steps, every))


def sweep_segments(steps: int, every: int, horizon: int | None = None, begin: int = 0) -> list[tuple[int, int, int]]:
    """The segments the reverse sweep visits, the last first, as ``(first, last, low)``: the states
    before steps ``first + 1 .. last - 1`` are recomputed from the one kept at ``first``, then steps
    ``last - 1`` down to ``low`` are differentiated. Only the segments that hold one of the last
    ``horizon`` steps are visited (every step from ``begin`` with ``horizon=None``)."""
    stop = begin if horizon is None else max(steps - horizon, begin)
    out = []
    for first in reversed(checkpoint_starts(steps, every, begin)):
        if first + every <= stop:
            break
        out.append((first, min(first + every, steps), max(first, stop)))
    return out


def _segmented(model: nn.Module, lora_params: Mapping[str, torch.Tensor], rows: Sequence[TokenizedExample],
               batches: Sequence[Sequence[int]], w: torch.Tensor, recipe: Recipe,
               measure: Callable[["ReplayedModel"], torch.Tensor], pad_id: int,
               every: int, progress: Callable[[int, int], None] | None, horizon: int | None = None,
               states: ReplayStates | None = None, start: ReplayStart | None = None,
               scaling: str = "exact") -> ReplayResult:
    """The metagradient by a reverse sweep one step at a time, never holding more than one step's graph.

    Forward: plain training steps from the initial state, keeping the state at every ``every``-th
    step. Reverse: for each segment from the last, its states are recomputed from the segment's
    first, then each step is rebuilt with its graph and pulled back, carrying the adjoint of the
    state (``theta``, ``m``, ``v``) to the step before and adding each step's share of
    ``d measure / d w``. Memory: ``steps / every`` stored states, ``every`` recomputed ones and one
    step's double-backward graph. Work: two plain replays plus one differentiated step per step.

    With ``states`` (``gradian.replay.states.ReplayStates``) the kept states go to disk instead of
    memory (one is read back when its segment is swept), the sweep's adjoint is written after each
    segment, and a replay that was interrupted resumes where it stopped; a finished one is read back.
    """
    import torch

    names, state = _initial_state(lora_params, start)
    steps = _Steps(model, names, rows, batches, recipe, pad_id, scaling)
    total = len(batches)
    first_step = start.step if start is not None else 0
    w = w.detach()
    starts = checkpoint_starts(total, every, first_step)
    segments = sweep_segments(total, every, horizon, first_step)
    # forward steps, the steps recomputed inside each segment, reverse steps
    work = total - first_step + sum(last - first - 1 for first, last, _ in segments) + sum(last - low for _, last, low in segments)
    if states is not None:
        finished = states.load_result()
        if finished is not None:
            value_done, grad_done, params_done = finished
            if progress is not None:
                progress(work, work)
            return ReplayResult(value_done, grad_done, params_done, resumed="reused")
    stored: dict[int, State] = {first_step: state}
    begin = first_step
    if states is not None:
        begin, loaded = states.forward_start(starts, total)
        if loaded is not None:
            state = _detached(loaded)
        del loaded  # the detached copy shares its storage; hold one reference, not two
    done = begin - first_step

    def tick() -> None:
        if progress is not None:
            progress(done, work)

    for t in range(begin, total):
        state = _detached(steps.step(t, state, w, create_graph=False))
        if t + 1 in starts:
            if states is None:
                stored[t + 1] = state
            else:
                states.save_state(t + 1, state)
        done += 1
        tick()
    if states is not None and begin < total:
        states.save_state(total, state)

    def kept(first: int) -> State:
        """The state before step ``first``: held, read back, or recomputed from an earlier one."""
        if states is None or first == first_step:
            return stored[first]
        loaded = states.load_state(first)
        if loaded is not None:
            return _detached(loaded)
        earlier = max(s for s in starts if s < first)
        at = kept(earlier)
        for t in range(earlier, first):
            at = _detached(steps.step(t, at, w, create_graph=False))
        states.save_state(first, at)
        return at

    final = [p.detach().requires_grad_(True) for p in state[0]]
    swept = 0
    resumed_sweep = states.load_sweep() if states is not None else None
    if resumed_sweep is not None:
        swept, adjoint, w_bar, value = resumed_sweep
        adjoint = _detached(adjoint)
        done += sum(last - first - 1 + last - low for first, last, low in segments[:swept])
    else:
        with torch.enable_grad():
            measured = measure(ReplayedModel(model, dict(zip(names, final))))
            if not isinstance(measured, torch.Tensor) or measured.numel() != 1:
                raise ConfigError("replay measure must return a scalar tensor")
            theta_bar = list(torch.autograd.grad(measured.reshape(()), final, allow_unused=True))
        value = float(measured.detach())
        adjoint = ([torch.zeros_like(p) if g is None else g for p, g in zip(final, theta_bar)],
                   [torch.zeros_like(p) for p in final], [torch.zeros_like(p) for p in final])
        w_bar = torch.zeros_like(w)
    for index, (first, last, low) in enumerate(segments):
        if index < swept:
            continue
        segment = [kept(first)]
        for t in range(first, last - 1):
            segment.append(_detached(steps.step(t, segment[-1], w, create_graph=False)))
            done += 1
            tick()
        for t in range(last - 1, low - 1, -1):
            before = tuple([x.detach().requires_grad_(True) for x in part] for part in segment[t - first])
            w_leaf = w.clone().requires_grad_(True)
            with torch.enable_grad():
                after = steps.step(t, before, w_leaf, create_graph=True)  # type: ignore[arg-type]
                outs = [x for part in after for x in part]
                cots = [x for part in adjoint for x in part]
                keep = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
                leaves = [x for part in before for x in part] + [w_leaf]
                pulled = torch.autograd.grad([o for o, _ in keep], leaves, grad_outputs=[c for _, c in keep],
                                             allow_unused=True)
            pulled = [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(leaves, pulled)]
            n = len(names)
            adjoint = (pulled[:n], pulled[n:2 * n], pulled[2 * n:3 * n])
            w_bar = w_bar + pulled[-1]
            done += 1
            tick()
        del segment
        if states is not None and index + 1 < len(segments):
            states.save_sweep(index + 1, adjoint, w_bar, value)
    params = {n: p.detach() for n, p in zip(names, final)}
    if states is not None:
        states.save_result(value, w_bar, params)
    return ReplayResult(value, w_bar, params,
                        resumed=_resumed_from(begin - first_step, begin, total, swept, len(segments)))


def _resumed_from(skipped: int, begin: int, total: int, swept: int, segments: int) -> str | None:
    """What an interrupted replay did not make again (None: it made everything)."""
    if swept:
        return f"resumed after {swept} of the sweep's {segments} segments"
    if skipped:
        return f"resumed the forward replay at step {begin} of {total}"
    return None


def _check_window(lora_params: Mapping[str, torch.Tensor], total: int, recipe: Recipe, horizon: int | None,
                  start: ReplayStart | None) -> None:
    """Refuse a horizon that is not a whole number of steps, a start that cannot be the run's, and a
    horizon reaching back before the start."""
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
        raise ConfigError(f"replay horizon must be an integer >= 1 (or None for every step), got {horizon!r}")
    if start is not None:
        start.check(list(lora_params), lora_params, total, recipe.optimizer)
        if horizon is not None and horizon > total - start.step:
            raise ConfigError(f"replay horizon {horizon} reaches back before the start (step {start.step} of "
                              f"{total}); start from an earlier state or shorten the horizon")


def replay(model: nn.Module, lora_params: Mapping[str, torch.Tensor], rows: Sequence[TokenizedExample],
           batches: Sequence[Sequence[int]], weights: torch.Tensor, recipe: Recipe, *,
           pad_id: int, start: ReplayStart | None = None, horizon: int | None = None) -> dict[str, torch.Tensor]:
    """The LoRA tensors after the replayed run (detached), without a metagradient; from ``start``
    (the state after its step, ``lora_params`` its LoRA tensors) when given.

    ``horizon=H``: the weights act in the last ``H`` steps only, every row weighing 1 in the steps
    before them: the run whose derivative ``metagradient(..., horizon=H)`` takes (at all-ones
    weights the two runs are the same). It may reach back to ``start`` at most."""
    import torch

    _check_inputs(model, lora_params, rows, batches, weights)
    recipe.check(len(batches))
    _check_window(lora_params, len(batches), recipe, horizon, start)
    first = start.step if start is not None else 0
    weighted_from = len(batches) - horizon if horizon is not None else 0
    ones = torch.ones_like(weights.detach())
    names, state = _initial_state(lora_params, start)
    steps = _Steps(model, names, rows, batches, recipe, pad_id)
    for t in range(first, len(batches)):
        state = _detached(steps.step(t, state, weights.detach() if t >= weighted_from else ones, create_graph=False))
    return dict(zip(names, state[0]))


def metagradient(
    model: nn.Module,
    lora_params: Mapping[str, torch.Tensor],
    rows: Sequence[TokenizedExample],
    batches: Sequence[Sequence[int]],
    weights: torch.Tensor,
    recipe: Recipe,
    measure: Callable[[ReplayedModel], torch.Tensor],
    *,
    pad_id: int,
    checkpoint_every: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    horizon: int | None = None,
    states: ReplayStates | None = None,
    start: ReplayStart | None = None,
    scaling: str = "exact",
) -> ReplayResult:
    """``measure`` after the replayed run and its exact gradient in the per-row ``weights``.

    ``model``: a causal LM (a PEFT LoRA model) in eval mode with no dropout, whose only trainable
    tensors are ``lora_params`` (``{parameter name: tensor}``, start values = the run's init);
    ``rows``: ``TokenizedExample`` rows; ``batches``: per step, the indices of its rows, in
    training order; ``weights``: one float per row (all ones = the run); ``measure(replayed)``
    returns a scalar tensor, calling ``replayed(input_ids=..., attention_mask=...)`` like the
    model. ``grad[r] > 0`` means up-weighting row r raises the measurement.

    ``checkpoint_every=None`` keeps the whole unrolled graph and walks it back once (memory grows
    with the steps). An integer ``k >= 1`` sweeps back one step at a time instead, storing the
    state every ``k`` steps and recomputing the others (memory: ``steps / k + k`` states and one
    step's graph); both give the same gradient up to rounding. ``progress(done, total)`` is called
    after each step of the forward, recompute and reverse passes (segmented mode only).

    ``horizon=H`` (segmented mode) sweeps back through the last ``H`` steps only: the weights act
    in those steps alone, the run before them is held as it was. On a long AdamW run the exact
    derivative through every step is dominated by the sensitivity of the early steps (a change of
    a row's weight in the first batches moves the second moments and everything after them), which
    a removal does not follow; the last epoch holds every row once.

    ``states`` (segmented mode): a ``gradian.replay.states.ReplayStates`` folder for this replay's
    inputs; the kept states live there instead of in memory, and an interrupted replay resumes.

    ``start``: the replay begins after ``start.step`` steps, from the optimizer state a trainer
    checkpoint kept then (``lora_params`` hold the LoRA tensors of that checkpoint), instead of from
    the first step; ``horizon`` may then reach back to ``start.step`` at most. The steps before it are
    the run's own, so rounding differences between the replay and the run only grow over the
    steps after it.

    ``scaling``: ``"exact"`` (the derivative of the weighted run as it is) or ``"held"`` (AdamW's
    second moments and the clipping factor held at the run's values; see the module docstring).
    """
    import torch

    _check_inputs(model, lora_params, rows, batches, weights)
    recipe.check(len(batches))
    if model.training:
        raise ConfigError("replay needs the model in eval mode (no dropout), so a replay is deterministic")
    if scaling not in SCALINGS:
        raise ConfigError(f"replay scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    _check_window(lora_params, len(batches), recipe, horizon, start)
    if checkpoint_every is not None:
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ConfigError(f"replay checkpoint_every must be an integer >= 1 (or None), got {checkpoint_every!r}")
        return _segmented(model, lora_params, rows, batches, weights, recipe, measure, pad_id, checkpoint_every,
                          progress, horizon, states, start, scaling)
    if states is not None:
        raise ConfigError("replay states on disk need the step-by-step sweep: give checkpoint_every too")
    if horizon is not None:
        raise ConfigError("replay horizon needs the step-by-step sweep: give checkpoint_every too")
    w = weights.detach().clone().requires_grad_(True)
    final = _unroll(model, lora_params, rows, batches, w, recipe, pad_id, start, scaling)
    value = measure(ReplayedModel(model, final))
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ConfigError("replay measure must return a scalar tensor")
    (grad,) = torch.autograd.grad(value.reshape(()), w, allow_unused=True)
    if grad is None:
        grad = torch.zeros_like(w)
    return ReplayResult(float(value.detach()), grad.detach(), {n: p.detach() for n, p in final.items()})
