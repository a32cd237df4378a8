"""TracIn: gradient dot products summed over the run's saved checkpoints (Pruthi et al., 2020).

    score_j = sum_c  eta_c * sum_l < q_l^(c), g_j^(l,c) >

where ``eta_c`` is the learning rate in effect at checkpoint ``c``, and both gradients are taken
at that checkpoint's adapter. Pass the checkpoints as ``checkpoints=[TracInCheckpoint(...)]``.
Without saved checkpoints it scores the final adapter alone (weight 1), which ranks exactly like
``graddot``, and says so in the result's notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from gradian.engines.base import Engine, EngineResult, TrainGradients
from gradian.engines.graddot import gradient_dot
from gradian.engines.registry import register_engine
from gradian.errors import ConfigError

__all__ = ["TracInEngine", "TracInCheckpoint", "checkpoint_learning_rates"]


@dataclass
class TracInCheckpoint:
    """One saved checkpoint: its learning-rate weight, training gradients and query gradient."""

    weight: float
    train: TrainGradients
    query: Mapping[str, Any]
    label: str = ""


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


@register_engine
class TracInEngine(Engine):
    name = "tracin"
    summary = "learning-rate-weighted gradient dot products over saved checkpoints"

    def score(self, train: TrainGradients, query: Mapping[str, Any], config: Any,
              checkpoints: Sequence[TracInCheckpoint] | None = None, **context: Any) -> EngineResult:
        normalize = getattr(config, "normalize_query", False)
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
            scores, single = gradient_dot(ckpt.train, ckpt.query, normalize)
            total = ckpt.weight * scores if total is None else total + ckpt.weight * scores
        assert total is not None
        note = f"tracin: summed over {len(checkpoints)} checkpoints weighted by their learning rates"
        return EngineResult(self.name, total[:, 0] if single else total, notes=[note])
