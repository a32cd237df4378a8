"""A run's own trainer checkpoint as the state a replay starts from.

Interface: ``read_trainer_checkpoint(path, params, adapter, recipe) -> (ReplayStart, tensors)``,
raising ``UnusableCheckpoint`` with the reason; ``choose_start(checkpoints, params, adapter,
recipe, latest) -> StartChoice``, the latest usable checkpoint at or before step ``latest``;
``planned_start(checkpoints, latest)``, the one ``choose_start`` tries first (what the plan prices,
before any file is read).

A fine-tune that changes quickly amplifies rounding: two replays of the same recipe that differ
by one rounding in an early step can end a fifth of the adapter apart, so a replay of every step
can describe a retrain rather than the run. A trainer checkpoint holds the run's own LoRA tensors
and optimizer moments after its step N, so a replay that starts there repeats only the steps
after N, and its cost shrinks by the same share.

What an HF Trainer (and TRL's trainers, built on it) writes in ``checkpoint-N/``:
``trainer_state.json`` (``global_step``), the adapter (``adapter_model.safetensors``, or
``adapter_model.bin``, keyed without the adapter's name) and ``optimizer.pt``, torch's optimizer
state dict. Its tensors are numbered in the order the trainer handed the parameters over: one
group for those that take weight decay, then one for those that do not (a name holding ``bias``
or a norm), each in the model's parameter order.

A checkpoint is used only when all of it agrees with the recipe the replay follows: the step in
``trainer_state.json``, the optimizer's step count, betas, epsilon, weight decay and the learning
rate its scheduler set for the next step; one moment pair per LoRA tensor, of that tensor's shape,
finite. Anything else makes it unusable, with the reason, and the replay falls back to an
earlier checkpoint or the first step.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gradian.replay.unrolled import Recipe, ReplayStart

if TYPE_CHECKING:
    import torch

__all__ = ["StartChoice", "UnusableCheckpoint", "choose_start", "planned_start", "read_trainer_checkpoint"]

#: the names the HF Trainer exempts from weight decay (its ``get_decay_parameter_names``)
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
_STEP_DIR = re.compile(r"checkpoint-(\d+)$")
#: relative agreement asked of a learning rate or setting read back from a checkpoint
_RTOL = 1e-6


class UnusableCheckpoint(Exception):
    """A checkpoint the replay cannot start from; the message says why."""


@dataclass
class StartChoice:
    """The checkpoint a replay starts from (``start`` None: the first step) and why others were not."""

    start: ReplayStart | None = None
    #: the LoRA tensors of that checkpoint, by the model's parameter names
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    path: str | None = None
    notes: list[str] = field(default_factory=list)


def _close(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=_RTOL, abs_tol=1e-12)


def _global_step(path: Path) -> int:
    state_file = path / "trainer_state.json"
    try:
        state = json.loads(state_file.read_text())
        step = state["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UnusableCheckpoint(f"{state_file} is missing or holds no global_step ({err})") from None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UnusableCheckpoint(f"{state_file}: global_step {step!r} is not a step count")
    named = _STEP_DIR.search(path.name)
    if named and int(named.group(1)) != step:
        raise UnusableCheckpoint(f"{state_file} says global_step {step}, its folder name step {named.group(1)}")
    return step


def _adapter_tensors(path: Path, params: Mapping[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    import torch

    from gradian.errors import AdapterWeightsError
    from gradian.model_loading import read_adapter_weights

    try:
        saved = read_adapter_weights(path)
    except AdapterWeightsError as err:
        raise UnusableCheckpoint(f"its adapter in {path} cannot be read ({err})") from None
    out = {}
    for name, param in params.items():
        key = name.replace(f".{adapter}.", ".")
        held = saved.get(key)
        if held is None or tuple(held.shape) != tuple(param.shape):
            raise UnusableCheckpoint(f"its adapter has no tensor {key} of shape {tuple(param.shape)}")
        if not torch.isfinite(held).all():
            raise UnusableCheckpoint(f"its adapter tensor {key} holds NaN or inf")
        out[name] = held.detach().to(device=param.device, dtype=param.dtype)
    return out


def _optimizer_order(names: Sequence[str], groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """The LoRA tensor names in the optimizer's numbering: the trainer's decay group, then the others."""
    decay = [n for n in names if not _NO_DECAY.search(n)]
    rest = [n for n in names if _NO_DECAY.search(n)]
    sizes = [len(g.get("params") or []) for g in groups]
    if sum(sizes) != len(names):
        raise UnusableCheckpoint(f"its optimizer holds {sum(sizes)} tensors, the adapter {len(names)} LoRA tensors "
                                 "(the run trained something else beside them)")
    if len(groups) == 1:
        return list(names)
    if len(groups) == 2 and sizes == [len(decay), len(rest)]:
        return decay + rest
    raise UnusableCheckpoint(f"its optimizer's {len(groups)} parameter groups ({sizes} tensors) are not the "
                             "trainer's split into weight-decayed and other tensors")


def read_trainer_checkpoint(path: str | Path, params: Mapping[str, torch.Tensor], adapter: str,
                            recipe: Recipe) -> tuple[ReplayStart, dict[str, torch.Tensor]]:
    """The replay start a trainer checkpoint folder holds, and its LoRA tensors (named as ``params``,
    the adapter ``adapter``'s tensors in the model). Raises ``UnusableCheckpoint``."""
    import torch

    path = Path(path)
    step = _global_step(path)
    steps = len(recipe.schedule)
    if not 0 < step < steps:
        raise UnusableCheckpoint(f"it was saved after step {step}, outside the replay's steps 1..{steps - 1}")
    optimizer_file = path / "optimizer.pt"
    if not optimizer_file.is_file():
        raise UnusableCheckpoint(f"it holds no optimizer.pt (saved with the model only), so AdamW's moments at "
                                 f"step {step} are unknown")
    try:
        saved = torch.load(optimizer_file, map_location="cpu", weights_only=True)
        state, groups = saved["state"], list(saved["param_groups"])
    except Exception as err:  # noqa: BLE001 - a corrupt or foreign file only rules the checkpoint out
        raise UnusableCheckpoint(f"{optimizer_file} is not a torch optimizer state ({type(err).__name__}: {err})") \
            from None
    names = list(params)
    order = _optimizer_order(names, groups)
    lr_next = float(recipe.schedule[step])
    decays = [recipe.weight_decay, 0.0]
    for g, group in enumerate(groups):
        where = f"{optimizer_file} param_groups[{g}]"
        if group.get("amsgrad") or group.get("maximize") or group.get("momentum"):
            raise UnusableCheckpoint(f"{where} uses amsgrad, maximize or momentum, which the replay does not")
        lr = group.get("lr")
        if not isinstance(lr, (int, float)) or not _close(lr, lr_next):
            raise UnusableCheckpoint(f"{where}: learning rate {lr!r} for step {step + 1}, where the run's recorded "
                                     f"schedule gives {lr_next:.6g}")
        wd = group.get("weight_decay", 0.0)
        if len(group.get("params") or []) and not _close(wd, decays[g] if len(groups) == 2 else recipe.weight_decay):
            raise UnusableCheckpoint(f"{where}: weight_decay {wd!r}, where the recipe gives {recipe.weight_decay!r}")
        if recipe.optimizer == "adamw":
            betas, eps = tuple(group.get("betas") or ()), group.get("eps")
            if len(betas) != 2 or not all(_close(a, b) for a, b in zip(betas, recipe.betas)) or \
                    not isinstance(eps, (int, float)) or not _close(eps, recipe.eps):
                raise UnusableCheckpoint(f"{where}: betas {betas} and eps {eps!r}, where the recipe gives "
                                         f"{recipe.betas} and {recipe.eps!r}")
    index = {n: i for i, n in enumerate(order)}
    m: dict[str, torch.Tensor] = {}
    v: dict[str, torch.Tensor] = {}
    if recipe.optimizer == "adamw":
        for name in names:
            held = state.get(index[name])
            if not isinstance(held, Mapping):
                raise UnusableCheckpoint(f"{optimizer_file} has no state for tensor {index[name]} ({name})")
            held_step = held.get("step")
            held_step = float(held_step) if held_step is not None else None
            if held_step is None or int(held_step) != step:
                raise UnusableCheckpoint(f"{optimizer_file}: tensor {index[name]} ({name}) has taken {held_step} "
                                         f"steps, not the {step} of trainer_state.json")
            for key, out in (("exp_avg", m), ("exp_avg_sq", v)):
                moment = held.get(key)
                param = params[name]
                if not isinstance(moment, torch.Tensor) or tuple(moment.shape) != tuple(param.shape):
                    raise UnusableCheckpoint(f"{optimizer_file}: tensor {index[name]} has no {key} of {name}'s "
                                             f"shape {tuple(param.shape)}")
                if not torch.isfinite(moment).all():
                    raise UnusableCheckpoint(f"{optimizer_file}: the {key} of {name} holds NaN or inf")
                out[name] = moment.detach().to(device=param.device, dtype=param.dtype)
    tensors = _adapter_tensors(path, params, adapter)
    return ReplayStart(step=step, m=m, v=v), tensors


def _dated(checkpoints: Sequence[str | Path]) -> list[tuple[int, Path]]:
    """``(step, folder)`` of each ``checkpoint-N`` folder, the latest first."""
    found = [(int(named.group(1)), Path(c)) for c in checkpoints if (named := _STEP_DIR.search(Path(c).name))]
    return sorted(found, reverse=True)


def _candidates(dated: Sequence[tuple[int, Path]], latest: int) -> list[tuple[int, Path]]:
    """The checkpoints a replay whose differentiated steps begin after step ``latest`` may start from."""
    return [(step, path) for step, path in dated if 0 < step <= latest]


def planned_start(checkpoints: Sequence[str | Path], latest: int) -> tuple[int, Path] | None:
    """The checkpoint ``choose_start`` reads first that holds an ``optimizer.pt`` (its contents unchecked)."""
    return next(((s, p) for s, p in _candidates(_dated(checkpoints), latest) if (p / "optimizer.pt").is_file()), None)


def choose_start(checkpoints: Sequence[str | Path], params: Mapping[str, torch.Tensor], adapter: str,
                 recipe: Recipe, latest: int) -> StartChoice:
    """The latest checkpoint saved at or before step ``latest`` that the replay can start from,
    with a note on each later or unusable one passed over; none: the replay starts at step 0."""
    dated = _dated(checkpoints)
    choice = StartChoice()
    if not dated:
        return choice
    for step, path in _candidates(dated, latest):
        try:
            start, tensors = read_trainer_checkpoint(path, params, adapter, recipe)
        except UnusableCheckpoint as why:
            choice.notes.append(f"the run's {path.name} was not used as the start: {why}")
            continue
        choice.start, choice.params, choice.path = start, tensors, str(path)
        return choice
    if not any(step <= latest for step, _ in dated):
        choice.notes.append(f"every checkpoint of the run was saved after step {latest}, where the differentiated "
                            "steps begin, so the replay retrains from the first step")
    return choice
