"""Gradient dot product: ``score_j = sum_l <q_l, g_j^(l)>``, no curvature.

The baseline every curvature method has to beat, and a cheap cross-check. With
``engine.normalize_query`` the query is scaled to unit norm over all blocks first (the ranking is
unchanged; the scores become comparable across queries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gradian.engines.base import Engine, EngineState, Preconditioned, gradient_dot

if TYPE_CHECKING:
    from gradian.config import EngineConfig

__all__ = ["GradDotEngine", "gradient_dot"]


class GradDotEngine(Engine):
    name = "graddot"

    def precondition(self, state: EngineState, query: dict[str, np.ndarray], config: EngineConfig) -> Preconditioned:
        if not getattr(config, "normalize_query", False):
            return Preconditioned(dict(query))
        total = np.sqrt(sum((v ** 2).sum(axis=1) for v in query.values()))
        return Preconditioned({b: v / np.maximum(total, 1e-300)[:, None] for b, v in query.items()})
