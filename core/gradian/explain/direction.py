"""The preconditioned query as a direction in LoRA weight space.

An engine scores training example ``j`` as ``score_j = sum_l <r_l, g_j^(l)>``: the stored gradient
of its loss against the preconditioned query ``r`` (``r = q`` for ``graddot``; DataInf's
``r = (1/lam) [q - (1/n) sum_i (g_i . q)/(lam + |g_i|^2) g_i]`` per block, with DataInf's own
damping ``block_damping``). The span drill-down needs ``r`` as a direction in weight space:
stored gradients may be randomly projected (``g = P x``), and ``<P x, r> = <x, P^T r>``, so
``P^T r`` is taken by differentiating the projection (it is linear) instead of re-deriving each
projection family's transpose.

Interface: ``query_direction(gm, train, query, engine, engine_config, projector) ->
QueryDirection`` (``{id(linear): tensor shaped like its weight}``, and the engine actually used).
Engines without a closed-form ``r`` here (the Kronecker and TracIn families) fall back to DataInf,
and the note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["DIRECT_ENGINES", "QueryDirection", "preconditioned_query", "query_direction"]

#: engines whose preconditioned query is formed here exactly
DIRECT_ENGINES = ("datainf", "graddot")


@dataclass
class QueryDirection:
    """``per_linear``: ``{id(nn.Linear): tensor shaped like its weight}``; ``engine``: whose ``r``."""

    per_linear: dict[int, Any]
    engine: str
    notes: list[str] = field(default_factory=list)
    #: ``{block: r [stored width]}``: the preconditioned query in the index's space
    stored: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def score_of(self, train: Any, row: int) -> float:
        """The engine's score of training row ``row``: ``sum_l <r_l, g_row^(l)>``."""
        for start, chunk in train.iter_chunks():
            size = len(next(iter(chunk.values())))
            if start <= row < start + size:
                return float(sum(np.asarray(chunk[b][row - start], dtype=np.float64) @ v for b, v in self.stored.items()))
        raise IndexError(f"row {row} is not in the index ({train.n} rows)")


def preconditioned_query(train: Any, query: Mapping[str, np.ndarray], engine: str,
                         engine_config: Any) -> tuple[dict[str, np.ndarray], str, list[str]]:
    """``({block: r [width]}, engine used, notes)`` for one query ``{block: [width]}``."""
    blocks = list(train.block_names)
    q = {b: np.asarray(query[b], dtype=np.float64).reshape(-1) for b in blocks}
    notes: list[str] = []
    if engine == "graddot":
        if getattr(engine_config, "normalize_query", False):
            total = float(np.sqrt(sum((v ** 2).sum() for v in q.values())))
            q = {b: v / max(total, 1e-300) for b, v in q.items()}
        return q, "graddot", notes
    if engine != "datainf":
        notes.append(f"span scores use DataInf's preconditioner: {engine} has no closed-form direction here")
    from gradian.engines.datainf import block_damping

    norms = train.sq_norms()
    lam = block_damping(norms, {b: len(q[b]) for b in blocks}, engine_config.lambda_scale,
                        engine_config.lambda_override)
    acc = {b: np.zeros_like(q[b]) for b in blocks}
    for start, chunk in train.iter_chunks():
        for b in blocks:
            g = np.asarray(chunk[b], dtype=np.float64)
            coef = (g @ q[b]) / (lam[b] + norms[b][start : start + g.shape[0]])
            acc[b] += coef @ g
    n = int(train.n)
    return {b: (q[b] - acc[b] / n) / lam[b] for b in blocks}, "datainf", notes


def query_direction(gm: Any, train: Any, query: Mapping[str, np.ndarray], engine: str, engine_config: Any,
                    projector: Any = None) -> QueryDirection:
    """The preconditioned query mapped back to every LoRA Linear's weight (see the module doc)."""
    import torch

    r, used, notes = preconditioned_query(train, query, engine, engine_config)
    per_linear: dict[int, Any] = {}
    for block in gm.blocks:
        vector = torch.as_tensor(r[block.name], dtype=torch.float64)
        if projector is not None and projector.out_dim(block.dim) < block.dim:
            x = torch.zeros((1, block.dim), dtype=torch.float64, requires_grad=True)
            with torch.enable_grad():
                (full,) = torch.autograd.grad((projector.project(block.name, x)[0] * vector).sum(), x)
            vector = full[0]
        offset = 0
        for lin, (rows, cols) in zip(block.linears, block.shapes):
            size = rows * cols
            per_linear[id(lin)] = vector[offset : offset + size].reshape(rows, cols).to(
                lin.weight.dtype).to(lin.weight.device)
            offset += size
    return QueryDirection(per_linear, used, notes, stored=r)
