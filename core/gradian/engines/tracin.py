"""TracIn: gradient dot products summed over the run's saved checkpoints (Pruthi et al., 2020).

    score_j = sum_c  eta_c * sum_l < q_l^(c), g_j^(l,c) >

where ``eta_c`` is the learning rate in effect at checkpoint ``c``, and both gradients are taken
at that checkpoint's adapter. ``fit`` asks ``FitContext.checkpoints`` (the attribution lane's
``CheckpointIndexer``) for the training set's gradients under each saved checkpoint of
``FitContext.run`` (each checkpoint gets its own content-addressed index) and keeps them;
``score`` takes the query at each checkpoint from ``query_for(gm)`` (a callable the caller passes)
or from checkpoints given directly as ``checkpoints=[TracInCheckpoint(...)]``. Without saved
checkpoints it scores the final adapter alone (weight 1), which ranks exactly like ``graddot``,
and says so in the result's notes (and ``EngineState.meta["equivalent_to"]`` names graddot, so a
cross-check between the two is not mistaken for agreement).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from gradian.engines.base import (
    CheckpointGradients,
    Engine,
    EngineResult,
    EngineState,
    FitContext,
    TrainGradients,
    gradient_dot,
    sum_over_checkpoints,
)
from gradian.errors import ConfigError

if TYPE_CHECKING:
    import numpy.typing as npt

    from gradian.config import EngineConfig
    from gradian.runs import RunRecord

__all__ = ["TracInEngine", "TracInCheckpoint", "checkpoint_learning_rates"]


#: one saved checkpoint as TracIn sums it (the engines' shared ``CheckpointGradients``)
TracInCheckpoint = CheckpointGradients


def checkpoint_learning_rates(checkpoints: Sequence[str], record: RunRecord | None) -> list[float]:
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


class TracInEngine(Engine):
    name = "tracin"
    curvature = "none"
    needs_model = True

    def fit(self, train: TrainGradients, config: EngineConfig, context: FitContext | None = None) -> EngineState:
        run = context.run if context is not None else None
        paths = list(getattr(run, "checkpoints", None) or [])
        if not paths or context is None or context.checkpoints is None:
            return EngineState(self.name, train, meta={"checkpoints": [], "equivalent_to": "graddot"})
        checkpoints = context.checkpoints.index(paths, "tracin: indexing", final=train)
        meta: dict[str, Any] = {"checkpoints": [{"label": c.label, "weight": c.weight,
                                                 "index_id": getattr(c.train, "index_id", None)} for c in checkpoints]}
        final_id = getattr(train, "index_id", None)
        if len(checkpoints) == 1 and final_id is not None and meta["checkpoints"][0]["index_id"] == final_id:
            # one checkpoint, and it is the final adapter: a scaled gradient dot product
            meta["equivalent_to"] = "graddot"
        return EngineState(self.name, train, meta=meta, extra={"checkpoints": checkpoints})

    def score(self, state: EngineState, query: Mapping[str, npt.ArrayLike], config: EngineConfig,
              checkpoints: Sequence[TracInCheckpoint] | None = None,
              query_for: Callable[[object], Mapping[str, npt.ArrayLike]] | None = None,
              **context: object) -> EngineResult:
        train = state.train
        normalize = getattr(config, "normalize_query", False)
        checkpoints = list(checkpoints or state.extra.get("checkpoints") or [])
        if not checkpoints:
            scores, single = gradient_dot(train, query, normalize)
            note = ("tracin: the run saved no checkpoints, so it fell back to the final adapter alone; "
                    "its ranking equals graddot's")
            return EngineResult(self.name, scores[:, 0] if single else scores, notes=[note])
        parts: list[tuple[float, EngineResult]] = []
        single = True
        for ckpt in checkpoints:
            if ckpt.train.n != train.n:
                raise ConfigError(
                    f"tracin checkpoint {ckpt.label or '?'} has {ckpt.train.n} examples, the final one {train.n}; "
                    "index every checkpoint on the same dataset"
                )
            q = ckpt.query
            if q is None:
                if query_for is None or ckpt.view is None:
                    raise ConfigError(f"tracin checkpoint {ckpt.label or '?'} has no query gradient; "
                                      "pass query_for= to measure it under the checkpoint")
                q = query_for(ckpt.view)
            scores, single = gradient_dot(ckpt.train, q, normalize)
            parts.append((ckpt.weight, EngineResult(self.name, scores)))
        total, _ = sum_over_checkpoints(parts)
        note = f"tracin: summed over {len(checkpoints)} checkpoints weighted by their learning rates"
        return EngineResult(self.name, total[:, 0] if single else total, notes=[note])
