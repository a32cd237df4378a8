"""Attribution engines behind one interface, registered by name.

Public interface: ``get_engine(name)``, ``available_engines()``, ``score(train, query, config)``,
``rank_correlation(a, b)``, ``EngineResult``, ``InMemoryGradients``, ``SIGN_CONVENTION`` and the
engines ``DataInfEngine`` (``datainf``), ``GradDotEngine`` (``graddot``), ``TracInEngine``
(``tracin``, with ``TracInCheckpoint`` / ``checkpoint_learning_rates``).

The sign convention, stated once (``SIGN_CONVENTION``): a positive score means the example
reinforced the queried behaviour, a negative one that it degraded it;
``predicted_loss_delta_if_removed = score / n``.
"""

from typing import Any, Mapping

from gradian.engines.base import SIGN_CONVENTION, Engine, EngineResult, InMemoryGradients, TrainGradients
from gradian.engines.correlation import rank_correlation
from gradian.engines.datainf import DataInfEngine, block_damping
from gradian.engines.graddot import GradDotEngine
from gradian.engines.registry import available_engines, get_engine, register_engine
from gradian.engines.tracin import TracInCheckpoint, TracInEngine, checkpoint_learning_rates

__all__ = [
    "SIGN_CONVENTION",
    "DataInfEngine",
    "Engine",
    "EngineResult",
    "GradDotEngine",
    "InMemoryGradients",
    "TracInCheckpoint",
    "TracInEngine",
    "TrainGradients",
    "available_engines",
    "block_damping",
    "checkpoint_learning_rates",
    "get_engine",
    "rank_correlation",
    "register_engine",
    "score",
]


def score(train: TrainGradients, query: Mapping[str, Any], config: Any = None, **context: Any) -> EngineResult:
    """Score ``train`` against ``query`` with the engine ``config.name`` (an ``EngineConfig``)."""
    from gradian.config import EngineConfig

    config = config or EngineConfig()
    return get_engine(config.name).score(train, query, config, **context)
