"""What ``engine.name: replay`` costs: its optimizer steps, its work in training runs, its memory.

Interface: ``replay_cost(run_recipe, model, adapter, rows, capture, horizon=None) -> ReplayCost``
prices the replay of a run whose recipe ``gradian.replay.recipe.recipe_from_run`` read (the steps
and the rows of each are the recipe's own), with the sweep the engine makes
(``gradian.replay.unrolled.checkpoint_interval``, ``sweep_segments``; the horizon of
``gradian.replay.engine.horizon_steps``): nothing is re-derived here.

The work, in plain training steps (a step's forward, backward and optimizer update, as the run
took it): the forward replay takes every one of the run's ``T`` steps and keeps the state every
``k`` steps; the reverse sweep recomputes, in each segment holding one of the last ``H`` steps,
the states after the segment's kept one (``R`` plain steps in all), and rebuilds each of the ``H``
steps with its double-backward graph and pulls the adjoint back through it. One such
differentiated step costs ``c`` plain steps, so the replay is ``(T + R + c H) / T`` training runs.
A replay that starts from the run's own trainer checkpoint after step ``S`` (``start_step``;
``engine.replay_start: auto``) replays ``T - S`` steps forward instead of ``T``;
``c`` is measured by ``gradian.plan.timing.calibrate_replay`` when the plan times the model
(``DIFFERENTIATED_STEP`` otherwise, the median docs/replay.md gives).

The memory of the replay, on the device it runs on: the model's weights and its adapter, a copy
of the initial LoRA tensors, the states held at once (``peak_states`` x ``state_bytes``; a state is
the LoRA tensors and AdamW's two moments, kept as zeros under SGD too), the adjoint of a state and
the state a rebuilt step returns, the row weights and their gradient, and one differentiated
step's graph on the widest step (the capture's activations, logits and loss backward for that
step's rows, twice: the first backward is kept as a graph for the second).

Where the kept states live: the attribution lane gives the engine a folder under ``cache_dir``
(``gradian.replay.states``), so the kept states are written there and only the segment being
swept is in memory (``on_disk=True``, what ``gradian attribute`` does); ``on_disk=False`` prices
the engine holding every kept state in memory (its API without a folder). On disk: every kept
state but the initial one, the final state, and while the sweep runs two records of its adjoint
and the row weights' gradient (the new one is written before the old one is removed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from gradian.plan.memory import CaptureSettings, estimate_memory
from gradian.plan.shapes import AdapterShape, BatchShape, ModelShape, lora_linears

if TYPE_CHECKING:
    from gradian.replay.recipe import RunRecipe

__all__ = ["ReplayCost", "replay_cost", "DIFFERENTIATED_STEP", "STATE_PARTS"]

#: a differentiated step of the reverse sweep in plain training steps, where the plan does not
#: time one: the median of 18 ``gradian plan --engine replay`` calibrations on a tinyworld
#: fine-tune, 0.9 to 5.2 on a shared 2-core CPU (docs/replay.md, "What gradian plan prices")
DIFFERENTIATED_STEP = 2.5

#: tensors per LoRA tensor in a replay state: the tensor, AdamW's first and second moments
STATE_PARTS = 3


@dataclass(frozen=True)
class ReplayCost:
    """The replay of one run, priced (module doc)."""

    #: the run's optimizer steps, one epoch's, and the optimizer
    steps: int
    steps_per_epoch: int
    optimizer: str
    #: rows the run trained on (those with a supervised token)
    rows: int
    #: the last steps differentiated, and the steps between kept states
    horizon: int
    checkpoint_every: int
    #: plain steps of the forward replay, plain steps recomputed by the sweep, differentiated steps
    forward_steps: int
    recomputed_steps: int
    differentiated_steps: int
    #: one differentiated step in plain steps, and where that figure comes from
    differentiated_step: float
    differentiated_source: str
    #: bytes of one state (every LoRA tensor and its two moments)
    state_bytes: int
    #: states kept by the forward replay (the initial one included), and held at once in the sweep
    kept_states: int
    peak_states: int
    #: the row weights and their gradient
    row_weights_bytes: int
    #: the widest step (rows and padded width), and one differentiated step's graph on it
    widest_step: BatchShape
    step_graph: int
    #: the model's weights and its adapter, and a copy of the initial LoRA tensors
    weights: int
    adapter: int
    #: the kept states are written under cache_dir (what gradian attribute does), not held in memory
    on_disk: bool = True
    #: seconds of one plain step per padded token, when the plan timed one
    seconds_per_token: float | None = None
    #: padded tokens of every step, in the run's order
    step_tokens: tuple[int, ...] = ()
    #: the step the replay starts after (a trainer checkpoint's), 0: the first step; and its folder
    start_step: int = 0
    start_checkpoint: str = ""

    @property
    def training_runs(self) -> float:
        """The replay's work as a multiple of the run's own ``steps`` training steps."""
        work = self.forward_steps + self.recomputed_steps + self.differentiated_step * self.differentiated_steps
        return work / max(self.steps, 1)

    @property
    def held_states_bytes(self) -> int:
        """The states held at once, the adjoint and a rebuilt step's new state."""
        return (self.peak_states + 2) * self.state_bytes

    @property
    def peak(self) -> int:
        """Peak memory of the replay on its device."""
        return (self.weights + self.adapter + self.state_bytes // STATE_PARTS + self.held_states_bytes
                + self.row_weights_bytes + self.step_graph)

    @property
    def disk_bytes(self) -> int:
        """Bytes the replay keeps on disk at most: every kept state but the initial one, the final
        state, and two sweep records (the adjoint, a state's worth, and the row weights' gradient);
        nothing when the states are held in memory."""
        if not self.on_disk:
            return 0
        return self.kept_states * self.state_bytes + 2 * (self.state_bytes + self.row_weights_bytes // 2)

    @property
    def seconds(self) -> float | None:
        """Wall time of the replay from the timed rate: every step's padded tokens, once for the
        forward replay, once more for a recomputed step, ``differentiated_step`` times for a
        differentiated one."""
        if self.seconds_per_token is None or not self.step_tokens:
            return None
        return self.seconds_per_token * self.work_tokens

    @property
    def work_tokens(self) -> float:
        """Padded tokens the replay processes, in plain-step units (see ``seconds``)."""
        from gradian.replay.unrolled import sweep_segments

        tokens = self.step_tokens
        work = float(sum(tokens[self.start_step:]))
        for first, last, low in sweep_segments(self.steps, self.checkpoint_every, self.horizon, self.start_step):
            work += sum(tokens[first:last - 1])
            work += self.differentiated_step * sum(tokens[low:last])
        return work

    def to_json(self) -> dict[str, object]:
        from dataclasses import asdict

        data = asdict(self)
        data.pop("step_tokens")
        data.update(training_runs=self.training_runs, held_states_bytes=self.held_states_bytes, peak=self.peak,
                    disk_bytes=self.disk_bytes, seconds=self.seconds)
        return data


def replay_cost(run_recipe: RunRecipe, model: ModelShape, adapter: AdapterShape, lengths: Sequence[int],
                supervised: Sequence[int], capture: CaptureSettings, horizon: int | None = None, differentiated_step: float | None = None,
                differentiated_source: str = "", seconds_per_token: float | None = None,
                checkpoint_every: int | None = None, on_disk: bool = True, start_step: int = 0,
                start_checkpoint: str = "") -> ReplayCost:
    """The replay of ``run_recipe`` priced. ``lengths`` and ``supervised``: the tokens and the
    supervised tokens of each row the run trained on, in the recipe's row order; ``horizon``:
    ``engine.replay_horizon``; ``checkpoint_every``: ``engine.replay_checkpoint_every``;
    ``differentiated_step`` and ``seconds_per_token``: a timed differentiated step (in plain
    steps) and plain step; ``on_disk``: where the kept states live (module doc); ``start_step``:
    the step of the trainer checkpoint (``start_checkpoint``) the replay starts from, 0 for none."""
    from gradian.replay.engine import horizon_steps
    from gradian.replay.unrolled import checkpoint_interval, checkpoint_starts, sweep_segments

    steps = run_recipe.steps
    window = horizon_steps(steps, run_recipe.steps_per_epoch, horizon)
    if not 0 <= start_step <= steps - window:
        raise ValueError(f"start_step {start_step} is not in 0..{steps - window}, before the differentiated steps")
    every = checkpoint_interval(steps - start_step, checkpoint_every)
    segments = sweep_segments(steps, every, window, start_step)
    recomputed = sum(last - first - 1 for first, last, _ in segments)
    differentiated = sum(last - low for _, last, low in segments)
    kept = len(checkpoint_starts(steps, every, start_step))
    if on_disk:
        # the initial state, the final one, and a segment's: its first read back (the initial
        # state itself for the first segment) and those recomputed after it
        peak_states = 2 + max((last - first - (first == start_step) for first, last, _ in segments), default=0)
    else:
        # the kept states, the final one, and those a segment recomputes beside its kept one
        peak_states = kept + 1 + max((last - first - 1 for first, last, _ in segments), default=0)
    # the replay trains every LoRA tensor of the adapter, whatever grads.module_filter keeps
    linears = lora_linears(model, adapter, None)
    lora_values = sum(lin.r * (lin.in_features + lin.out_features) for lin in linears)
    state = STATE_PARTS * lora_values * capture.adapter_bytes
    widths = [max(lengths[r] for r in step) for step in run_recipe.batches]
    step_tokens = tuple(len(step) * width for step, width in zip(run_recipe.batches, widths))
    widest = max(range(steps), key=lambda t: step_tokens[t], default=0)
    width = widths[widest] if widths else 1
    shape = BatchShape(len(run_recipe.batches[widest]) if run_recipe.batches else 1, width,
                       sum(supervised[r] for r in run_recipe.batches[widest]) if run_recipe.batches else 1)
    # the model's own forward and loss: no hooks, no per-example gradients
    estimate = estimate_memory(model, linears, shape, replace(capture, projection_dim=None))
    graph = 2 * (estimate.activations + estimate.logits + estimate.loss_backward)
    if differentiated_step is None:
        differentiated_step, differentiated_source = (DIFFERENTIATED_STEP, "not timed here: the median of "
                                                      "calibrations on tinyworld, docs/replay.md")
    return ReplayCost(
        steps=steps, steps_per_epoch=run_recipe.steps_per_epoch, optimizer=run_recipe.recipe.optimizer,
        rows=len(lengths), horizon=window, checkpoint_every=every, forward_steps=steps - start_step,
        recomputed_steps=recomputed,
        differentiated_steps=differentiated, differentiated_step=differentiated_step,
        differentiated_source=differentiated_source, state_bytes=state, kept_states=kept, peak_states=peak_states,
        row_weights_bytes=2 * len(lengths) * capture.adapter_bytes, widest_step=shape, step_graph=graph,
        weights=estimate.weights, adapter=estimate.adapter_weights, on_disk=on_disk,
        seconds_per_token=seconds_per_token, step_tokens=step_tokens, start_step=start_step,
        start_checkpoint=start_checkpoint)
