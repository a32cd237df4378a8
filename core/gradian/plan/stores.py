"""What each store of the training gradients costs, and what a Kronecker engine's curvature costs.

Interface: ``engine_passes(engine, ...) -> Passes`` counts the passes over the training set one
fit and one scoring make; ``auto_store(...)`` is the choice ``engine.store: auto`` makes (the rule
of ``gradian.index.stream.choose_store``, computed from sizes, no model loaded);
``curvature_cost(linears, ...)`` the bytes of a Kronecker engine's factors and fitted state.

Passes, as the engines make them (``tests/test_plan.py`` counts them on a real run):

- ``first``: the pass that captures every row before the fit reads them: it keeps the squared
  norms and, under a Kronecker engine, gathers the Kronecker factors (``GradientStream.prime``
  inside a ``KroneckerCollector``). Under the index it is the build itself. Engines that need
  neither (the curvature-free ones) make none: their scoring pass is their only one.
- ``model``: the fit's own passes over the model (``ModelPasses``): under a sampled Fisher one
  pass per draw for the factors, and for EK-FAC one per draw for the eigenvalue correction, which
  is also recomputed from the model (one pass) when ``grads.normalization`` changes the stored
  gradients. The same under either store.
- ``gradients``: passes over the training gradients (``iter_chunks``): EK-FAC's eigenvalue
  correction when the stored gradients are the Fisher's (empirical, no normalization), DataInf's
  preconditioner, and the scoring pass (the RelatIF self-influence is computed inside it). The
  index reads them; a stream recomputes them.

So under ``stream`` a fit and one scoring make ``first + model + gradients`` forward and backward
passes over the data; under ``index`` ``1 + model`` (the build and the fit's own) and
``gradients`` reads of the index. EK-FAC (empirical Fisher): 3 under stream, 1 and 2 reads under
the index; K-FAC: 2, 1 and 1 read; DataInf: 3, 1 and 2 reads; gradient dot products: 1, 1 and 1
read. A cached fit makes only the scoring pass; ``engine.checkpoints: all`` repeats the fit and
the scoring under each checkpoint, and TracIn scores once per checkpoint (counted here as one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from gradian.index.sizing import store_rule
from gradian.plan.shapes import LoraLinear
from gradian.sizes import GIB

__all__ = ["Passes", "IndexCost", "StreamCost", "CurvatureCost", "engine_passes", "auto_store", "curvature_cost",
           "lora_matrices", "GIB"]



@dataclass(frozen=True)
class Passes:
    """Passes over the training set of one fit and one scoring by ``engine`` (module doc)."""

    engine: str
    first: int
    model: int
    gradients: int
    #: what each pass is for, in the order a stream makes them
    names: tuple[str, ...] = ()
    #: the gradients were captured already by another engine's passes (a cross-check): no build
    primed: bool = False
    #: ``engine.factor_rows`` as a share of the rows (``gradian.grads.collectors.factor_share``; 1:
    #: every row): the passes that only sum the Kronecker factors run over that share
    factor_share: float = 1.0
    #: of the passes, those over the factor share alone (the same count under either store: the
    #: stream's factors-only first pass is the index's extra pass, ``index_own``)
    share_passes: int = 0
    #: captures the index makes beyond the build and ``model``: the fit's own pass over the factor
    #: share, which the build cannot sum (its batches mix chosen and other rows)
    index_own: int = 0
    #: ``engine.correction_rows`` as a share of the rows (1: every row): the eigenvalue correction
    #: averages over that share
    correction_share: float = 1.0
    #: of the stream's passes, those over the correction share alone: the correction's pass, unless
    #: it keeps every row's squared norm for a DataInf cross-check (then it computes every row)
    correction_passes: int = 0
    #: of the index's captures, those over the correction share (a correction recomputed from the
    #: model); one over the stored gradients reads the index instead
    correction_index_passes: int = 0

    @property
    def stream(self) -> int:
        """Forward and backward passes under ``engine.store: stream``."""
        return self.first + self.model + self.gradients

    @property
    def index_captures(self) -> int:
        """Forward and backward passes under ``engine.store: index``: the build and the fit's own."""
        return (0 if self.primed else 1) + self.model + self.index_own

    @property
    def stream_floors(self) -> float:
        """The stream's passes in passes over every row: those over the factor share count as that share."""
        return (self.stream - self.share_passes * (1.0 - self.factor_share)
                - self.correction_passes * (1.0 - self.correction_share))

    @property
    def index_floors(self) -> float:
        """The index's captures in passes over every row (``stream_floors``)."""
        return (self.index_captures - self.share_passes * (1.0 - self.factor_share)
                - self.correction_index_passes * (1.0 - self.correction_share))

    def share_note(self, store: str = "stream") -> str:
        """``" (1 over about 25% of the rows: engine.factor_rows)"``, or ``""`` when every pass reads
        every row; the passes over ``engine.correction_rows``'s share under ``store`` too."""
        parts = []
        if self.share_passes and self.factor_share < 1.0:
            parts.append(f"{self.share_passes} over about {self.factor_share:.0%} of the rows: engine.factor_rows")
        over = self.correction_passes if store == "stream" else self.correction_index_passes
        if over and self.correction_share < 1.0:
            parts.append(f"{over} over about {self.correction_share:.0%} of the rows: engine.correction_rows")
        return f" ({'; '.join(parts)})" if parts else ""

    @property
    def index_reads(self) -> int:
        """Passes that read the index."""
        return self.gradients

    def what(self) -> str:
        """The passes in words (``Kronecker factors, eigenvalue correction and squared norms, scoring``)."""
        return ", ".join(self.names)


@dataclass(frozen=True)
class IndexCost:
    """``engine.store: index``: the gradients written once, read by every later pass."""

    #: the chunk files on disk (data, float64 norms, npy headers)
    disk_bytes: int
    #: ``n x stored width x storage bytes``: what ``engine.store: auto`` compares with its limits
    data_bytes: int
    #: host memory of the writer's chunk buffer
    host_buffer: int
    #: forward and backward passes: the build and the fit's own
    captures: int
    #: passes that read the index
    reads: int
    #: ``captures`` in passes over every row (``Passes.index_floors``)
    capture_floors: float = 0.0


@dataclass(frozen=True)
class StreamCost:
    """``engine.store: stream``: nothing written, the gradients recomputed in each pass."""

    #: forward and backward passes over the data
    passes: int
    #: host memory of the chunk in flight
    host_buffer: int
    #: ``passes`` in passes over every row (``Passes.stream_floors``)
    floors: float = 0.0


@dataclass(frozen=True)
class CurvatureCost:
    """What a Kronecker engine's curvature costs (zero for the other engines).

    ``F = 8 sum (in^2 + out^2)`` over every LoRA matrix (A is ``(r, in)``, B ``(out, r)``): the
    float64 ``sum x x^T`` and ``sum g g^T`` the ``KroneckerCollector`` adds up on the capture
    device from the first pass on, and keeps for the run. The fit copies them to the host and adds
    their eigenbases of the same size, and each eigendecomposition works on a few copies of its
    factor (the scaled factor, its symmetrized copy, the eigenvectors, LAPACK's workspace): ``2F +
    5 x 8 m^2`` on the host, ``m`` the widest factor's side. The stored state is the eigenbases
    and the (corrected) eigenvalues, ``F + 8 D`` with ``D`` the values per example, on the disk of
    ``cache_dir`` whichever store produced it. Measured on a CPU fit (2 layers, hidden 512,
    intermediate 2048, seven sites): the collector held ``F`` exactly, the stored arrays were
    ``F + 8 D`` exactly, and the fit's peak above the start was 3.66 F against ``F + 2F + 5 x 8
    m^2 = 3.69 F`` predicted.
    """

    factor_bytes: int = 0
    device: int = 0
    host: int = 0
    state_bytes: int = 0
    #: the fit's eigendecompositions: how many (two per LoRA matrix), the widest side, and the sum
    #: of every side cubed, which their time follows (``gradian.plan.timing.calibrate_eigh``)
    eigh_count: int = 0
    eigh_widest: int = 0
    eigh_cubes: int = 0


def _kronecker(engine: str) -> tuple[bool, bool, str]:
    """``(Kronecker family, corrects its eigenvalues, curvature family)`` of a registered engine."""
    from gradian.engines.registry import engine_class

    cls = engine_class(engine)
    curvature = str(getattr(cls, "curvature", "none"))
    return curvature == "kronecker", bool(getattr(cls, "correct_eigenvalues", False)), curvature


def engine_passes(engine: str, fisher: str = "empirical", fisher_samples: int = 1, normalization: str = "none",
                  primed: bool = False, shared_scoring: bool = False, factor_share: float = 1.0,
                  correction_share: float = 1.0, norms_wanted: bool = False) -> Passes:
    """The passes of one fit and one scoring by ``engine`` (see the module doc). ``primed``: the
    first pass was made already (a cross-check after a Kronecker engine on the same stream);
    ``shared_scoring``: its scoring is made in another engine's scoring pass (a cross-check both of
    whose engines have ``Engine.shared_scoring``), so it makes none of its own; ``factor_share``:
    ``engine.factor_rows`` as a share of the rows, the Kronecker factors summed over that share;
    ``correction_share``: ``engine.correction_rows``'s, the eigenvalue correction averaged over
    that share; ``norms_wanted``: a cross-check reads every row's squared norm (DataInf), which a
    stream's eigenvalue correction then keeps, computing every row."""
    passes = _engine_passes(engine, fisher, fisher_samples, normalization, primed, factor_share, correction_share,
                            norms_wanted)
    if not shared_scoring:
        return passes
    names = tuple(name for name in passes.names if name != "scoring")
    return replace(passes, gradients=passes.gradients - 1, names=names)


def _engine_passes(engine: str, fisher: str, fisher_samples: int, normalization: str, primed: bool,
                   share: float = 1.0, correction_share: float = 1.0, norms_wanted: bool = False) -> Passes:
    kronecker, corrects, curvature = _kronecker(engine)
    if kronecker:
        sampled = fisher in ("sampled", "true")
        draws = max(1, int(fisher_samples)) if sampled else 1
        recompute = sampled or normalization != "none"  # the stored gradients are not the Fisher's
        model = (draws if sampled else 0) + (draws if corrects and recompute else 0)
        gradients = 1 + (1 if corrects and not recompute else 0)
        # over a stream the squared norms (for a DataInf cross-check) come with the first pass that
        # forms per-example gradients: the eigenvalue correction over them when there is one
        in_correction = corrects and not recompute
        names = ([] if primed else ["Kronecker factors" if in_correction else "squared norms and Kronecker factors"])
        if sampled:
            names.append(f"sampled-Fisher factors ({draws} pass{'es' if draws > 1 else ''})")
        if corrects:
            names.append(f"eigenvalue correction, recomputed ({draws} pass{'es' if draws > 1 else ''})" if recompute
                         else "eigenvalue correction and squared norms")
        passes = Passes(engine, 0 if primed else 1, model, gradients, tuple(names + ["scoring"]), primed)
        if corrects and correction_share < 1.0:
            # recomputed from the model: over the share in either store; over the gradients: the index
            # reads them, a stream computes the share unless it keeps every row's norm for DataInf
            over = draws if recompute else (0 if norms_wanted else 1)
            passes = replace(passes, correction_share=correction_share, correction_passes=over,
                             correction_index_passes=draws if recompute else 0)
        return passes if share >= 1.0 else _over_share(passes, share, sampled, draws, in_correction)
    if curvature == "datainf":  # the squared norms, the preconditioner, the scoring
        return Passes(engine, 0 if primed else 1, 0, 2,
                      tuple(([] if primed else ["squared norms"]) + ["preconditioner", "scoring"]), primed)
    return Passes(engine, 0, 0, 1, ("scoring",), primed)


def _over_share(passes: Passes, share: float, sampled: bool, draws: int, in_correction: bool) -> Passes:
    """A Kronecker engine's ``passes`` with its factors summed over ``share`` of the rows
    (``engine.factor_rows``), as ``gradian.index.stream.capture_training_gradients`` and the fit
    make them. With the empirical Fisher and a factors-only first pass (``in_correction``: no
    per-example gradient is formed before the eigenvalue correction) a stream's first pass runs over
    the share alone, while the index build, whose batches mix chosen and other rows, sums nothing
    and the fit adds a pass of its own over the share. Otherwise the first pass, which would also
    keep the squared norms, is not made (the norms come with the first pass over per-example
    gradients): a sampled Fisher's factor passes run over the share, and the empirical Fisher's
    factors are summed by a pass of the fit's own over it."""
    if passes.primed:
        return passes
    if in_correction:
        return replace(passes, factor_share=share, share_passes=1, index_own=1)
    names = tuple(name for name in passes.names if name != "squared norms and Kronecker factors")
    if sampled:
        return replace(passes, factor_share=share, first=0, names=names, share_passes=draws)
    return replace(passes, factor_share=share, first=0, model=passes.model + 1, names=("Kronecker factors", *names),
                   share_passes=1)


def auto_store(data_bytes: int, max_index_gb: float | None, disk: int | None) -> tuple[str, str]:
    """``(store, reason)`` that ``engine.store: auto`` picks for an index of ``data_bytes``: the run's
    own rule (``gradian.index.sizing.store_rule``), with the budget ``disk`` standing for the free
    disk of ``cache_dir`` (None: assumed to hold it). An index stored already is always read; a
    plan cannot know that."""
    return store_rule(data_bytes, max_index_gb, disk, disk="the disk budget")


def lora_matrices(linears: Sequence[LoraLinear], projection_dim: int | None = None,
                  projection_kind: str = "countsketch") -> list[tuple[int, int]]:
    """``(out, in)`` of every LoRA matrix the curvature is fitted over: A ``(r, in)`` and B ``(out,
    r)`` of each module, each side at most ``projection_dim`` under a ``kronecker`` projection."""
    out = []
    for lin in linears:
        for o, i in ((lin.r, lin.in_features), (lin.out_features, lin.r)):
            if projection_dim and projection_kind == "kronecker":
                o, i = min(o, projection_dim), min(i, projection_dim)
            out.append((o, i))
    return out


def curvature_cost(engine: str, linears: Sequence[LoraLinear], projection_dim: int | None = None,
                   projection_kind: str = "countsketch") -> CurvatureCost:
    """The bytes of ``engine``'s Kronecker factors and fitted state (``CurvatureCost``); zero
    for an engine without Kronecker curvature."""
    if not _kronecker(engine)[0]:
        return CurvatureCost()
    matrices = lora_matrices(linears, projection_dim, projection_kind)
    factors = 8 * sum(i * i + o * o for o, i in matrices)
    values = 8 * sum(o * i for o, i in matrices)
    widest = max((max(o, i) for o, i in matrices), default=0)
    return CurvatureCost(factor_bytes=factors, device=factors, host=2 * factors + 5 * 8 * widest * widest,
                         state_bytes=factors + values, eigh_count=2 * len(matrices), eigh_widest=widest,
                         eigh_cubes=sum(i**3 + o**3 for o, i in matrices))
