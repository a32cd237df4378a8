"""TracIn: gradient dot products summed over the run's saved checkpoints (Pruthi et al., 2020).

    score_j = sum_c  eta_c * sum_l < q_l^(c), g_j^(l,c) >

where ``eta_c`` is the learning rate in effect at checkpoint ``c``, and both gradients are taken
at that checkpoint's adapter. ``fit`` loads each saved checkpoint of ``FitContext.run`` as an extra
adapter on the one base model already in memory, indexes the training set under it (each
checkpoint gets its own content-addressed index) and keeps the checkpoint's ``GradientModel``;
``score`` takes the query at each checkpoint from ``query_for(gm)`` (a callable the caller passes)
or from checkpoints given directly as ``checkpoints=[TracInCheckpoint(...)]``. Without saved
checkpoints it scores the final adapter alone (weight 1), which ranks exactly like ``graddot``,
and says so in the result's notes (and ``EngineState.meta["equivalent_to"]`` names graddot, so a
cross-check between the two is not mistaken for agreement).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from gradian.engines.base import Engine, EngineResult, EngineState, FitContext, TrainGradients
from gradian.engines.graddot import gradient_dot
from gradian.engines.registry import register_engine
from gradian.errors import ConfigError

__all__ = ["TracInEngine", "TracInCheckpoint", "checkpoint_learning_rates", "index_checkpoints", "same_adapter_weights"]


@dataclass
class TracInCheckpoint:
    """One saved checkpoint: its learning-rate weight, training gradients and query gradient."""

    weight: float
    train: TrainGradients
    query: Mapping[str, Any] | None = None
    label: str = ""
    #: the ``GradientModel`` of this checkpoint (its query is measured under it)
    gm: Any = None
    #: Kronecker factors gathered while this checkpoint's index was built (``collect=True``), if any
    collected: Any = None
    #: the checkpoint holds the final adapter's weights, so it reuses the final index and model
    is_final: bool = False


def checkpoint_learning_rates(checkpoints: Sequence[str], record: Any) -> list[float]:
    """Learning rate at each ``checkpoint-N`` (the logged rate at the last step <= N).

    Falls back to the run's configured learning rate, then 1.0, when nothing was logged.
    """
    import re

    series = record.logs.series("learning_rate") if record is not None else []
    default = getattr(getattr(record, "config", None), "learning_rate", None) or 1.0
    out = []
    for path in checkpoints:
        match = re.search(r"checkpoint-(\d+)", str(path))
        step = int(match.group(1)) if match else None
        rate = default
        if step is not None:
            earlier = [lr for s, lr in series if s <= step]
            if earlier:
                rate = earlier[-1]
        out.append(float(rate))
    return out


def index_checkpoints(context: FitContext, paths: Sequence[str], verb: str,
                      each: Callable[[TracInCheckpoint], None] | None = None, final: TrainGradients | None = None,
                      collect: bool = False) -> list[TracInCheckpoint]:
    """Every checkpoint in ``paths`` loaded as an extra adapter on ``context.gm`` and its training
    gradients indexed (through the content-addressed index cache), weighted by the learning rate
    at that checkpoint. ``each(checkpoint)`` runs while that checkpoint's adapter is active;
    ``context.gm``'s own adapter is active again afterwards. ``verb`` says, in the log, what is
    done under each checkpoint (``"tracin: indexing"``).

    A checkpoint whose LoRA weights equal the final adapter's (the last one a run saves) is not
    indexed again when ``final`` (the final adapter's training gradients) is given: it gets
    ``final``, ``context.gm`` and ``context.collected``. ``collect=True`` gathers the Kronecker
    factors during each checkpoint's index build (``checkpoint.collected``), so an EK-FAC fit
    under it needs no pass of its own when the index was computed rather than read from the cache.
    """
    from gradian.index import GradientIndex

    weights = checkpoint_learning_rates(paths, context.run)
    full = context.config
    out = []
    try:
        for path, weight in zip(paths, weights):
            label = Path(path).name
            view = checkpoint_model(context.gm, path, label, full)
            if final is not None and same_adapter_weights(context.gm.model, label, context.gm.adapter_name):
                if context.log:
                    context.log(f"{verb} under {label}: the final adapter's weights, its index reused")
                view = activate(context.gm, None, full)
                checkpoint = TracInCheckpoint(weight=weight, train=final, label=label, gm=view,
                                              collected=context.collected, is_final=True)
            else:
                if context.log:
                    context.log(f"{verb} under {label}")
                collector = None
                if collect:
                    from gradian.engines.ekfac import KroneckerCollector

                    with KroneckerCollector(view) as collector:
                        index = GradientIndex.build(view, context.tokenizer, context.dataset, full)
                else:
                    index = GradientIndex.build(view, context.tokenizer, context.dataset, full)
                checkpoint = TracInCheckpoint(weight=weight, train=index, label=label, gm=view, collected=collector)
            if each is not None:
                each(checkpoint)
            out.append(checkpoint)
    finally:
        activate(context.gm, None, full)
    return out


def same_adapter_weights(model: Any, first: str, second: str) -> bool:
    """Adapters ``first`` and ``second`` of a PEFT ``model`` have the same LoRA settings and weights."""
    import torch

    if first == second:
        return True
    configs = getattr(model, "peft_config", {})
    if first not in configs or second not in configs:
        return False
    keys = ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "fan_in_fan_out")
    a, b = configs[first], configs[second]
    if any(getattr(a, k, None) != getattr(b, k, None) for k in keys):
        return False
    mine, theirs = f".{first}.", f".{second}."
    left: dict[str, Any] = {}
    right: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if mine in name:
            left[name.replace(mine, ".<adapter>.")] = param
        elif theirs in name:
            right[name.replace(theirs, ".<adapter>.")] = param
    if not left or left.keys() != right.keys():
        return False
    with torch.no_grad():
        return all(left[k].shape == right[k].shape and torch.equal(left[k], right[k]) for k in left)


def checkpoint_model(gm: Any, path: str | Path, label: str, config: Any = None) -> Any:
    """A ``GradientModel`` over the same base with the adapter at ``path`` loaded beside the others.

    The adapter is added to ``gm.model`` under the name ``label`` (once); the returned model
    activates it. Call ``activate(gm)`` to switch back before using another view.
    """
    from gradian.errors import ModelLoadError
    from gradian.grads import fingerprint_path

    model = gm.model
    if label not in getattr(model, "peft_config", {}):
        try:
            model.load_adapter(str(path), adapter_name=label, is_trainable=False)
        except (RuntimeError, ValueError, KeyError, OSError) as err:
            first = (str(err).strip().splitlines() or [""])[0]
            raise ModelLoadError(f"cannot load the TracIn checkpoint {path} as an adapter ({first}); "
                                 "check that it was saved by the same run") from None
    view = activate(gm, label, config)
    view.fingerprints = {"base": gm.fingerprints.get("base", "in-memory"), "adapter": fingerprint_path(Path(path))}
    return view


def activate(gm: Any, adapter_name: str | None = None, config: Any = None) -> Any:
    """Make ``adapter_name`` (default: ``gm``'s own) the active adapter; returns its ``GradientModel``."""
    from gradian.grads import wrap_peft_model

    name = adapter_name or gm.adapter_name
    gm.model.set_adapter(name)
    view = wrap_peft_model(gm.model, config)
    view.fingerprints = dict(gm.fingerprints)
    return view


@register_engine
class TracInEngine(Engine):
    name = "tracin"
    summary = "learning-rate-weighted gradient dot products over saved checkpoints"
    curvature = "none"
    needs_model = True

    def fit(self, train: TrainGradients, config: Any, context: FitContext | None = None) -> EngineState:
        run = context.run if context is not None else None
        paths = list(getattr(run, "checkpoints", None) or [])
        if not paths or context is None or context.gm is None:
            return EngineState(self.name, train, meta={"checkpoints": [], "equivalent_to": "graddot"})
        checkpoints = index_checkpoints(context, paths, "tracin: indexing", final=train)
        meta: dict[str, Any] = {"checkpoints": [{"label": c.label, "weight": c.weight,
                                                 "index_id": getattr(c.train, "index_id", None)} for c in checkpoints]}
        final_id = getattr(train, "index_id", None)
        if len(checkpoints) == 1 and final_id is not None and meta["checkpoints"][0]["index_id"] == final_id:
            # one checkpoint, and it is the final adapter: a scaled gradient dot product
            meta["equivalent_to"] = "graddot"
        return EngineState(self.name, train, meta=meta, extra={"checkpoints": checkpoints})

    def score(self, state: EngineState, query: Mapping[str, Any], config: Any,
              checkpoints: Sequence[TracInCheckpoint] | None = None, query_for: Any = None,
              **context: Any) -> EngineResult:
        train = state.train
        normalize = getattr(config, "normalize_query", False)
        checkpoints = list(checkpoints or state.extra.get("checkpoints") or [])
        if not checkpoints:
            scores, single = gradient_dot(train, query, normalize)
            note = ("tracin: the run saved no checkpoints, so it fell back to the final adapter alone; "
                    "its ranking equals graddot's")
            return EngineResult(self.name, scores[:, 0] if single else scores, notes=[note])
        total: np.ndarray | None = None
        single = True
        for ckpt in checkpoints:
            if ckpt.train.n != train.n:
                raise ConfigError(
                    f"tracin checkpoint {ckpt.label or '?'} has {ckpt.train.n} examples, the final one {train.n}; "
                    "index every checkpoint on the same dataset"
                )
            q = ckpt.query
            if q is None:
                if query_for is None or ckpt.gm is None:
                    raise ConfigError(f"tracin checkpoint {ckpt.label or '?'} has no query gradient; "
                                      "pass query_for= to measure it under the checkpoint")
                q = query_for(ckpt.gm)
            scores, single = gradient_dot(ckpt.train, q, normalize)
            total = ckpt.weight * scores if total is None else total + ckpt.weight * scores
        assert total is not None
        note = f"tracin: summed over {len(checkpoints)} checkpoints weighted by their learning rates"
        return EngineResult(self.name, total[:, 0] if single else total, notes=[note])
