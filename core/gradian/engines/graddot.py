"""Gradient dot product: ``score_j = sum_l <q_l, g_j^(l)>``, no curvature.

The baseline every curvature method has to beat, and a cheap cross-check. With
``engine.normalize_query`` the query is scaled to unit norm over all blocks first (the ranking is
unchanged; the scores become comparable across queries).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from gradian.engines.base import Engine, EngineResult, EngineState, TrainGradients, as_query_matrix, check_widths, compute_dtype
from gradian.engines.registry import register_engine

__all__ = ["GradDotEngine", "gradient_dot"]


def gradient_dot(train: TrainGradients, query: Mapping[str, Any], normalize_query: bool = False) -> tuple[np.ndarray, bool]:
    """``[n, queries]`` dot products of every training gradient with every query, and ``single``."""
    blocks = train.block_names
    q, single = as_query_matrix(query, blocks)
    check_widths(train, q)
    if normalize_query:
        total = np.sqrt(sum((v ** 2).sum(axis=1) for v in q.values()))
        q = {b: v / np.maximum(total, 1e-300)[:, None] for b, v in q.items()}
    scores = np.zeros((train.n, next(iter(q.values())).shape[0]), dtype=np.float64)
    for start, chunk in train.iter_chunks():
        for b in blocks:
            g = chunk[b]
            dt = compute_dtype(g)
            scores[start : start + g.shape[0]] += g.astype(dt, copy=False) @ q[b].T.astype(dt)
    return scores, single


@register_engine
class GradDotEngine(Engine):
    name = "graddot"
    summary = "plain gradient dot product, no curvature (baseline)"

    def score(self, state: EngineState, query: Mapping[str, Any], config: Any, **context: Any) -> EngineResult:
        scores, single = gradient_dot(state.train, query, getattr(config, "normalize_query", False))
        return EngineResult(self.name, scores[:, 0] if single else scores)
