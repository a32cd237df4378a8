"""The preconditioned query as a direction in LoRA weight space.

An engine scores training example ``j`` as ``score_j = sum_l <r_l, g_j^(l)>``: the stored gradient
of its loss against the engine's preconditioned query ``r`` (``r = q`` for ``graddot``, DataInf's
per-block inverse, EK-FAC's and K-FAC's damped Kronecker inverse per LoRA matrix). The span
drill-down does not re-derive any of them: it asks the engine for ``r`` through
``Engine.precondition`` on the engine's fitted state over the stored gradients, the state
``gradian.engines.fit_engine`` keeps beside the index (the one ``gradian attribute`` fitted, loaded
from the cache; fitted again through the same path only when it is missing). So a row's span score
is the engine's own score of that row, for every engine, in one code path.

Spans differentiate the final model, so the direction is the engine's over the final adapter. An
engine whose score sums over the run's saved checkpoints is fitted here on the final adapter
alone (no checkpoint indexer): ``ekfac`` / ``kfac`` with ``engine.checkpoints: all`` get their
``checkpoints: final`` fit (the same state id an attribution on the final adapter stores), and
``tracin`` its final-adapter term with weight 1, which its fitted state declares to be
``graddot`` (``EngineState.meta["equivalent_to"]``) and is preconditioned as graddot. The notes
say the row's score is then that part, not the sum over checkpoints.

Stored gradients may be randomly projected (``g = P x``), and ``<P x, r> = <x, P^T r>``, so
``P^T r`` is taken by differentiating the projection (it is linear) instead of re-deriving each
projection family's transpose.

Interface: ``query_direction(gm, train, query, engine, engine_config, projector, state=None, *,
context=None, cache_dir=None) -> QueryDirection`` (``{id(linear): tensor shaped like its weight}``,
the engine, and ``r`` in the index's space); ``preconditioned_query(...)`` the ``r`` alone;
``span_state(engine, train, engine_config, context, cache_dir)`` the fitted state spans use.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from gradian.config import EngineConfig
    from gradian.engines.base import EngineState, FitContext, TrainGradients
    from gradian.grads.model import GradientModel
    from gradian.grads.projection import BlockProjector, KroneckerProjector

__all__ = ["DIRECT_ENGINES", "QueryDirection", "final_adapter_config", "preconditioned_query", "query_direction",
           "span_state"]

#: the built-in engines whose span direction is their own preconditioned query over the final
#: adapter, so a row's span score is exactly the engine's score of it (``ekfac`` / ``kfac`` with
#: ``engine.checkpoints: final``). ``tracin`` also works, as its final-adapter term (see the
#: module doc), and so does any engine a plugin registers: it has ``precondition`` too.
DIRECT_ENGINES = ("datainf", "ekfac", "graddot", "kfac")


@dataclass
class QueryDirection:
    """``per_linear``: ``{id(nn.Linear): tensor shaped like its weight}``; ``engine``: whose ``r``."""

    per_linear: dict[int, torch.Tensor]
    engine: str
    notes: list[str] = field(default_factory=list)
    #: ``{block: r [stored width]}``: the preconditioned query in the index's space
    stored: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def score_of(self, train: TrainGradients, row: int) -> float:
        """The engine's score of training row ``row``: ``sum_l <r_l, g_row^(l)>``."""
        from gradian.engines.base import train_rows

        if not 0 <= row < train.n:
            raise IndexError(f"row {row} is not in the index ({train.n} rows)")
        got = train_rows(train, [row])
        return float(sum(np.asarray(got[b][0], dtype=np.float64) @ v for b, v in self.stored.items()))


def final_adapter_config(engine_config: EngineConfig) -> EngineConfig:
    """``engine_config`` with ``checkpoints: final`` (the final adapter alone), unchanged when it is."""
    if getattr(engine_config, "checkpoints", "final") == "final":
        return engine_config
    if dataclasses.is_dataclass(engine_config) and not isinstance(engine_config, type):
        return dataclasses.replace(engine_config, checkpoints="final")
    out = copy.copy(engine_config)
    out.checkpoints = "final"
    return out


def span_state(engine: str, train: TrainGradients, engine_config: EngineConfig, context: FitContext | None = None,
               cache_dir: str | Path | None = None) -> EngineState:
    """The fitted ``EngineState`` of ``engine`` over the final adapter's gradients ``train``.

    ``gradian.engines.fit_engine`` with the final-adapter config: loaded from ``cache_dir`` when
    it was fitted before (what ``gradian attribute`` stored), else fitted and stored. ``context``
    (a ``FitContext``) is what a fit that reads the model needs; its checkpoint indexer is dropped,
    so nothing is fitted under another adapter.
    """
    from gradian.engines import fit_engine

    if context is not None and getattr(context, "checkpoints", None) is not None:
        context = dataclasses.replace(context, checkpoints=None)
    return fit_engine(engine, train, final_adapter_config(engine_config), context, cache_dir=cache_dir)


def preconditioned_query(train: TrainGradients, query: Mapping[str, np.ndarray], engine: str,
                         engine_config: EngineConfig, state: EngineState | None = None, *,
                         context: FitContext | None = None, cache_dir: str | Path | None = None) -> tuple[dict[str, np.ndarray], str, list[str]]:
    """``({block: r [width]}, engine, notes)`` for one query ``{block: [width]}``.

    ``r`` is ``engine``'s ``precondition`` of the query on ``state`` (its fitted state over
    ``train``; ``span_state(engine, train, engine_config, context, cache_dir)`` when not given).
    """
    from gradian.engines import get_engine
    from gradian.engines.base import as_query_matrix, check_widths

    blocks = list(train.block_names)
    config = final_adapter_config(engine_config)
    if state is None:
        state = span_state(engine, train, engine_config, context, cache_dir)
    if state.engine != engine:
        raise ValueError(f"the fitted state is {state.engine}'s, not {engine}'s")
    q, _ = as_query_matrix(query, blocks)
    if any(v.shape[0] != 1 for v in q.values()):
        raise ValueError("spans are scored against one query {block: [width]}, not a query matrix")
    check_widths(train, q)
    owner = get_engine(engine)
    notes: list[str] = []
    if owner.settings(engine_config) != owner.settings(config):
        notes.append(f"{engine} here is fitted on the final adapter alone: with engine.checkpoints "
                     f"{getattr(engine_config, 'checkpoints', '?')} its score sums fits under every saved "
                     "checkpoint, which the final model's tokens cannot split, so the row's score is the "
                     "final adapter's part")
    equivalent = state.meta.get("equivalent_to")
    if equivalent and equivalent != engine:
        # TracIn over the final adapter alone: its state says it is graddot; precondition it as that
        notes.append(f"{engine}: spans are scored against the final adapter's term alone, with weight 1 "
                     f"({equivalent}: the query gradient itself); {engine}'s own score sums that term over the "
                     "run's saved checkpoints, each under its own adapter and learning rate, when it saved any")
        owner = get_engine(equivalent)
    pre = owner.precondition(state, q, config)
    notes[:0] = list(pre.notes)
    if owner.ranks_by_self_influence(config):
        notes.append(f"{engine} ranks rows by RelatIF; spans split the row's influence score, not its rank value")
    r = {b: np.asarray(pre.direction[b], dtype=np.float64)[0] for b in blocks}
    return r, engine, notes


def query_direction(gm: GradientModel, train: TrainGradients, query: Mapping[str, np.ndarray], engine: str,
                    engine_config: EngineConfig, projector: BlockProjector | KroneckerProjector | None = None,
                    state: EngineState | None = None, *, context: FitContext | None = None,
                    cache_dir: str | Path | None = None) -> QueryDirection:
    """The preconditioned query mapped back to every LoRA Linear's weight (see the module doc)."""
    import torch

    r, used, notes = preconditioned_query(train, query, engine, engine_config, state, context=context,
                                          cache_dir=cache_dir)
    per_linear: dict[int, torch.Tensor] = {}
    for block in gm.blocks:
        vector = torch.as_tensor(r[block.name], dtype=torch.float64)
        if projector is not None and projector.block_width(block) < block.dim:
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
