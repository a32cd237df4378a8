"""The engine interface, the gradient containers it reads, and the sign convention.

Interface: an engine is an ``Engine`` subclass with a ``name``, ``fit(train, config, context) ->
EngineState`` (whatever the engine computes once per index: curvature factors, per-checkpoint
data) and ``score(state, query, config, **context) -> EngineResult`` (``[n_train]``, or
``[n_train, n_queries]`` for a query matrix). ``train`` is any ``TrainGradients`` (an
``InMemoryGradients`` or an opened ``GradientIndex``): per-block ``[n, width]`` arrays read chunk
by chunk, plus per-block squared norms. ``query`` is ``{block: [width]}`` or
``{block: [queries, width]}``. ``FitContext`` carries what a fit may need beyond the stored
gradients (the model, the tokenized training set, the run); engines that need none ignore it.
``settings(config)`` lists the settings a fitted state depends on: with the index id they make
the state's id (``gradian.engines.state``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Protocol

import numpy as np

from gradian.errors import IndexMismatchError

__all__ = [
    "SIGN_CONVENTION",
    "Engine",
    "EngineResult",
    "EngineState",
    "FitContext",
    "InMemoryGradients",
    "TrainGradients",
    "as_query_matrix",
]

#: The one statement of the sign of every score this project reports.
SIGN_CONVENTION = (
    "score_j > 0: training example j reinforced the queried behaviour (training on it lowered the "
    "query loss, or the contrastive query loss); score_j < 0: it degraded the behaviour. "
    "Harm is -score. predicted_loss_delta_if_removed_j = score_j / n, the first-order change of "
    "the query loss if example j were dropped from the n training examples and the model retrained."
)


class TrainGradients(Protocol):
    """Per-example training gradients, stored per block."""

    @property
    def block_names(self) -> list[str]: ...

    @property
    def n(self) -> int: ...

    def iter_chunks(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Yield ``(start row, {block: [rows, width]})`` covering rows ``0..n`` in order."""
        ...

    def sq_norms(self) -> dict[str, np.ndarray]:
        """``{block: [n]}`` squared L2 norm of each example's block gradient."""
        ...


class InMemoryGradients:
    """``TrainGradients`` over arrays already in memory (``{block: [n, width]}``)."""

    def __init__(self, blocks: Mapping[str, Any], chunk_size: int = 4096) -> None:
        self._blocks = {k: np.asarray(v) for k, v in blocks.items()}
        sizes = {v.shape[0] for v in self._blocks.values()}
        if len(sizes) != 1:
            raise ValueError(f"every block needs the same number of examples, got sizes {sorted(sizes)}")
        self._n = sizes.pop()
        self.chunk_size = chunk_size

    @property
    def block_names(self) -> list[str]:
        return list(self._blocks)

    @property
    def n(self) -> int:
        return self._n

    def iter_chunks(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        for start in range(0, self._n, self.chunk_size):
            yield start, {k: v[start : start + self.chunk_size] for k, v in self._blocks.items()}

    def sq_norms(self) -> dict[str, np.ndarray]:
        return {k: np.einsum("ij,ij->i", v, v, dtype=np.float64) for k, v in self._blocks.items()}


@dataclass
class EngineResult:
    """Scores of every training example, with what the engine did to produce them.

    ``scores`` is ``[n]`` for one query, ``[n, queries]`` for several; see ``SIGN_CONVENTION``.
    """

    engine: str
    scores: np.ndarray
    notes: list[str] = field(default_factory=list)
    #: damping per block (DataInf), for the manifest and the report
    damping: dict[str, float] | None = None
    #: what the rows are ordered by, when it is not ``scores`` itself (same shape and sign, not in
    #: loss units: EK-FAC's RelatIF ranking); ``scores`` stays the influence the loss figures use
    ranking: np.ndarray | None = None

    @property
    def rank_scores(self) -> np.ndarray:
        """The values rows are ranked by: ``ranking`` when the engine gives one, else ``scores``."""
        return self.scores if self.ranking is None else self.ranking

    @property
    def n(self) -> int:
        return int(self.scores.shape[0])

    @property
    def predicted_loss_delta_if_removed(self) -> np.ndarray:
        """First-order change of the query loss, in nats, if each example were removed."""
        return self.scores / self.n

    @property
    def harm(self) -> np.ndarray:
        return -self.scores


def as_query_matrix(query: Mapping[str, Any], blocks: list[str]) -> tuple[dict[str, np.ndarray], bool]:
    """``{block: [queries, width]}`` float64, and whether the input was a single query."""
    missing = [b for b in blocks if b not in query]
    if missing:
        raise IndexMismatchError(
            f"the query gradient has no block '{missing[0]}' that the training gradients have "
            f"({len(missing)} missing); build the query with the same model, module_filter and projection"
        )
    out, single = {}, False
    for b in blocks:
        q = np.asarray(query[b], dtype=np.float64)
        if q.ndim == 1:
            single = True
            q = q[None, :]
        out[b] = q
    return out, single


@dataclass
class FitContext:
    """What a fit may need beyond the stored gradients; every field may be missing.

    ``gm`` is the ``GradientModel`` the index was built under, ``tokenized`` the training set as
    the index saw it (``TokenizedExample`` rows, dataset order), ``pad_id`` the tokenizer's pad
    id, ``grads`` the ``GradsConfig`` of the index, ``run`` the ``RunRecord`` (checkpoints),
    ``seed`` the run's seed, ``progress(done, total)`` a progress callback.
    """

    gm: Any = None
    tokenized: Any = None
    pad_id: int | None = None
    grads: Any = None
    run: Any = None
    seed: int = 0
    tokenizer: Any = None
    dataset: Any = None
    progress: Any = None
    log: Any = None
    #: the whole ``GradianConfig`` (model loading and index settings for per-checkpoint indexes)
    config: Any = None
    #: curvature statistics gathered during the index build (``KroneckerCollector``), if any
    collected: Any = None


@dataclass
class EngineState:
    """A fitted engine: its arrays (persisted), a small JSON ``meta`` and the training gradients.

    ``train`` is not persisted: a state is stored beside the index it was fitted on and
    re-attached to it when loaded. ``state_id`` is set once the state is stored;
    ``cache_hit`` says it was loaded rather than fitted.
    """

    engine: str
    train: Any
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    state_id: str | None = None
    cache_hit: bool = False
    fit_seconds: float = 0.0
    #: objects that live only in memory (models, opened per-checkpoint indexes)
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """One attribution method. Subclasses register themselves with ``@register_engine``."""

    name: str = ""
    #: one line for ``--help`` and the report
    summary: str = ""
    #: what the method does with curvature: ``none`` (gradient dot products), ``datainf``
    #: (per-example rank-one inverses), ``kronecker`` (Kronecker-factored). Two engines of the same
    #: family with equivalent settings are not an independent cross-check of each other.
    curvature: str = "none"
    #: the cross-check ``--cross-check auto`` picks: an engine that ranks by another method
    default_cross_check: str = "datainf"
    #: the fit reads the model (not only the stored gradients); it then needs ``FitContext.gm``
    needs_model: bool = False
    #: the fitted state is worth storing beside the index (it cost a pass over the data)
    persist_state: bool = False

    def settings(self, config: Any) -> dict[str, Any]:
        """The settings the fitted state depends on (with the index id, they make its id)."""
        return {}

    def persists(self, settings: dict[str, Any]) -> bool:
        """Whether a state fitted with ``settings`` is stored beside the index (``persist_state``)."""
        return self.persist_state

    def fit(self, train: TrainGradients, config: Any, context: FitContext | None = None) -> EngineState:
        """Compute what scoring needs once per index; the default keeps only the gradients."""
        return EngineState(self.name, train)

    @abstractmethod
    def score(self, state: EngineState, query: Mapping[str, Any], config: Any, **context: Any) -> EngineResult:
        """Score every training example against the query; see ``SIGN_CONVENTION``."""


def check_widths(train: TrainGradients, query: dict[str, np.ndarray]) -> None:
    for start, chunk in train.iter_chunks():
        for b, g in chunk.items():
            if g.shape[1] != query[b].shape[1]:
                raise IndexMismatchError(
                    f"block '{b}': training gradients are {g.shape[1]} wide but the query is "
                    f"{query[b].shape[1]}; build both with the same projection settings"
                )
        return


def compute_dtype(array: np.ndarray) -> Any:
    """float64 for float64 data, float32 otherwise (float16 stores are widened chunk by chunk)."""
    return np.float64 if array.dtype == np.float64 else np.float32
