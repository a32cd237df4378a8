"""DataInf: closed-form inverse-curvature influence for LoRA blocks (Kwon et al., ICLR 2024).

Per block ``l`` with training gradients ``g_i`` (``n`` examples), query gradient ``q`` and damping
``lam``, the damped Gauss-Newton curvature ``(1/n) sum_i (g_i g_i^T + lam I)`` is inverted term by
term (the swap of sum and inverse is DataInf's approximation), each term by Sherman-Morrison:

    r = (1/n) sum_i (g_i g_i^T + lam I)^-1 q
      = (1/lam) [ q - (1/n) sum_i (g_i . q) / (lam + |g_i|^2) g_i ]

    score_j = sum_l < r_l, g_j^(l) >

``lam`` is DataInf's published rule, ``lambda_scale * mean_i |g_i|^2 / d`` with ``d`` the block's
width (the mean eigenvalue of the block's curvature ``(1/n) sum_i g_i g_i^T``, whose trace is
``mean_i |g_i|^2``), or ``lambda_override``. Dividing by ``d`` matters: without it the damping is
``d`` times too large (thousands of times on real LoRA blocks), and the blocks with the smallest
gradients then dominate the score.
No matrix is formed; ``precondition`` is one pass over the stored gradients and the shared scoring
(``Engine.score_under``) the second, vectorized over examples and queries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np

from gradian.engines.base import Engine, EngineState, Preconditioned, chunk_pass, compute_dtype
from gradian.errors import ConfigError

if TYPE_CHECKING:
    from gradian.config import EngineConfig

__all__ = ["DataInfEngine", "block_damping"]


def block_damping(sq_norms: Mapping[str, np.ndarray], widths: Mapping[str, int], lambda_scale: float,
                  lambda_override: float | None) -> dict[str, float]:
    """Damping per block: ``lambda_override``, or ``lambda_scale * mean_i |g_i|^2 / width``."""
    if lambda_override is not None:
        if not lambda_override > 0:
            raise ConfigError(f"engine.lambda_override must be positive, got {lambda_override}")
        return {b: float(lambda_override) for b in sq_norms}
    if not lambda_scale > 0:
        raise ConfigError(f"engine.lambda_scale must be positive, got {lambda_scale}")
    out = {}
    for b, norms in sq_norms.items():
        mean = float(np.mean(norms)) / max(int(widths[b]), 1) if len(norms) else 0.0
        # a block whose gradients are all zero contributes nothing; any positive damping will do
        out[b] = lambda_scale * mean if mean > 0 else 1.0
    return out


class DataInfEngine(Engine):
    name = "datainf"

    curvature = "datainf"
    default_cross_check = "graddot"
    reads_norms = True

    def precondition(self, state: EngineState, query: dict[str, np.ndarray], config: EngineConfig) -> Preconditioned:
        """``r_l = (1/lam_l) [q_l - (1/n) sum_i (g_i . q_l)/(lam_l + |g_i|^2) g_i]`` per block, every
        query at once, in one pass over the stored gradients."""
        train = state.train
        blocks = train.block_names
        q = query
        norms = train.sq_norms()
        lam = block_damping(norms, {b: q[b].shape[1] for b in blocks}, config.lambda_scale, config.lambda_override)
        n = train.n
        def of_chunk(start: int, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            part = {}
            for b in blocks:
                g = chunk[b]
                dt = compute_dtype(g)
                g = g.astype(dt, copy=False)
                dots = g @ q[b].T.astype(dt)  # [rows, queries]
                coef = dots / (lam[b] + norms[b][start : start + g.shape[0]])[:, None].astype(dt)
                part[b] = (coef.T @ g).astype(np.float64)
            return part

        inputs = {**{f"query.{b}": np.asarray(q[b]) for b in blocks}, "damping": sorted(lam.items())}
        folded = chunk_pass(train, "datainf-precondition", inputs, of_chunk, sums=blocks)
        acc = {b: np.zeros_like(q[b]) + folded.get(b, 0.0) for b in blocks}
        return Preconditioned({b: (q[b] - acc[b] / n) / lam[b] for b in blocks}, damping=lam)
