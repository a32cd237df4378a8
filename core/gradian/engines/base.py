"""The engine interface, the gradient containers it reads, and the sign convention.

Interface: an engine is an ``Engine`` subclass with a ``name``, ``fit(train, config, context) ->
EngineState`` (whatever the engine computes once per index: curvature factors, per-checkpoint
data) and ``score(state, query, config, **context) -> EngineResult`` (``[n_train]``, or
``[n_train, n_queries]`` for a query matrix). ``train`` is any ``TrainGradients`` (an
``InMemoryGradients`` or an opened ``GradientIndex``): per-block ``[n, width]`` arrays read chunk
by chunk, plus per-block squared norms. ``query`` is ``{block: [width]}`` or
``{block: [queries, width]}``. ``FitContext`` carries what a fit may need beyond the stored
gradients (passes over the model, per-checkpoint gradients, the run), built by the attribution
lane; engines that need none ignore it.
``settings(config)`` lists the settings a fitted state depends on: with the index id they make
the state's id (``gradian.engines.state``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Protocol, Sequence

import numpy as np

from gradian.chunks import ChunkOutputs, fold, pass_key
from gradian.config.engine_options import read_engine_options
from gradian.errors import ConfigError, IndexMismatchError

if TYPE_CHECKING:
    import numpy.typing as npt

    from gradian.config import EngineConfig, GradsConfig
    from gradian.jsontypes import JsonScalar
    from gradian.runs import RunRecord

__all__ = [
    "SIGN_CONVENTION",
    "CheckpointGradients",
    "CheckpointIndexer",
    "ChosenRows",
    "CollectedFactors",
    "CurvaturePasses",
    "Engine",
    "EngineResult",
    "EngineState",
    "FitContext",
    "InMemoryGradients",
    "TrainGradients",
    "Preconditioned",
    "RELATIF_NOTE",
    "as_query_matrix",
    "check_widths",
    "compute_dtype",
    "chunk_pass",
    "dot_pass",
    "score_jointly",
    "fold",
    "pass_key",
    "row_pass",
    "train_rows",
    "train_widths",
    "gradient_dot",
    "sum_over_checkpoints",
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

    def __init__(self, blocks: Mapping[str, npt.ArrayLike], chunk_size: int = 4096) -> None:
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

    @property
    def widths(self) -> dict[str, int]:
        return {k: int(v.shape[1]) for k, v in self._blocks.items()}

    def rows(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        take = np.asarray(list(indices), dtype=np.int64)
        return {k: v[take] for k, v in self._blocks.items()}


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


def as_query_matrix(query: Mapping[str, npt.ArrayLike], blocks: list[str]) -> tuple[dict[str, np.ndarray], bool]:
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


class CurvaturePasses(Protocol):
    """Passes over the model a curvature fit asks for (``gradian.grads.collectors.ModelPasses``).

    ``layers``: every LoRA matrix (``key``, ``block``, ``offset``, ``out``, ``in``); ``factor_totals``
    returns ``{key: (sum x x^T, sum g g^T, tokens, rows)}`` over the rows (all, or the ``share``
    ``factor_share(engine.factor_rows)`` gives; ``tick(rows)`` after each batch) and ``layer_gradients`` yields ``(rows, {key: G [rows, out, in]})`` per
    batch (over every row, or the ``share`` chosen the same way), both under the training labels
    (``fisher_seed`` None) or labels sampled from the model; ``chosen_rows(share)`` is ``[n]``, true
    for the rows a share chooses."""

    layers: list[dict[str, Any]]

    @property
    def n_examples(self) -> int: ...

    @property
    def block_dims(self) -> dict[str, int]: ...

    def factor_share(self, factor_rows: int | None) -> float: ...

    def factor_totals(self, fisher_seed: int | None = None, draw: int = 0,
                      tick: Callable[[int], None] | None = None,
                      share: float = 1.0) -> dict[str, tuple[np.ndarray, np.ndarray, int, int]]: ...

    def layer_gradients(self, fisher_seed: int | None = None, draw: int = 0,
                        share: float = 1.0) -> Iterator[tuple[int, dict[str, np.ndarray]]]: ...

    def chosen_rows(self, share: float) -> np.ndarray: ...


class CollectedFactors(Protocol):
    """Kronecker sums gathered during an index build (``gradian.grads.collectors.KroneckerCollector``):
    over the ``share`` of the rows it was made with, ``summed_examples`` of them."""

    share: float
    summed_examples: int

    @property
    def sums(self) -> dict[str, tuple[np.ndarray, np.ndarray, int]]: ...

    def complete(self, n: int) -> bool: ...


@dataclass
class CheckpointGradients:
    """One saved checkpoint as an engine sees it: its learning-rate weight, its training
    gradients, and what a fit or a query under it needs.

    ``view`` is the model with the checkpoint's adapter active, opaque here: it is only handed
    back to the caller's ``query_for(view)``. ``passes`` and ``collected`` are the checkpoint's
    own ``FitContext.passes`` / ``collected``."""

    weight: float
    train: TrainGradients
    query: Mapping[str, npt.ArrayLike] | None = None
    label: str = ""
    view: object = None
    passes: CurvaturePasses | None = None
    collected: CollectedFactors | None = None
    #: the checkpoint holds the final adapter's weights, so it reuses the final index and model
    is_final: bool = False


class CheckpointIndexer(Protocol):
    """Indexes the training set under each saved checkpoint (``gradian.attribution.checkpoints``).

    ``index(paths, verb, each, final, collect)`` returns one ``CheckpointGradients`` per path;
    ``each(checkpoint)`` runs while that checkpoint's adapter is active; ``final`` (the final
    adapter's gradients) is reused for a checkpoint with the final adapter's weights;
    ``collect`` gathers Kronecker sums during each index build."""

    def index(self, paths: Sequence[str], verb: str, each: Callable[[CheckpointGradients], None] | None = None,
              final: TrainGradients | None = None, collect: bool = False) -> list[CheckpointGradients]: ...


@dataclass
class FitContext:
    """What a fit may need beyond the stored gradients; every field may be missing.

    Engines never load a model, build an index or install a hook: the attribution lane hands
    them ``passes`` (the passes over the model their curvature needs), ``collected`` (Kronecker
    sums gathered while the index was built) and ``checkpoints`` (the training set indexed under
    each saved checkpoint). ``grads`` is the ``GradsConfig`` of the index, ``run`` the
    ``RunRecord`` (checkpoints, learning rates), ``cache_dir`` where per-checkpoint fits are
    stored, ``progress(done, total)`` a progress callback, ``log(message)`` a log line.
    """

    passes: CurvaturePasses | None = None
    collected: CollectedFactors | None = None
    checkpoints: CheckpointIndexer | None = None
    grads: "GradsConfig | None" = None
    run: "RunRecord | None" = None
    seed: int = 0
    cache_dir: str | None = None
    progress: Callable[[int, int], None] | None = None
    log: Callable[[str], None] | None = None


@dataclass
class EngineState:
    """A fitted engine: its arrays (persisted), a small JSON ``meta`` and the training gradients.

    ``train`` is not persisted: a state is stored beside the index it was fitted on and
    re-attached to it when loaded. ``state_id`` is set once the state is stored;
    ``cache_hit`` says it was loaded rather than fitted.
    """

    engine: str
    train: TrainGradients
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    state_id: str | None = None
    cache_hit: bool = False
    fit_seconds: float = 0.0
    #: objects that live only in memory (models, opened per-checkpoint indexes)
    extra: dict[str, Any] = field(default_factory=dict)
    #: what was wrong with the stored state this one was fitted again to replace, if anything
    repaired: str | None = None


@dataclass
class Preconditioned:
    """An engine's preconditioned query: ``direction`` is ``{block: [queries, width]}`` float64,
    the vector every training gradient is dotted with (``score_j = sum_l <direction_l, g_j^(l)>``);
    ``damping`` what the inverse used (per block or per LoRA matrix), ``notes`` what it did."""

    direction: dict[str, np.ndarray]
    damping: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)


#: appended to an engine's note when its rows are ranked by RelatIF
RELATIF_NOTE = ("; rows ranked by their score divided by the square root of their self-influence "
                "(RelatIF), while the scores themselves stay influence in loss units")


class Engine(ABC):
    """One attribution method, registered by name in ``gradian.config.engines`` (a built-in table
    line, or a ``gradian.engines`` entry point for a third-party engine).

    An engine implements ``precondition`` (the query through its inverse curvature); scoring is
    shared (``score_under``: one pass of inner products with the stored gradients, then RelatIF
    when the engine has a self-influence and is asked to rank by it). An engine that sums over
    checkpoints overrides ``score`` and adds the parts with ``sum_over_checkpoints``.
    """

    name: str = ""
    #: one line for ``--help`` (built-in engines keep it in their table line)
    summary: str = ""
    #: what the method does with curvature: ``none`` (gradient dot products), ``datainf``
    #: (per-example rank-one inverses), ``kronecker`` (Kronecker-factored). Two engines of the same
    #: family with equivalent settings are not an independent cross-check of each other.
    curvature: str = "none"
    #: the cross-check ``--cross-check auto`` picks: an engine that ranks by another method
    default_cross_check: str = "datainf"
    #: the fit reads the model (not only the stored gradients); it then needs ``FitContext.passes``
    needs_model: bool = False
    #: the fit reads every row's squared gradient norm (``TrainGradients.sq_norms``)
    reads_norms: bool = False
    #: the fitted state is worth storing beside the index (it cost a pass over the data)
    persist_state: bool = False

    #: the engine's own settings (a dataclass), read from ``engine.options.<name>``; None: it has none
    Options: ClassVar[type | None] = None

    def options(self, config: EngineConfig | None) -> Any:
        """This engine's ``Options`` as ``config`` sets them (``engine.options.<name>``, every key
        and value checked), its defaults without a config; None for an engine that has none."""
        values = (getattr(config, "options", None) or {}).get(self.name)
        if self.Options is None:
            if values:
                raise ConfigError(f"engine.options.{self.name}.{sorted(values)[0]}: engine '{self.name}' takes no "
                                  "options of its own; remove engine.options."
                                  f"{self.name} (its settings are the engine.* keys)")
            return None
        return read_engine_options(self.Options, values, self.name)

    def settings(self, config: EngineConfig) -> Mapping[str, object]:
        """The settings the fitted state depends on (with the index id, they make its id): the
        engine's options by default."""
        chosen = self.options(config)
        return {"options": dataclasses.asdict(chosen)} if chosen is not None else {}

    def persists(self, settings: Mapping[str, object]) -> bool:
        """Whether a state fitted with ``settings`` is stored beside the index (``persist_state``)."""
        return self.persist_state

    def damping_setting(self, config: EngineConfig) -> tuple[str, float | None, str] | None:
        """``(config key, value, how to change it)`` of the damping this engine's inverse adds, or
        None for an engine without curvature: what a message about overflowing scores names."""
        if self.curvature == "none":
            return None
        if getattr(config, "lambda_override", None) is not None:
            return "engine.lambda_override", config.lambda_override, "raise it, or remove it to damp by engine.lambda_scale"
        return "engine.lambda_scale", getattr(config, "lambda_scale", None), "raise it (0.1 is the default)"

    def describe(self, config: EngineConfig, state: EngineState | None = None) -> dict[str, JsonScalar]:
        """The settings a run of this engine is known by, as flat name -> value (a tracking store
        logs them as parameters): the damping for an engine with curvature, plus what the engine
        adds (``fisher``, ``ranking``, ``checkpoints`` for the Kronecker family)."""
        chosen = self.options(config)
        own: dict[str, JsonScalar] = {} if chosen is None else {
            f"options.{k}": v for k, v in dataclasses.asdict(chosen).items() if isinstance(v, (str, int, float, bool))}
        setting = self.damping_setting(config)
        if setting is None:
            return own
        key, value, _ = setting
        return {"damping": value, "damping_kind": "absolute" if key == "engine.lambda_override" else "scale", **own}

    def fit(self, train: TrainGradients, config: EngineConfig, context: FitContext | None = None) -> EngineState:
        """Compute what scoring needs once per index; the default keeps only the gradients."""
        return EngineState(self.name, train)

    def precondition(self, state: EngineState, query: dict[str, np.ndarray], config: EngineConfig) -> Preconditioned:
        """``query`` (``{block: [queries, width]}`` float64) through the engine's inverse curvature.
        The default is no curvature: the query itself."""
        return Preconditioned(dict(query))

    def ranks_by_self_influence(self, config: EngineConfig) -> bool:
        """Whether rows are ranked by RelatIF (``score / sqrt(self-influence)``) under ``config``."""
        return False

    def self_influence(self, state: EngineState, pre: Preconditioned) -> np.ndarray:
        """``g_j^T H^-1 g_j`` of every training row ``[n]``, under the damping ``pre`` used: one pass
        of ``self_influence_rows`` by default."""
        own_rows = self.self_influence_rows(state, pre)
        if own_rows is None:
            raise NotImplementedError(f"engine '{self.name}' has no self-influence")
        return row_pass(state.train, own_rows, "self-influence", self.self_influence_inputs(state, pre))

    def self_influence_inputs(self, state: EngineState, pre: Preconditioned) -> dict[str, object]:
        """What the self-influence of a row depends on besides the row (the fitted state and the
        damping), for a resumable pass's key: the state's id and the damping by default."""
        out: dict[str, object] = {"engine": self.name,
                                  "damping": sorted(pre.damping.items()) if isinstance(pre.damping, dict) else repr(pre.damping)}
        if state.state_id:
            out["state"] = state.state_id
        else:  # a state kept in memory only: what it holds
            out.update({f"state.{k}": np.asarray(v) for k, v in state.arrays.items()})
        return out

    def self_influence_rows(self, state: EngineState,
                            pre: Preconditioned) -> Callable[[dict[str, np.ndarray]], np.ndarray] | None:
        """A function of one chunk ``{block: [rows, width]}`` giving its rows' self-influence
        ``[rows]``, so the scoring pass computes it while each row's gradient is at hand (a stream
        makes no second pass for it); None for an engine without one."""
        return None

    def score_under(self, state: EngineState, query: Mapping[str, npt.ArrayLike],
                    config: EngineConfig) -> EngineResult:
        """Score every training row of ``state`` against ``query``: the shared inner products with
        the preconditioned query, and the RelatIF ranking when the engine ranks by it."""
        return score_jointly([(self, state, query, config)])[0]

    def score(self, state: EngineState, query: Mapping[str, npt.ArrayLike], config: EngineConfig,
              **context: Any) -> EngineResult:
        """Score every training example against the query; see ``SIGN_CONVENTION``."""
        return self.score_under(state, query, config)

    def fit_passes_over_gradients(self, config: EngineConfig, grads: GradsConfig | None) -> bool:
        """Whether ``fit`` under ``config`` makes a pass over the training gradients themselves (a
        stream then keeps every row's squared norm in that pass, so an engine that reads them
        later needs no pass of its own for them). The default fit reads nothing."""
        return False

    @classmethod
    def shared_scoring(cls) -> bool:
        """Whether the engine scores the final adapter by the shared scoring alone (``score_under``),
        so that ``score_jointly`` may make its inner products in one pass with another engine's. An
        engine that overrides ``score`` (its own method) says False unless it scores the final
        adapter by ``score_under`` anyway. ``gradian plan`` prices the passes by it."""
        return cls.score is Engine.score

    def scores_jointly(self, state: EngineState) -> bool:
        """``shared_scoring`` for this fitted ``state`` (a state over checkpoints may be scored otherwise)."""
        return self.shared_scoring()


def score_jointly(jobs: Sequence[tuple[Engine, EngineState, Mapping[str, npt.ArrayLike], EngineConfig]]
                  ) -> list[EngineResult]:
    """``engine.score_under(state, query, config)`` for each job, with the inner products of every
    job (and each self-influence a RelatIF ranking needs) in one pass over their training gradients,
    which every job's state must share: a stream then recomputes each row's gradient once for all
    of them, where scoring them one after another would make a pass each. Each engine preconditions
    its query first (a pass of its own where its method needs one, as DataInf's does). The numbers
    are the ones each engine's own scoring pass gives, to the rounding of the products (the columns
    of one matrix product instead of several)."""
    if not jobs:
        return []
    train = jobs[0][1].train
    if any(state.train is not train for _, state, _, _ in jobs):
        raise ValueError("score_jointly: every state must be fitted on the same training gradients")
    prepared = []
    for engine, state, query, config in jobs:
        q, single = as_query_matrix(query, train.block_names)
        check_widths(train, q)
        pre = engine.precondition(state, q, config)
        relatif = engine.ranks_by_self_influence(config)
        own_rows = engine.self_influence_rows(state, pre) if relatif else None
        prepared.append((engine, state, pre, single, relatif, own_rows))
    # one direction of [all queries, width] per block: each job's queries in turn
    direction = {b: np.concatenate([pre.direction[b] for _, _, pre, _, _, _ in prepared], axis=0)
                 for b in train.block_names}
    # the self-influences are computed in the scoring pass itself, while each row's gradient exists
    own_rows_of = {j: job[5] for j, job in enumerate(prepared) if job[5] is not None}
    owns = list(own_rows_of)
    also = None
    also_inputs: dict[str, object] = {}
    if owns:
        def also(chunk: dict[str, np.ndarray]) -> np.ndarray:
            values = [np.asarray(rows_of(chunk), dtype=np.float64) for rows_of in own_rows_of.values()]
            return values[0] if len(values) == 1 else np.stack(values, axis=1)

        for j in owns:  # one job's keys as they are, so its pass keeps the key of scoring it alone
            inputs = prepared[j][0].self_influence_inputs(prepared[j][1], prepared[j][2])
            also_inputs.update(inputs if len(owns) == 1 else {f"{j}.{k}": v for k, v in inputs.items()})
    scores_all, own_all = dot_pass(train, direction, also, also_inputs)
    results = []
    first = 0
    for j, (engine, state, pre, single, relatif, own_rows) in enumerate(prepared):
        width = next(iter(pre.direction.values())).shape[0]
        scores = np.ascontiguousarray(scores_all[:, first: first + width])
        first += width
        notes = list(pre.notes)
        ranking = None
        if relatif:
            if own_all is not None and j in owns:
                own = own_all if len(owns) == 1 else own_all[:, owns.index(j)]
            else:
                own = engine.self_influence(state, pre)
            ranking = scores / np.sqrt(np.where(own > 0, own, np.inf))[:, None]
            if notes:
                notes[0] += RELATIF_NOTE
        results.append(EngineResult(engine.name, scores[:, 0] if single else scores, notes=notes, damping=pre.damping,
                                    ranking=None if ranking is None else (ranking[:, 0] if single else ranking)))
    return results


def sum_over_checkpoints(parts: Sequence[tuple[float, EngineResult]]) -> tuple[np.ndarray, np.ndarray | None]:
    """``(sum_c w_c scores_c, sum_c w_c ranking_c)`` over per-checkpoint results (the ranking sum
    None when no part ranks by anything but its scores): the checkpoint sum every engine shares."""
    total: np.ndarray | None = None
    ranked: np.ndarray | None = None
    for weight, part in parts:
        scores = weight * np.asarray(part.scores, dtype=np.float64)
        total = scores if total is None else total + scores
        if part.ranking is not None:
            rank = weight * np.asarray(part.ranking, dtype=np.float64)
            ranked = rank if ranked is None else ranked + rank
    if total is None:
        raise ValueError("no checkpoint to sum over")
    return total, ranked


def train_widths(train: TrainGradients) -> dict[str, int]:
    """``{block: stored width}``: from the container's ``widths`` when it has them (an index, a
    stream, arrays in memory), else from its first chunk."""
    known = getattr(train, "widths", None)
    if isinstance(known, Mapping):
        return {str(b): int(w) for b, w in known.items()}
    for _, chunk in train.iter_chunks():
        return {b: int(v.shape[1]) for b, v in chunk.items()}
    return {}


def train_rows(train: TrainGradients, indices: Sequence[int]) -> dict[str, np.ndarray]:
    """``{block: [len(indices), width]}`` of some training rows, in the order asked: through the
    container's ``rows`` when it has one (a stream then computes only those rows' batches), else
    picked out of a pass over its chunks."""
    fetch = getattr(train, "rows", None)
    if callable(fetch):
        return dict(fetch(indices))
    wanted = np.asarray(list(indices), dtype=np.int64)
    out: dict[str, np.ndarray] = {}
    for start, chunk in train.iter_chunks():
        size = len(next(iter(chunk.values())))
        slots = np.flatnonzero((wanted >= start) & (wanted < start + size))
        for b, g in chunk.items():
            if b not in out:
                out[b] = np.zeros((len(wanted), g.shape[1]), dtype=g.dtype)
            out[b][slots] = g[wanted[slots] - start]
    missing = wanted[(wanted < 0) | (wanted >= train.n)]
    if len(missing):
        raise IndexError(f"row {int(missing[0])} is not in the training gradients ({train.n} rows)")
    return out


def check_widths(train: TrainGradients, query: dict[str, np.ndarray]) -> None:
    for b, width in train_widths(train).items():
        if b in query and width != query[b].shape[1]:
            raise IndexMismatchError(
                f"block '{b}': training gradients are {width} wide but the query is "
                f"{query[b].shape[1]}; build both with the same projection settings"
            )


def compute_dtype(array: np.ndarray) -> type[np.float64] | type[np.float32]:
    """float64 for float64 data, float32 otherwise (float16 stores are widened chunk by chunk)."""
    return np.float64 if array.dtype == np.float64 else np.float32


def gradient_dot(train: TrainGradients, query: Mapping[str, npt.ArrayLike],
                 normalize_query: bool = False) -> tuple[np.ndarray, bool]:
    """``[n, queries]`` dot products of every training gradient with every query, and ``single``."""
    blocks = train.block_names
    q, single = as_query_matrix(query, blocks)
    check_widths(train, q)
    if normalize_query:
        total = np.sqrt(sum((v ** 2).sum(axis=1) for v in q.values()))
        q = {b: v / np.maximum(total, 1e-300)[:, None] for b, v in q.items()}
    return dot_pass(train, q)[0], single


def _gathered(n: int, parts: Sequence[tuple[int, np.ndarray]]) -> np.ndarray:
    """``[n]`` float64 from per-chunk ``(start, values)``."""
    out = np.zeros(n, dtype=np.float64)
    for start, part in parts:
        out[start: start + len(part)] = part
    return out


@dataclass(frozen=True)
class ChosenRows:
    """A share of the training rows a pass folds alone (``engine.correction_rows``): ``share`` as
    ``gradian.grads.collectors.factor_share`` gives it, ``mask`` ``[n]`` true for the rows its hash
    chooses (``CurvaturePasses.chosen_rows``)."""

    share: float
    mask: np.ndarray

    @property
    def count(self) -> int:
        return int(np.count_nonzero(self.mask))

    def restrict(self, of_chunk: Callable[[int, dict[str, np.ndarray]], ChunkOutputs]
                 ) -> Callable[[int, dict[str, np.ndarray]], ChunkOutputs]:
        """``of_chunk`` shown only the chosen rows of each chunk (in order; possibly none)."""
        def chosen(start: int, chunk: dict[str, np.ndarray]) -> ChunkOutputs:
            size = next(iter(chunk.values())).shape[0]
            keep = self.mask[start: start + size]
            return of_chunk(start, {b: v[keep] for b, v in chunk.items()})

        return chosen


def chunk_pass(train: TrainGradients, name: str, inputs: Mapping[str, object],
               of_chunk: Callable[[int, dict[str, np.ndarray]], ChunkOutputs], *, rows: Sequence[str] = (),
               sums: Sequence[str] = (), chosen: ChosenRows | None = None) -> ChunkOutputs:
    """One pass over ``train`` folding ``of_chunk`` (see ``fold``). A container that recomputes its
    gradients (a stream) offers ``fold_chunks(key, of_chunk, rows=, sums=, chosen=)`` and gets the
    pass's content key (``pass_key(name, inputs)``), so it can keep each chunk's result and resume
    an interrupted pass where it stopped; anything else is folded here, chunk by chunk.

    ``chosen``: ``of_chunk`` sees only those rows (a pass of sums alone; a stream then computes just
    them, unless it still has every row's squared norm to keep)."""
    if chosen is not None and rows:
        raise ValueError("a pass over a share of the rows folds sums only: its per-row outputs would not line up")
    folder = getattr(train, "fold_chunks", None)
    if callable(folder):
        extra: dict[str, object] = {} if chosen is None else {"chosen": chosen}
        key = pass_key(name, inputs if chosen is None else {**inputs, "chosen_share": chosen.share})
        return dict(folder(key, of_chunk, rows=tuple(rows), sums=tuple(sums), **extra))
    return fold(train.iter_chunks(), train.n, of_chunk if chosen is None else chosen.restrict(of_chunk), rows, sums)


def _inputs_of(direction: Mapping[str, np.ndarray]) -> dict[str, object]:
    return {f"direction.{b}": np.asarray(v) for b, v in direction.items()}


def row_pass(train: TrainGradients, of_chunk: Callable[[dict[str, np.ndarray]], np.ndarray],
             name: str = "rows", inputs: Mapping[str, object] | None = None) -> np.ndarray:
    """``[n]``: ``of_chunk`` (one value per row of a chunk) over every chunk of one pass; ``name``
    and ``inputs`` identify the pass to a resumable container (see ``chunk_pass``)."""
    if inputs is None:
        return _gathered(train.n, [(start, of_chunk(chunk)) for start, chunk in train.iter_chunks()])
    out = chunk_pass(train, name, inputs, lambda start, chunk: {"rows": np.asarray(of_chunk(chunk), dtype=np.float64)},
                     rows=("rows",))
    return out.get("rows", np.zeros(train.n, dtype=np.float64))


def dot_pass(train: TrainGradients, direction: Mapping[str, np.ndarray],
             also: Callable[[dict[str, np.ndarray]], np.ndarray] | None = None,
             also_inputs: Mapping[str, object] | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``([n, queries], [n] or None)``: ``sum_l <direction_l, g_j^(l)>`` for every row, in one pass
    over ``train`` (``direction`` is ``{block: [queries, width]}``), and ``also`` (one value per row
    of a chunk, e.g. the self-influence) computed in the same pass while the gradients are at hand.
    ``also_inputs`` is what ``also`` depends on, so a resumable container keys the pass by it."""
    blocks = train.block_names
    queries = next(iter(direction.values())).shape[0]

    def of_chunk(start: int, chunk: dict[str, np.ndarray]) -> ChunkOutputs:
        size = next(iter(chunk.values())).shape[0]
        scores = np.zeros((size, queries), dtype=np.float64)
        for b in blocks:
            g = chunk[b]
            dt = compute_dtype(g)
            scores += g.astype(dt, copy=False) @ direction[b].T.astype(dt)
        part = {"scores": scores}
        if also is not None:
            part["also"] = np.asarray(also(chunk), dtype=np.float64)
        return part

    inputs = {**_inputs_of(direction), **{f"also.{k}": v for k, v in (also_inputs or {}).items()},
              "also": also is not None}
    out = chunk_pass(train, "scores", inputs, of_chunk, rows=("scores", "also") if also is not None else ("scores",))
    scores = out.get("scores", np.zeros((train.n, queries), dtype=np.float64))
    return scores, (out.get("also", np.zeros(train.n)) if also is not None else None)
