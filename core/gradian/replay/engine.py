"""``engine.name: replay``: each training row's exact effect on the query, through the whole replayed fine-tune.

Interface: ``ReplayEngine`` (registered as ``replay``), ``ReplayInputs`` (what the attribution lane
hands it: the model, the run's initial LoRA tensors, the rows the trainer saw, the recipe) inside a
``ReplayFitContext``, and ``Fidelity`` (how closely the replay reproduced the run).

The measurement is the query the other engines use, taken at the replayed final adapter:
``target``: the mean over query items of the wanted answer's loss; ``contrastive``: the mean of
``l(wanted) - l(generated)``. ``metagradient`` gives ``d measurement / d w_j`` for the weight
``w_j`` of every training row (all ones is the run); dropping row ``j`` changes the measurement
by ``-d/dw_j`` to first order in the weights, so the score ``n * (-d/dw_j)`` follows the sign
convention of every engine (positive: the row lowered the query loss) and
``score_j / n`` is the predicted change of the query loss if the row were removed.

The weights act in the last ``horizon`` steps (default: the last epoch, where every row appears
once); the run before them is held as it was. Differentiating through every step of a long AdamW
run is exact but measures the run's sensitivity to the first batches (which set the optimizer's
second moments for everything after), not what removing a row does; docs/replay.md gives the
measurements.

Fidelity: the replayed adapter is compared with the run's (relative Frobenius difference over all
LoRA tensors) and the measurement with the one at the run's adapter; past
``FIDELITY_REL_DIFF`` the report says the scores describe a retrain with the recorded recipe,
which is what ``gradian counterfactual`` measures, rather than the run as it happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from gradian.engines.base import Engine, EngineResult, EngineState, FitContext, TrainGradients
from gradian.errors import ConfigError
from gradian.replay.recipe import RunRecipe
from gradian.replay.unrolled import ReplayedModel, ReplayStart, checkpoint_interval, metagradient, row_losses

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from gradian.config import EngineConfig
    from gradian.data import TokenizedExample
    from gradian.grads.loss import TokenBatch
    from gradian.jsontypes import JsonScalar
    from gradian.query import QueryItem

__all__ = ["FIDELITY_REL_DIFF", "Fidelity", "ReplayEngine", "ReplayFitContext", "ReplayInputs", "horizon_steps",
           "query_measure", "window_start"]

#: above this relative difference between the replayed adapter and the run's, the report warns
#: that the replay is not the run (float32 rounding over a thousand AdamW steps stays near 1e-4)
FIDELITY_REL_DIFF = 0.01


def horizon_steps(steps: int, steps_per_epoch: int, horizon: int | None = None) -> int:
    """How many of the last steps the row weights act in: ``engine.replay_horizon``, else the last
    epoch, never more than the run's ``steps``."""
    return min(horizon or steps_per_epoch, steps)


def window_start(run_recipe: RunRecipe, horizon: int | None = None) -> int:
    """The steps before the first one the row weights act in: the latest a replay may start after."""
    return run_recipe.steps - horizon_steps(run_recipe.steps, run_recipe.steps_per_epoch, horizon)


@dataclass
class ReplayInputs:
    """What the replay needs, gathered by the attribution lane from the run and the loaded model.

    ``lora_params``: every LoRA tensor of the run's adapter, at the run's values (the model's
    parameters; never written); ``init``: the same names at the run's initial values;
    ``rows``: the rows the trainer saw, tokenized as it did; ``positions``: each one's position
    in the dataset (rows without a supervised token were not trained on).
    """

    model: PeftModel
    lora_params: dict[str, torch.Tensor]
    init: dict[str, torch.Tensor]
    rows: Sequence[TokenizedExample]
    positions: list[int]
    n_examples: int
    run_recipe: RunRecipe
    pad_id: int
    tokenizer: PreTrainedTokenizerBase
    #: the truncation of the query items (``grads.max_seq_length``, as the query gradient's)
    query_max_seq_length: int | None
    #: what the replay could not reproduce or had to assume (lora dropout, a missing data_seed)
    notes: list[str] = field(default_factory=list)
    checkpoint_every: int | None = None
    #: how many of the last steps the weights act in (None: the last epoch)
    horizon: int | None = None
    #: where the replay keeps its states (``<cache_dir>/replay``); None holds them in memory
    state_dir: Path | None = None
    #: what names the model outside the tensors handed in (the base model's and the tokenizer's
    #: fingerprints), part of the key of the replay's folder under ``state_dir``
    identity: dict[str, str] = field(default_factory=dict)
    #: the run's own state the replay starts from (a trainer checkpoint's), None: the first step
    start: ReplayStart | None = None
    #: that checkpoint's LoRA tensors (``lora_params``' names)
    start_params: dict[str, torch.Tensor] = field(default_factory=dict)
    #: ``exact`` or ``held`` (``metagradient``'s ``scaling``: AdamW's second moments and the
    #: clipping factor held at the run's values in the derivative)
    scaling: str = "exact"

    @property
    def window(self) -> int:
        return horizon_steps(self.run_recipe.steps, self.run_recipe.steps_per_epoch, self.horizon)

    @property
    def start_step(self) -> int:
        return self.start.step if self.start is not None else 0

    @property
    def every(self) -> int:
        return checkpoint_interval(self.run_recipe.steps - self.start_step, self.checkpoint_every)

    @property
    def first_params(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors the replay starts from: the checkpoint's, else the run's initial ones."""
        return self.start_params if self.start is not None else self.init


@dataclass
class ReplayFitContext(FitContext):
    """A ``FitContext`` carrying the replay's inputs."""

    replay: ReplayInputs | None = None


@dataclass
class Fidelity:
    """How closely the replay reproduced the run."""

    rel_diff: float
    measurement_replayed: float
    measurement_run: float
    steps: int
    #: the step the replay started after (a trainer checkpoint's), 0: from the first step
    start_step: int = 0

    @property
    def faithful(self) -> bool:
        return self.rel_diff <= FIDELITY_REL_DIFF

    def to_dict(self) -> dict[str, float | int | bool]:
        return {"rel_diff": self.rel_diff, "measurement_replayed": self.measurement_replayed,
                "measurement_run": self.measurement_run, "steps": self.steps, "start_step": self.start_step,
                "faithful": self.faithful}

    def sentence(self) -> str:
        retrained = (f"{self.steps} optimizer steps retrained from the run's recipe" if not self.start_step else
                     f"the last {self.steps - self.start_step} of the run's {self.steps} optimizer steps retrained "
                     f"from its own checkpoint after step {self.start_step}")
        head = (f"replay: {retrained}; the replayed adapter differs "
                f"from the run's by {self.rel_diff:.2e} (relative), the query measurement is "
                f"{self.measurement_replayed:.4f} replayed against {self.measurement_run:.4f} for the run")
        if self.faithful:
            return head + ", so the scores are the effect of each row on this run"
        why = ("another initialization, data order or trainer, or a run so sensitive that rounding differences "
               "grow over its steps; a trainer checkpoint kept with its optimizer state before the last epoch "
               "lets the replay start from the run's own state" if not self.start_step else
               "another data order or trainer after the checkpoint, or rounding differences grown over the steps "
               "after it")
        return (head + f"; past {FIDELITY_REL_DIFF:g} the replay is not the run ({why}), so each score is the "
                "effect of the row on a retrain with this recipe, the quantity gradian counterfactual measures, "
                "not on the run as it happened")


class ReplayEngine(Engine):
    name = "replay"
    summary = "exact metagradients through the replayed fine-tune (needs the run's recipe)"
    curvature = "replay"
    default_cross_check = "ekfac"
    needs_model = True
    #: the lane builds ``ReplayFitContext.replay`` for an engine that asks for it
    needs_replay = True

    def fit(self, train: TrainGradients, config: EngineConfig, context: FitContext | None = None) -> EngineState:
        inputs = getattr(context, "replay", None)
        if not isinstance(inputs, ReplayInputs):
            raise ConfigError("engine.name replay needs the training run (its recipe and adapter) from the "
                              "attribution lane; run it through gradian attribute with --run or --mlflow-run")
        if train is not None and getattr(train, "n", inputs.n_examples) != inputs.n_examples:
            raise ConfigError(f"replay: the index holds {train.n} rows but the dataset {inputs.n_examples}; "
                              "attribute the dataset the run trained on")
        meta = {"steps": inputs.run_recipe.steps, "checkpoint_every": inputs.every, "horizon": inputs.window,
                "start_step": inputs.start_step, "scaling": inputs.scaling,
                "optimizer": inputs.run_recipe.recipe.optimizer, "reduction": inputs.run_recipe.recipe.reduction}
        return EngineState(self.name, train, meta=meta, extra={"inputs": inputs})

    def describe(self, config: EngineConfig, state: EngineState | None = None) -> dict[str, JsonScalar]:
        if state is None:
            return {}
        described = ("steps", "checkpoint_every", "horizon", "start_step", "scaling", "optimizer")
        out = {f"replay_{k}": v for k, v in state.meta.items() if k in described}
        fidelity = state.meta.get("fidelity")
        if fidelity:
            out.update({"replay_fidelity_rel_diff": fidelity["rel_diff"],
                        "replay_fidelity_faithful": fidelity["faithful"]})
        return out

    def score(self, state: EngineState, query: Mapping[str, npt.ArrayLike], config: EngineConfig,
              query_items: Sequence[QueryItem] = (), query_signal: str = "target",
              progress: Callable[[int, int], None] | None = None, **context: object) -> EngineResult:
        import torch

        inputs: ReplayInputs = state.extra["inputs"]
        if not query_items:
            raise ConfigError("replay scores a query measurement: it needs the query items (an eval set)")
        measure = query_measure(inputs, query_items, query_signal)
        relabel = getattr(progress, "relabel", None)  # a bar that counted examples now counts steps
        if relabel is not None:
            relabel(f"{self.name}: replaying and sweeping back", "steps")
        weights = torch.ones(len(inputs.rows), dtype=next(iter(inputs.lora_params.values())).dtype)
        states = None
        if inputs.state_dir is not None:
            from gradian.replay.states import ReplayStates

            states = ReplayStates(inputs.state_dir / _state_key(inputs, query_items, query_signal))
        result = metagradient(inputs.model, inputs.first_params, inputs.rows, inputs.run_recipe.batches, weights,
                              inputs.run_recipe.recipe, measure, pad_id=inputs.pad_id,
                              checkpoint_every=inputs.every, progress=progress, horizon=inputs.window, states=states,
                              start=inputs.start, scaling=inputs.scaling)
        with torch.no_grad():
            run_value = float(measure(ReplayedModel(inputs.model, {n: p.detach() for n, p in inputs.lora_params.items()})))
        fidelity = Fidelity(_rel_diff(result.params, inputs.lora_params), result.value, run_value,
                            inputs.run_recipe.steps, inputs.start_step)
        state.meta["fidelity"] = fidelity.to_dict()
        scores = np.zeros(inputs.n_examples, dtype=np.float64)
        grad = result.grad.detach().to(torch.float64).cpu().numpy()
        scores[np.asarray(inputs.positions, dtype=np.int64)] = -inputs.n_examples * grad
        window = inputs.window
        notes = [fidelity.sentence(),
                 f"replay: each row's weight is differentiated through the last {window} of the "
                 f"{inputs.run_recipe.steps} steps" + (" (the last epoch, which holds every row once)"
                                                      if window == inputs.run_recipe.steps_per_epoch else "")
                 + "; the run before them is held as it was"]
        if inputs.scaling == "held":
            notes.append("replay: AdamW's second moments and the clipping factor are held at the run's values in the "
                         "derivative (engine.replay_scaling: held), so a weight acts through its gradient only")
        notes += [f"replay: {n}" for n in inputs.notes + list(inputs.run_recipe.notes)]
        if states is not None:
            if result.resumed == "reused":
                notes.append(f"replay: read back from {states.root}, where a run with the same inputs finished it")
            elif result.resumed:
                notes.append(f"replay: {result.resumed} ({states.root})")
            else:
                notes.append(f"replay: its states were written under {states.root} while it ran; the finished "
                             "replay stays there, so a run with the same inputs reads it back")
            notes += [f"replay: {r}" for r in states.repaired]
        if len(inputs.positions) < inputs.n_examples:
            notes.append(f"replay: {inputs.n_examples - len(inputs.positions)} row(s) kept no supervised token "
                         "within the run's max_seq_length and were not trained on; their score is 0")
        if query_signal and np.ndim(next(iter(query.values()))) == 2:
            notes.append("replay: one metagradient of the mean query, so no per-item columns")
        return EngineResult(self.name, scores, notes=notes)


def _state_key(inputs: ReplayInputs, items: Sequence[QueryItem], signal: str) -> str:
    """The folder of this replay under ``state_dir``: a digest of everything it computes from."""
    import hashlib

    from gradian.replay.states import replay_key, tensor_digest

    rows = hashlib.sha256()
    for row in inputs.rows:
        rows.update(np.asarray(row.input_ids, dtype=np.int64).tobytes() + b"|")
        rows.update(np.asarray(row.labels, dtype=np.int64).tobytes() + b"/")
    recipe = inputs.run_recipe.recipe
    some = next(iter(inputs.lora_params.values()))
    return replay_key({
        "identity": inputs.identity, "init": tensor_digest(inputs.init), "rows": rows.hexdigest(),
        "batches": [list(map(int, step)) for step in inputs.run_recipe.batches],
        "recipe": [list(map(float, recipe.schedule)), recipe.optimizer, list(recipe.betas), recipe.eps,
                   recipe.weight_decay, recipe.max_grad_norm, recipe.reduction],
        "every": inputs.every, "horizon": inputs.window, "pad_id": inputs.pad_id,
        # only when not exact, so the folders of exact replays keep the key they had
        **({"scaling": inputs.scaling} if inputs.scaling != "exact" else {}),
        "start": None if inputs.start is None else [inputs.start.step, tensor_digest(inputs.start_params),
                                                    tensor_digest(inputs.start.m), tensor_digest(inputs.start.v)],
        "query": [signal, inputs.query_max_seq_length,
                  [[item.prompt_messages, item.wanted, item.generated if signal == "contrastive" else None]
                   for item in items]],
        "dtype": str(some.dtype), "device": some.device.type})


def _rel_diff(replayed: Mapping[str, torch.Tensor], run: Mapping[str, torch.Tensor]) -> float:
    import torch

    num = sum(float(((replayed[n].detach().to(torch.float64) - p.detach().to(torch.float64)) ** 2).sum())
              for n, p in run.items())
    den = sum(float((p.detach().to(torch.float64) ** 2).sum()) for p in run.values())
    return math.sqrt(num / den) if den > 0 else math.sqrt(num)


def query_measure(inputs: ReplayInputs, items: Sequence[QueryItem],
                   signal: str) -> Callable[[ReplayedModel], torch.Tensor]:
    """The query measurement as a function of the replayed model: the mean item loss of the wanted
    answers (``target``), minus that of the generated ones (``contrastive``; nothing is subtracted
    for an item still answered right, ``QueryItem.kept``)."""
    from gradian.grads.loss import collate
    from gradian.query.build import query_rows

    prompts = [item.prompt_messages for item in items]
    wanted = collate(query_rows(inputs.tokenizer, prompts, [i.wanted for i in items], inputs.query_max_seq_length),
                     inputs.pad_id)
    generated = None
    contrasted = [k for k, item in enumerate(items) if item.contrasts]
    if signal == "contrastive" and contrasted:
        generated = collate(query_rows(inputs.tokenizer, [prompts[k] for k in contrasted],
                                       [items[k].generated or "" for k in contrasted], inputs.query_max_seq_length),
                            inputs.pad_id)
    device = next(iter(inputs.lora_params.values())).device

    def losses(model: ReplayedModel, batch: TokenBatch) -> torch.Tensor:
        out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
        return row_losses(out.logits, batch.labels.to(device))

    def measure(model: ReplayedModel) -> torch.Tensor:
        value = losses(model, wanted).sum()
        if generated is not None:
            value = value - losses(model, generated).sum()
        return value / len(items)

    return measure
