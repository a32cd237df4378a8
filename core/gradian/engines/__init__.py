"""Attribution engines behind one interface, registered by name.

Public interface: ``get_engine(name)``, ``available_engines()``, ``fit_engine(name, train, config,
context, cache_dir) -> EngineState`` (cached beside the index), ``score(train, query, config)``
(fit and score in one call), ``rank_correlation(a, b)``, ``EngineResult``, ``EngineState``,
``FitContext``, ``InMemoryGradients``, ``SIGN_CONVENTION`` and the engines ``DataInfEngine``
(``datainf``), ``EKFACEngine`` (``ekfac``), ``KFACEngine`` (``kfac``), ``GradDotEngine``
(``graddot``), ``TracInEngine`` (``tracin``, with ``TracInCheckpoint`` /
``checkpoint_learning_rates``). ``equivalent_engines(a, b)`` says when two fitted engines are the
same method, so that one cannot cross-check the other.

The sign convention, stated once (``SIGN_CONVENTION``): a positive score means the example
reinforced the queried behaviour, a negative one that it degraded it;
``predicted_loss_delta_if_removed = score / n``.
"""

from typing import TYPE_CHECKING, Mapping

from gradian.engines.base import (
    SIGN_CONVENTION,
    CheckpointGradients,
    Engine,
    EngineResult,
    EngineState,
    FitContext,
    InMemoryGradients,
    TrainGradients,
)
from gradian.engines.correlation import rank_correlation
from gradian.engines.datainf import DataInfEngine, block_damping
from gradian.engines.ekfac import FISHER_KINDS, EKFACEngine, KFACEngine
from gradian.engines.graddot import GradDotEngine
from gradian.engines.registry import available_engines, engine_class, engine_summaries, get_engine
from gradian.engines.state import fit_engine, state_id
from gradian.engines.tracin import TracInCheckpoint, TracInEngine, checkpoint_learning_rates

if TYPE_CHECKING:
    import numpy.typing as npt

    from gradian.config import EngineConfig

__all__ = [
    "FISHER_KINDS",
    "CheckpointGradients",
    "SIGN_CONVENTION",
    "DataInfEngine",
    "EKFACEngine",
    "Engine",
    "EngineResult",
    "EngineState",
    "FitContext",
    "GradDotEngine",
    "KFACEngine",
    "InMemoryGradients",
    "TracInCheckpoint",
    "TracInEngine",
    "TrainGradients",
    "available_engines",
    "block_damping",
    "checkpoint_learning_rates",
    "engine_class",
    "engine_summaries",
    "equivalent_engines",
    "fit_engine",
    "get_engine",
    "rank_correlation",
    "score",
    "state_id",
]


def score(train: TrainGradients, query: "Mapping[str, npt.ArrayLike]", config: "EngineConfig | None" = None,
          fit_context: FitContext | None = None, **context: object) -> EngineResult:
    """Fit the engine ``config.name`` (an ``EngineConfig``) on ``train`` and score ``query``.

    Nothing is cached here; ``fit_engine`` with a ``cache_dir`` stores the fitted state.
    """
    from gradian.config import EngineConfig

    config = config or EngineConfig()
    state = fit_engine(config.name, train, config, fit_context)
    return get_engine(config.name).score(state, query, config, **context)


def equivalent_engines(a: EngineState, b: EngineState) -> str | None:
    """Why the fitted engines ``a`` and ``b`` rank by the same method, or ``None`` if they do not.

    Same name; one fitted state that declares itself equivalent to the other engine (TracIn over
    the final adapter alone is graddot scaled); or the same curvature family.
    """
    if a.engine == b.engine:
        return f"both are {a.engine}"
    for x, y in ((a, b), (b, a)):
        if x.meta.get("equivalent_to") == y.engine:
            return f"{x.engine} here is {y.engine} scaled (the run saved no checkpoint other than the final adapter)"
    family_a, family_b = get_engine(a.engine).curvature, get_engine(b.engine).curvature
    if family_a == family_b == "none" and not (a.meta.get("checkpoints") or b.meta.get("checkpoints")):
        return f"{a.engine} and {b.engine} both rank by plain gradient dot products"
    return None
