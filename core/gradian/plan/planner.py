"""One plan: a settings set priced over every batch of the dataset, and the settings that fit.

Interface: ``make_plan(model, adapter, dataset, settings, budgets) -> Plan``: the predicted peak
memory of the worst batch on the device and on the host, both stores of the training gradients
priced (the index: its bytes on disk, the writer's buffer, one capture pass and then reads; the
stream: nothing on disk, a chunk in flight, the engine's passes recomputed), the store the run
would use (``engine.store``; ``auto`` decided as ``gradian.index.stream.choose_store`` decides,
with the disk budget standing for the free disk), a Kronecker engine's factors and fitted state,
whether it all fits the budgets, and a ``Proposal`` of settings that do (``propose_settings``;
under EK-FAC and K-FAC it projects the Kronecker factors, ``grads.projection_kind: kronecker``,
before it cuts layers, and quantizes a base whose weights are what does not fit). Under ``engine.name: replay`` the plan carries the replay of the run's
recipe, priced by ``gradian.plan.replay``, and its memory is part of what must fit.
``parse_size("24GiB")`` reads a budget. Pure functions of shapes and numbers: nothing is loaded
and nothing is printed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from gradian.errors import ConfigError
from gradian.sizes import format_size, parse_size
from gradian.plan.memory import CaptureSettings, MemoryEstimate, block_widths, estimate_memory, index_bytes
from gradian.plan.shapes import DTYPE_BYTES, AdapterShape, BatchShape, DatasetShape, LoraLinear, ModelShape, lora_linears
from gradian.plan.stores import (GIB, CurvatureCost, IndexCost, Passes, StreamCost, auto_store, curvature_cost,
                                 engine_passes, lora_matrices)

if TYPE_CHECKING:
    from gradian.config import GradianConfig
    from gradian.plan.replay import ReplayCost

    #: a setting under its config key, as ``PlanSettings.config_values`` gives it
    ConfigValue = str | int | float | None
    #: per ``(batch_size, max_seq_length)``: the worst batch of each row count
    _BatchCache = dict[tuple[int, int | None], dict[int, BatchShape]]

__all__ = ["PlanSettings", "Budgets", "Plan", "Priced", "Proposal", "make_plan", "propose_settings", "parse_size",
           "format_size", "HEADROOM", "HOST_SHARE", "STORES", "KRONECKER_FLOOR", "kronecker_widths"]

#: share of a memory budget a proposal may fill: allocator fragmentation and the framework's own
#: buffers (a CUDA context, kernels' workspaces) are not in the formulas
HEADROOM = 0.9

#: share of the host memory a proposal leaves to the chunk buffer (the index writer's, or a
#: stream's chunk in flight) when the memory does not fit: the rest is the process's own
HOST_SHARE = 0.25

#: the values of ``engine.store``
STORES = ("auto", "index", "stream")

#: the narrowest ``grads.projection_dim`` a proposal gives ``grads.projection_kind: kronecker``
#: (the floor the run's own automatic projection keeps, ``gradian.index.sizing``): below it a
#: layer cut is proposed instead
KRONECKER_FLOOR = 256

#: the share of the memory budget the base's weights must exceed before a proposal quantizes them
QUANTIZE_SHARE = 0.5

#: where the error of a quantized base's gradients is measured
QUANTIZATION_VALIDATION = 'docs/validation.md, "A quantized base at attribution"'

#: where the accuracy of ``grads.projection_kind: kronecker`` by width is measured
KRONECKER_VALIDATION = 'docs/validation.md, "A compact index that keeps the curvature"'

@dataclass(frozen=True)
class PlanSettings:
    """The settings a plan prices: what the capture, the store and the engine will be run with."""

    batch_size: int = 4
    max_seq_length: int | None = 1024
    module_filter: str | None = None
    projection_dim: int | None = None
    storage_dtype: str = "float32"
    chunk_size: int = 256
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    device: str = "cpu"
    #: the attribution engine; EK-FAC and K-FAC need the full per-example gradients, no projection
    engine: str = "ekfac"
    #: ``engine.store``: auto, index or stream
    store: str = "auto"
    #: ``grads.max_index_gb``: the largest index ``auto`` writes (None: no limit)
    max_index_gb: float | None = 100.0
    #: ``engine.fisher`` and ``engine.fisher_samples``: a sampled Fisher makes passes of its own
    fisher: str = "empirical"
    fisher_samples: int = 1
    #: ``engine.factor_rows``: the Kronecker factors summed over about this many rows (None: every row)
    factor_rows: int | None = None
    #: ``engine.correction_rows``: ekfac's eigenvalue correction averaged over about this many rows
    correction_rows: int | None = None
    #: the cross-check ``gradian attribute`` runs beside the engine (``auto``: the engine's own)
    cross_check: str | None = "auto"

    @classmethod
    def from_config(cls, config: GradianConfig, device: str) -> "PlanSettings":
        """From a ``GradianConfig``; ``dtype: auto`` is bfloat16 on CUDA and float32 elsewhere."""
        grads = config.grads
        dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
        capture = CaptureSettings(dtype=dtype, attn_implementation=config.attn_implementation,
                                  projection_dim=grads.projection_dim, projection_kind=grads.projection_kind,
                                  normalization=grads.normalization, storage_dtype=grads.storage_dtype,
                                  chunk_size=grads.chunk_size, block_granularity=grads.block_granularity,
                                  quantization=config.quantization)
        engine = config.engine
        return cls(batch_size=grads.batch_size, max_seq_length=grads.max_seq_length, module_filter=grads.module_filter,
                   projection_dim=grads.projection_dim, storage_dtype=grads.storage_dtype, chunk_size=grads.chunk_size,
                   capture=capture, device=device, engine=engine.name, store=getattr(engine, "store", "auto"),
                   max_index_gb=grads.max_index_gb, fisher=getattr(engine, "fisher", "empirical"),
                   fisher_samples=int(getattr(engine, "fisher_samples", 1)),
                   factor_rows=getattr(engine, "factor_rows", None),
                   correction_rows=getattr(engine, "correction_rows", None))

    @property
    def projection_kind(self) -> str:
        """``grads.projection_kind`` (held by ``capture``): countsketch, rademacher or kronecker."""
        return self.capture.projection_kind

    @property
    def quantization(self) -> str:
        """``quantization`` (held by ``capture``): none, 4bit or 8bit."""
        return self.capture.quantization

    def with_changes(self, **changes: Any) -> "PlanSettings":
        """A copy with ``changes`` (fields, or ``projection_kind``, which lives in ``capture``)."""
        capture_keys = {"projection_dim", "storage_dtype", "chunk_size", "projection_kind", "quantization"}
        capture = replace(self.capture, **{k: v for k, v in changes.items() if k in capture_keys})
        changes.pop("projection_kind", None)
        changes.pop("quantization", None)
        return replace(self, capture=capture, **changes)

    def config_values(self) -> dict[str, ConfigValue]:
        """The settings under their config keys (``grads.*``, ``engine.*``)."""
        return {"engine.store": self.store, "grads.batch_size": self.batch_size,
                "grads.projection_kind": self.projection_kind,
                "grads.projection_dim": self.projection_dim, "grads.module_filter": self.module_filter,
                "grads.storage_dtype": self.storage_dtype, "grads.chunk_size": self.chunk_size,
                "grads.max_seq_length": self.max_seq_length, "grads.max_index_gb": self.max_index_gb,
                "engine.name": self.engine, "quantization": self.quantization}

    @property
    def needs_replay(self) -> bool:
        """The engine replays the run from its recipe (``engine.name: replay``)."""
        from gradian.engines.registry import engine_class

        return bool(getattr(engine_class(self.engine), "needs_replay", False))

    @property
    def needs_full_gradients(self) -> bool:
        """The engine fits Kronecker curvature on whole per-example gradients, so no flat projection."""
        from gradian.engines.registry import needs_whole_gradients

        return needs_whole_gradients(self.engine)

    @property
    def cross_check_engine(self) -> str | None:
        """The cross-check ``gradian attribute`` runs (``cross_check`` resolved), or None."""
        from gradian.engines.registry import resolve_cross_check

        return resolve_cross_check(self.engine, self.cross_check)


@dataclass(frozen=True)
class Budgets:
    """Bytes available: memory per device, disk for the index and the engine state, and the host
    memory of a GPU run (``None``: the memory budget); ``None`` means unlimited."""

    memory: int | None = None
    disk: int | None = None
    host: int | None = None

    def host_memory(self, device: str) -> int | None:
        """The budget of host memory: on a CPU run the memory itself."""
        if device == "cpu":
            return self.memory
        return self.host if self.host is not None else self.memory


@dataclass
class Proposal:
    """Settings that fit the budgets: the changed config keys and what they cost."""

    changes: dict[str, ConfigValue]
    #: peak on the device (on a CPU run, everything in the one memory)
    peak_memory: int
    #: the index's bytes under the proposed settings, written or not
    index_bytes: int
    fits: bool
    #: why each change was made, in the order they were made
    reasons: list[str] = field(default_factory=list)
    #: the store the run would use, and the bytes it leaves on disk (index and engine state)
    store: str = "index"
    disk_bytes: int = 0
    #: host memory of a GPU run: the chunk buffer and a Kronecker fit's factors (0 on a CPU run)
    host_peak: int = 0


@dataclass
class Plan:
    """Predicted cost of a gradient run with one settings set: the capture, both stores, the engine.

    What the settings cost is ``priced`` (a ``Priced``); the plan adds the inputs it was priced
    for, the budgets, and what fits them. ``to_json()`` is the document ``gradian plan --json``
    prints."""

    model: ModelShape
    adapter: AdapterShape
    settings: PlanSettings
    n_examples: int
    max_tokens: int
    total_tokens: int
    budgets: Budgets
    priced: Priced
    proposal: Proposal | None = None
    notes: list[str] = field(default_factory=list)
    #: ``engine.name: replay``: the replay of the run's recipe (``gradian.plan.replay``)
    replay: ReplayCost | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.priced.blocks)

    @property
    def values_per_example(self) -> int:
        """Gradient values per example, before any projection."""
        return sum(d for d, _ in self.priced.blocks)

    @property
    def stored_per_example(self) -> int:
        """Values stored per example (after the projection, if any)."""
        return sum(w for _, w in self.priced.blocks)

    @property
    def fits_memory(self) -> bool:
        """The capture (and a Kronecker engine's factors) fit the memory per device, and so does a replay."""
        budget = self.budgets.memory
        return budget is None or (self.priced.device_peak <= budget and self.fits_replay)

    @property
    def fits_replay(self) -> bool:
        """The replay's peak fits the memory per device (true without a replay or a budget)."""
        return self.replay is None or self.budgets.memory is None or self.replay.peak <= self.budgets.memory

    @property
    def fits_host(self) -> bool:
        """A GPU run's host memory fits (always true on a CPU run: it is counted in ``device_peak``)."""
        if self.settings.device == "cpu":
            return True
        budget = self.budgets.host_memory(self.settings.device)
        return budget is None or self.priced.host_peak <= budget

    @property
    def disk_bytes(self) -> int:
        """What the planned run keeps on disk: the index and fitted state, and a replay's states."""
        return self.priced.disk_bytes + (self.replay.disk_bytes if self.replay is not None else 0)

    @property
    def fits_disk(self) -> bool:
        return self.budgets.disk is None or self.disk_bytes <= self.budgets.disk

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_host and self.fits_disk

    def to_json(self) -> dict[str, Any]:
        """The plan as ``gradian plan --json`` prints it (plain values; the layout is pinned by
        tests/test_plan_json.py)."""
        from dataclasses import asdict

        p = self.priced
        return {"model": asdict(self.model), "adapter": asdict(self.adapter), "settings": asdict(self.settings),
                "n_examples": self.n_examples, "max_tokens": self.max_tokens, "total_tokens": self.total_tokens,
                "n_blocks": self.n_blocks, "values_per_example": self.values_per_example,
                "stored_per_example": self.stored_per_example, "worst_batch": asdict(p.worst),
                "memory": asdict(p.memory), "index_bytes": p.index.disk_bytes, "budgets": asdict(self.budgets),
                "passes": asdict(p.passes), "cross_check": asdict(p.cross_check) if p.cross_check else None,
                "index": asdict(p.index), "stream": asdict(p.stream), "curvature": asdict(p.curvature),
                "store": p.store, "store_reason": p.store_reason, "auto_store": p.auto_store,
                "auto_reason": p.auto_reason, "proposal": asdict(self.proposal) if self.proposal else None,
                "notes": list(self.notes), "device_peak": p.device_peak, "host_peak": p.host_peak,
                "host_buffer": p.host_buffer, "disk_bytes": p.disk_bytes, "fits": self.fits,
                "fits_memory": self.fits_memory, "fits_host": self.fits_host, "fits_disk": self.fits_disk,
                "replay": self.replay.to_json() if self.replay is not None else None}


def _cost(model: ModelShape, linears: list[LoraLinear], dataset: DatasetShape, settings: PlanSettings,
          cache: _BatchCache | None = None) -> tuple[BatchShape, MemoryEstimate, int]:
    """The worst batch, its memory, and the index bytes, under ``settings``."""
    capture = replace(settings.capture, projection_dim=settings.projection_dim, storage_dtype=settings.storage_dtype,
                      chunk_size=settings.chunk_size)
    key = (settings.batch_size, settings.max_seq_length)
    bounds: dict[int, BatchShape] | None = cache.get(key) if cache is not None else None
    if bounds is None:
        lengths = dataset if settings.max_seq_length is None else _truncated(dataset, settings.max_seq_length)
        # every term grows with the padded width and the supervised count, so per row count the
        # widest batch with the most supervision bounds the rest: one estimate instead of thousands
        bounds = {}
        for batch in lengths.batches(settings.batch_size):
            was = bounds.get(batch.rows, BatchShape(batch.rows, 0, 0))
            bounds[batch.rows] = BatchShape(batch.rows, max(was.width, batch.width),
                                            max(was.supervised, batch.supervised))
        if cache is not None:
            cache[key] = bounds
    worst, estimate = BatchShape(1, 1, 1), None
    for batch in bounds.values():
        candidate = estimate_memory(model, linears, batch, capture)
        if estimate is None or candidate.peak > estimate.peak:
            worst, estimate = batch, candidate
    if estimate is None:
        estimate = estimate_memory(model, linears, worst, capture)
    widths = [w for _, w in block_widths(linears, capture.block_granularity, settings.projection_dim,
                                         capture.projection_kind)]
    return worst, estimate, index_bytes(dataset.n, widths, settings.storage_dtype, settings.chunk_size)


@dataclass
class Priced:
    """What one settings set costs: everything a plan or a proposal reads of it."""

    #: ``cpu``, or a GPU's device type: on a CPU run the host's share is in the same memory
    device: str
    linears: list[LoraLinear]
    #: the batch shape priced: per row count, the widest batch's width and the most supervised
    #: positions of any batch (every term grows with both, so this bounds every batch)
    worst: BatchShape
    memory: MemoryEstimate
    #: ``(values, stored)`` per block
    blocks: list[tuple[int, int]]
    #: the engine's passes over the training set (one fit, one scoring), and the cross-check's
    passes: Passes
    cross_check: Passes | None
    #: what each store costs
    index: IndexCost
    stream: StreamCost
    #: a Kronecker engine's factors and fitted state (zeros otherwise)
    curvature: CurvatureCost
    #: the store the run would use, and why; and what ``engine.store: auto`` would choose
    store: str
    store_reason: str
    auto_store: str
    auto_reason: str

    @property
    def host_buffer(self) -> int:
        """The chunk buffer of the store the run would use (host memory)."""
        return self.stream.host_buffer if self.store == "stream" else self.index.host_buffer

    @property
    def host_peak(self) -> int:
        """Host memory beside the model: the chunk buffer and a Kronecker fit's factors and eigenbases."""
        return self.host_buffer + self.curvature.host

    @property
    def device_peak(self) -> int:
        """Peak on the device: the capture, and a Kronecker engine's factors gathered there; on a
        CPU run the host's share lives in the same memory and is added."""
        return self.memory.peak + self.curvature.device + (self.host_peak if self.device == "cpu" else 0)

    @property
    def disk_bytes(self) -> int:
        """Bytes left on disk: the index (none under the stream) and a fitted engine state."""
        return (0 if self.store == "stream" else self.index.disk_bytes) + self.curvature.state_bytes

    @property
    def index_disk(self) -> int:
        """Disk if the index is written: the index and the engine state."""
        return self.index.disk_bytes + self.curvature.state_bytes


def _price(model: ModelShape, adapter: AdapterShape, dataset: DatasetShape, settings: PlanSettings,
           budgets: Budgets, cache: _BatchCache | None = None) -> Priced | None:
    """``settings`` priced (None when no LoRA module is selected)."""
    linears = lora_linears(model, adapter, settings.module_filter)
    if not linears:
        return None
    worst, memory, disk = _cost(model, linears, dataset, settings, cache)
    kind = settings.capture.projection_kind
    blocks = block_widths(linears, settings.capture.block_granularity, settings.projection_dim, kind)
    data = dataset.n * sum(w for _, w in blocks) * DTYPE_BYTES[settings.storage_dtype]
    normalization = settings.capture.normalization
    from gradian.engines.registry import engine_class

    from gradian.grads.collectors import factor_share

    cross_name = settings.cross_check_engine
    passes = engine_passes(settings.engine, settings.fisher, settings.fisher_samples, normalization,
                           factor_share=factor_share(dataset.n, settings.factor_rows),
                           correction_share=factor_share(dataset.n, settings.correction_rows),
                           norms_wanted=bool(cross_name and engine_class(cross_name).reads_norms))
    cross = (engine_passes(cross_name, settings.fisher, settings.fisher_samples, normalization,
                           primed=passes.first > 0,
                           shared_scoring=engine_class(settings.engine).shared_scoring()
                           and engine_class(cross_name).shared_scoring())
             if cross_name else None)
    auto, auto_reason = auto_store(data, settings.max_index_gb, budgets.disk)
    if settings.store == "auto":
        store, reason = auto, f"engine.store is auto: {auto_reason}"
    else:
        store, reason = settings.store, f"engine.store is {settings.store}"
    return Priced(
        device=settings.device, linears=linears, worst=worst, memory=memory, blocks=blocks, passes=passes, cross_check=cross,
        index=IndexCost(disk_bytes=disk, data_bytes=data, host_buffer=memory.writer_buffer,
                        captures=passes.index_captures, reads=passes.index_reads, capture_floors=passes.index_floors),
        stream=StreamCost(passes=passes.stream, host_buffer=memory.stream_chunk, floors=passes.stream_floors),
        curvature=curvature_cost(settings.engine, linears, settings.projection_dim, kind),
        store=store, store_reason=reason, auto_store=auto, auto_reason=auto_reason)


def _truncated(dataset: DatasetShape, limit: int) -> DatasetShape:
    if all(length <= limit for length in dataset.lengths):
        return dataset
    return DatasetShape([min(length, limit) for length in dataset.lengths],
                        [min(s, limit) for s in dataset.supervised], dataset.source)


def make_plan(model: ModelShape, adapter: AdapterShape, dataset: DatasetShape, settings: PlanSettings,
              budgets: Budgets = Budgets(), propose: bool = True, replay: ReplayCost | None = None) -> Plan:
    """Price ``settings`` over every batch of ``dataset``; with budgets, propose settings that fit.
    ``replay``: under ``engine.name: replay``, the replay of the run's recipe, priced
    (``gradian.plan.replay.replay_cost``), which the engine cannot run without."""
    if settings.store not in STORES:
        raise ConfigError(f"engine.store '{settings.store}' is not one of {', '.join(STORES)}")
    if replay is None and settings.needs_replay:
        from gradian.replay.recipe import run_trainer_config

        run_trainer_config(None)  # the engine's own refusal of a run without its recipe
    priced = _price(model, adapter, dataset, settings, budgets)
    if priced is None:
        raise ConfigError(
            f"no LoRA module of {model.name or model.model_type} matches target_modules {adapter.target_modules!r}"
            + (f" and grads.module_filter '{settings.module_filter}'" if settings.module_filter else "")
        )
    lengths = _truncated(dataset, settings.max_seq_length) if settings.max_seq_length else dataset
    plan = Plan(model=model, adapter=adapter, settings=settings, n_examples=dataset.n,
                max_tokens=max(lengths.lengths, default=0), total_tokens=sum(lengths.lengths), budgets=budgets,
                priced=priced, replay=replay)
    if not model.llama_style:
        plan.notes.append(f"model type '{model.model_type}' is not Llama-style: activations are estimated as if it were")
    flat = settings.capture.projection_kind != "kronecker"
    if settings.projection_dim and flat and settings.needs_full_gradients:
        plan.notes.append(f"engine.name {settings.engine} refuses a flat projection of the index (grads.projection_dim "
                          f"{settings.projection_dim}): set grads.projection_dim: null (engine.store: stream when the "
                          "index does not fit), or engine.name: datainf")
    over_limit = settings.max_index_gb is not None and priced.index.data_bytes > settings.max_index_gb * GIB
    if settings.store == "index" and over_limit and not settings.projection_dim:
        plan.notes.append(
            "engine.store is index and the index is over grads.max_index_gb: "
            + (f"{settings.engine} stops there; set engine.store: stream or auto, or raise grads.max_index_gb"
               if settings.needs_full_gradients
               else "the run projects it to the widest power of two that fits"))
    if settings.capture.projection_kind == "rademacher" and priced.memory.projection_cache:
        plan.notes.append(f"rademacher projection keeps {format_size(priced.memory.projection_cache)} of matrices on the "
                          "device; countsketch keeps none")
    if settings.store == "auto" and priced.auto_store == "index" and budgets.disk is None:
        plan.notes.append("engine.store auto compares the index with the free disk of cache_dir when the run starts; "
                          "without --disk the plan assumes it holds the index")
    if propose and (budgets.memory is not None or budgets.disk is not None or budgets.host is not None):
        plan.proposal = propose_settings(model, adapter, dataset, settings, budgets)
    return plan


def _layers_kept(first: int, last: int) -> str:
    return f"only layer {last} is" if first == last else f"only layers {first}..{last} are"


def _layer_filter(first: int, last: int) -> str:
    """A ``grads.module_filter`` keeping layers ``first..last``."""
    return r"\.layers\.(" + "|".join(str(k) for k in range(first, last + 1)) + r")\."


def kronecker_widths(linears: list[LoraLinear], below: int | None = None) -> list[int]:
    """The ``grads.projection_dim`` a proposal tries under ``grads.projection_kind: kronecker``,
    widest first: the powers of two from ``KRONECKER_FLOOR`` up to, not including, the widest side
    of any LoRA matrix (a width no narrower than every side projects nothing), and under ``below``
    (a width configured already)."""
    widest = max((max(o, i) for o, i in lora_matrices(linears)), default=0)
    top = widest if below is None else min(widest, below)
    widths, p = [], KRONECKER_FLOOR
    while p < top:
        widths.append(p)
        p *= 2
    return widths[::-1]


def _kronecker_reason(engine: str, device: str, full: Priced, projected: Priced, width: int, where: str,
                      every_layer: bool, configured: int | None = None) -> str:
    """Why ``grads.projection_kind: kronecker`` at ``width`` is proposed, in a user's words; ``full``
    priced as configured (full width, or a wider ``configured`` kronecker width), on the same layers."""
    factors, state = full.curvature.factor_bytes, full.curvature.state_bytes
    if device == "cpu":
        held = (f"{format_size(factors)} held for the whole attribution and about {format_size(2 * factors)} more for "
                f"the fit, all in the one memory of a CPU run, {format_size(state)} of fitted state on disk")
    else:
        held = (f"{format_size(factors)} on the device for the whole attribution, about {format_size(2 * factors)} "
                f"on the host for the fit, {format_size(state)} of fitted state on disk")
    wide = sorted({side for o, i in lora_matrices(full.linears) for side in (o, i) if side > width})
    sides = f"{wide[0]:,}" if len(wide) == 1 else f"{wide[0]:,} to {wide[-1]:,}"
    ranks = "/".join(str(r) for r in sorted({lin.r for lin in full.linears}))
    stored, values = sum(w for _, w in projected.blocks), sum(w for _, w in full.blocks)
    kept = "every layer stays attributed" if every_layer else "the layers kept stay attributed"
    at = f"at grads.projection_dim {configured}" if configured else "at full width"
    return (f"{engine}'s Kronecker factors do not fit {where} {at} ({held}): grads.projection_kind: "
            f"kronecker, grads.projection_dim: {width} projects each LoRA matrix's model-wide side ({sides} wide) "
            f"onto {width} random directions and keeps its rank side (r={ranks}) exact: the factors take "
            f"{format_size(projected.curvature.factor_bytes)}, a stored row {stored:,} values instead of {values:,}; "
            f"{kept}, and the curvature is still fitted, in the projected space. A random projection moves the "
            f"scores a little, less the wider it is ({KRONECKER_VALIDATION})")


def propose_settings(model: ModelShape, adapter: AdapterShape, dataset: DatasetShape, settings: PlanSettings,
                     budgets: Budgets) -> Proposal:
    """Settings that fit ``budgets``, changing as little as possible, in this order. The engine
    is never changed.

    Disk, when the index (and the engine's fitted state) does not fit it: float16 storage (halves
    the index; scores barely move). Under an engine that fits Kronecker curvature on whole
    gradients (EK-FAC, K-FAC), if that is not enough, ``engine.store: stream`` (nothing written,
    the gradients recomputed in each of the engine's passes); under the other engines the widest
    power-of-two projection that fits, then fewer layers (the last ones), and a
    ``grads.max_index_gb`` that lets ``engine.store: auto`` write that index. A Kronecker engine's
    fitted state that does not fit the disk gets ``grads.projection_kind: kronecker`` (below)
    before fewer layers. Memory: a smaller chunk, when the chunk buffer (the index writer's, or a
    stream's chunk in flight) is more than ``HOST_SHARE`` of the host memory; the largest batch
    size up to the configured one that fits ``HEADROOM`` of the budget; a smaller chunk still if
    the buffer is what does not fit; when the base's weights take more than ``QUANTIZE_SHARE`` of
    the budget, ``quantization: 8bit``, or ``4bit`` when 8-bit is not enough (every layer and the
    full width kept); under a Kronecker engine, ``grads.projection_kind:
    kronecker`` at the widest power-of-two ``grads.projection_dim`` (from ``KRONECKER_FLOOR`` up
    to below the widest side) that fits, every layer kept; then fewer layers, since activations
    are kept only from the first layer holding a selected module (and a Kronecker engine's
    factors grow with each layer): the most layers that fit, at full width or else at the widest
    such projection. A projected index that now fits the disk (and, under ``auto``,
    ``grads.max_index_gb``) is written again instead of streamed, as ``engine.store`` would
    choose.
    """
    cache: _BatchCache = {}
    current = settings
    reasons: list[str] = []
    device = settings.device
    host_budget = budgets.host_memory(device)
    #: what the Kronecker projection was proposed for, in the order it was found
    projected_for: list[str] = []
    kronecker_prefix = f"{settings.engine}'s Kronecker factors do not fit"

    def price(s: PlanSettings) -> Priced | None:
        return _price(model, adapter, dataset, s, budgets, cache)

    def index_fits(s: PlanSettings) -> bool:
        p = price(s)
        return p is not None and (budgets.disk is None or p.index_disk <= budgets.disk)

    def within_limit(s: PlanSettings) -> bool:
        """The index is under ``grads.max_index_gb``, so the run writes it (under auto or index)."""
        p = price(s)
        return p is not None and (s.max_index_gb is None or p.index.data_bytes <= s.max_index_gb * GIB)

    def disk_ok(s: PlanSettings) -> bool:
        p = price(s)
        return p is not None and (budgets.disk is None or p.disk_bytes <= budgets.disk)

    def device_ok(s: PlanSettings) -> bool:
        p = price(s)
        return p is not None and (budgets.memory is None or p.device_peak <= HEADROOM * budgets.memory)

    def host_ok(s: PlanSettings) -> bool:
        """The host memory fits (on a CPU run: the one memory, as ``device_ok``)."""
        if device == "cpu":
            return device_ok(s)
        p = price(s)
        return p is not None and (host_budget is None or p.host_peak <= HEADROOM * host_budget)

    def memory_ok(s: PlanSettings) -> bool:
        return device_ok(s) and host_ok(s)

    def kronecker(s: PlanSettings, ok: Callable[[PlanSettings], bool]) -> PlanSettings | None:
        """``s`` under ``grads.projection_kind: kronecker`` at the widest width for which ``ok``
        holds (narrower than one configured already); None when none does, or the engine has no
        Kronecker curvature, or a flat projection is configured (the run refuses it: a note)."""
        if not s.needs_full_gradients or (s.projection_dim and s.projection_kind != "kronecker"):
            return None
        p = price(s)
        for width in kronecker_widths(p.linears if p is not None else [], s.projection_dim):
            trial = s.with_changes(projection_kind="kronecker", projection_dim=width)
            if ok(trial):
                return trial
        return None

    def index_again(s: PlanSettings) -> tuple[PlanSettings, str | None]:
        """After a ``kronecker`` projection, the disk step's choice made again: it proposed the
        stream, or float16 storage, for the full-width index, and the projected one may fit the
        disk and (under ``auto``) ``grads.max_index_gb``, where the run writes it (as
        ``choose_store`` does): in the configured storage dtype, else in float16. The writer's
        buffer gets smaller chunks when it does not fit the memory. None when nothing changes."""
        if settings.store == "stream" or (s.store, s.storage_dtype) == (settings.store, settings.storage_dtype):
            return s, None
        for dtype in dict.fromkeys((settings.storage_dtype, "float16")):
            if (s.store, s.storage_dtype) == (settings.store, dtype):
                return s, None  # already the cheapest index that fits
            trial = s.with_changes(store=settings.store, storage_dtype=dtype)
            p = price(trial)
            if p is None or p.store != "index" or not index_fits(trial):
                continue
            size = trial.chunk_size
            while size > 1 and not memory_ok(trial.with_changes(chunk_size=size)):
                size //= 2
            trial = trial.with_changes(chunk_size=size)
            if not memory_ok(trial):
                continue
            p = price(trial)
            assert p is not None
            fits = (f"projected, the index ({format_size(p.index.data_bytes)} in {dtype}) fits the disk budget"
                    + (" and grads.max_index_gb" if settings.store == "auto" else ""))
            if s.store != "stream":
                return trial, f"{fits}: no float16 storage needed"
            captures, reads = p.passes.index_captures, p.passes.index_reads
            written = "which writes it" if settings.store == "auto" else "so it is written"
            return trial, (f"{fits}: engine.store stays {settings.store}, {written}: {captures} forward+backward "
                           f"pass{'es' if captures > 1 else ''} and {reads} read{'s' if reads > 1 else ''} of it "
                           f"instead of {p.passes.stream} passes")
        return s, None

    def take_kronecker(s: PlanSettings, over: list[str]) -> PlanSettings:
        """Adopt the projection of ``s`` (made for what is ``over`` its budget), replacing the reason
        of a wider one, and choose the store again."""
        nonlocal reasons
        projected_for.extend(name for name in over if name not in projected_for)
        full = price(s.with_changes(projection_kind=settings.projection_kind, projection_dim=settings.projection_dim))
        projected = price(s)
        assert full is not None and projected is not None and s.projection_dim
        every_layer = s.module_filter == settings.module_filter
        reasons = [r for r in reasons if not r.startswith(kronecker_prefix)]
        where = (projected_for[0] if len(projected_for) == 1
                 else ", ".join(projected_for[:-1]) + " and " + projected_for[-1])
        reasons.append(_kronecker_reason(settings.engine, device, full, projected, s.projection_dim, where,
                                         every_layer, settings.projection_dim))
        s, stored = index_again(s)
        if stored is not None:
            reasons = [r for r in reasons if not r.startswith(("the index (", "float16 storage"))]
            reasons.append(stored)
        return s

    def over_memory(s: PlanSettings) -> list[str]:
        """What does not fit, in words: the memory of a CPU run, or the device and/or the host."""
        if device == "cpu":
            return ["the memory budget"]
        return [name for name, ok in (("the device", device_ok(s)), ("the host", host_ok(s))) if not ok]

    first = price(current)
    if first is not None and budgets.disk is not None and current.store != "stream" and first.index_disk > budgets.disk:
        half = current.with_changes(storage_dtype="float16") if current.storage_dtype != "float16" else None
        if current.needs_full_gradients:
            if half is not None and index_fits(half) and within_limit(half):
                current = half
                reasons.append("float16 storage halves the index")
            else:
                current = current.with_changes(store="stream")
                reasons.append(f"the index ({format_size(first.index.disk_bytes)}) does not fit the disk budget, and "
                               f"{settings.engine} fits its curvature on whole gradients: engine.store: stream writes "
                               f"none and recomputes them in each of its {first.passes.stream} passes")
        else:
            if half is not None:
                current = half
                reasons.append("float16 storage halves the index")
            if not index_fits(current):
                widest = max((lin.dim for lin in lora_linears(model, adapter, current.module_filter)), default=1)
                for p in (2**k for k in range(24, 5, -1)):
                    if p >= widest:
                        continue
                    trial = current.with_changes(projection_dim=p)
                    if index_fits(trial):
                        current = trial
                        reasons.append(f"a {p}-wide projection per block fits the disk budget")
                        break
            if not index_fits(current):
                for start in range(1, model.num_layers):
                    trial = current.with_changes(module_filter=_layer_filter(start, model.num_layers - 1))
                    if index_fits(trial):
                        current = trial
                        reasons.append(f"{_layers_kept(start, model.num_layers - 1)} indexed (disk)")
                        break
            now = price(current)
            if now is not None and current.store == "auto" and not within_limit(current) and index_fits(current):
                limit = float(math.ceil(now.index.data_bytes / GIB))
                current = current.with_changes(max_index_gb=limit)
                reasons.append(f"grads.max_index_gb {limit:g} lets engine.store: auto write this "
                               f"{format_size(now.index.data_bytes)} index (over the limit, it streams)")
    if (current.store == "index" and current.needs_full_gradients and not current.projection_dim
            and not within_limit(current) and index_fits(current)):
        over = price(current)
        assert over is not None
        limit = float(math.ceil(over.index.data_bytes / GIB))
        current = current.with_changes(max_index_gb=limit)
        reasons.append(f"grads.max_index_gb {limit:g}: under engine.store: index, {settings.engine} stops at a larger "
                       f"index than the limit, and this {format_size(over.index.data_bytes)} one fits the disk")
    if not disk_ok(current):  # the engine's fitted state alone, or nothing above was enough
        projected = kronecker(current, disk_ok)
        if projected is not None:  # a Kronecker engine's state is its factors' size: projected, it fits
            current = take_kronecker(projected, ["the disk budget"])
        else:
            for start in range(1, model.num_layers):
                trial = current.with_changes(module_filter=_layer_filter(start, model.num_layers - 1))
                if disk_ok(trial):
                    current = trial
                    reasons.append(f"{_layers_kept(start, model.num_layers - 1)} differentiated (disk)")
                    break

    buffer_budget = budgets.memory if device == "cpu" else host_budget

    def buffer(s: PlanSettings) -> int:
        p = price(s)
        return p.host_buffer if p is not None else 0

    chunk, batch = current.chunk_size, current.batch_size
    if buffer_budget is not None:
        while not host_ok(current) and current.chunk_size > 1 and buffer(current) > HOST_SHARE * buffer_budget:
            current = current.with_changes(chunk_size=max(1, current.chunk_size // 2))
    if not device_ok(current):
        for size in range(current.batch_size - 1, 0, -1):
            trial = current.with_changes(batch_size=size)
            if device_ok(trial):
                current = trial
                break
        else:
            current = current.with_changes(batch_size=1)
    if not memory_ok(current) and buffer_budget is not None:
        size = current.chunk_size // 2
        while size >= 1:
            trial = current.with_changes(chunk_size=size)
            if memory_ok(trial):
                current = trial
                break
            size //= 2
    if not memory_ok(current) and current.quantization == "none" and budgets.memory is not None:
        # the base's weights are what does not fit: hold them quantized (what a QLoRA run trained
        # against), 8-bit when that is enough, else 4-bit; every layer and the full width kept
        as_is = price(current)
        if as_is is not None and as_is.memory.weights > QUANTIZE_SHARE * budgets.memory:
            for kind in ("8bit", "4bit"):
                trial = current.with_changes(quantization=kind)
                if memory_ok(trial) or kind == "4bit":
                    q = price(trial)
                    assert q is not None
                    reasons.append(f"the base's weights ({format_size(as_is.memory.weights)} in "
                                   f"{current.capture.dtype}) take more than half the memory budget: quantization: "
                                   f"{kind} holds them in {format_size(q.memory.weights)} through bitsandbytes "
                                   f"(gradients within the error measured in {QUANTIZATION_VALIDATION})")
                    current = trial
                    break
    if not memory_ok(current):  # the Kronecker factors projected, every layer kept
        projected = kronecker(current, memory_ok)
        if projected is not None:
            current = take_kronecker(projected, over_memory(current))
    if not memory_ok(current):
        where = over_memory(current)
        for start in range(1, model.num_layers):
            trial = current.with_changes(module_filter=_layer_filter(start, model.num_layers - 1))
            fitted = trial if memory_ok(trial) else kronecker(trial, memory_ok)
            if fitted is not None:
                current = fitted
                # a cut for the disk is superseded by this narrower one
                reasons = [r for r in reasons if not r.startswith("only layer")]
                reasons.append(f"{_layers_kept(start, model.num_layers - 1)} differentiated (memory"
                               + (f"; {settings.engine}'s Kronecker factors grow with each layer)"
                                  if current.needs_full_gradients else ")"))
                if fitted is not trial or projected_for:  # projected here, or its reason said every layer
                    current = take_kronecker(fitted, [] if fitted is trial else where)
                break
        else:  # none fits HEADROOM of the budget: the fewest, the closest
            last = model.num_layers - 1
            current = current.with_changes(module_filter=_layer_filter(last, last))
            reasons = [r for r in reasons if not r.startswith("only layer")]
            reasons.append(f"{_layers_kept(last, last)} differentiated (memory), the fewest")
            if projected_for:
                current = take_kronecker(current, [])
    # fewer layers may leave room for larger batches and chunks again
    while current.batch_size < batch and memory_ok(current.with_changes(batch_size=current.batch_size + 1)):
        current = current.with_changes(batch_size=current.batch_size + 1)
    if buffer_budget is not None:
        while current.chunk_size < chunk:
            trial = current.with_changes(chunk_size=min(chunk, current.chunk_size * 2))
            if not host_ok(trial) or buffer(trial) > HOST_SHARE * buffer_budget:
                break
            current = trial
    if current.batch_size != batch:
        reasons.append(f"batches of {current.batch_size} fit the memory budget" if memory_ok(current)
                       else "batches of 1, the smallest")
    final = price(current)
    assert final is not None
    if current.chunk_size != chunk:
        which = "stream's chunk in flight" if final.store == "stream" else "index writer's buffer"
        reasons.append(f"chunks of {current.chunk_size} rows keep the {which} at {format_size(final.host_buffer)} "
                       "of host memory")
    peak, host, disk = final.device_peak, final.host_peak, final.disk_bytes
    changes = {k: v for k, v in current.config_values().items() if settings.config_values()[k] != v}
    fits = ((budgets.memory is None or peak <= budgets.memory) and (budgets.disk is None or disk <= budgets.disk)
            and (device == "cpu" or host_budget is None or host <= host_budget))
    ways = ((["a bfloat16 model (dtype: bfloat16) halves the weights"] if current.capture.model_bytes > 2 else [])
            + (["quantization: 4bit holds the layers' weights in about a quarter of bfloat16's bytes"]
               if current.quantization == "none" else []))
    if not fits and budgets.memory is not None and peak > budgets.memory and ways:
        reasons.append("even so it does not fit: " + "; ".join(ways))
    elif not fits and final.curvature.factor_bytes:
        layers = len({lin.layer for lin in final.linears})
        reasons.append(f"even so it does not fit: {settings.engine}'s Kronecker factors take "
                       f"{format_size(final.curvature.factor_bytes // max(layers, 1))} per layer on the device and "
                       "twice that on the host")
    return Proposal(changes=changes, peak_memory=peak, index_bytes=final.index.disk_bytes, fits=fits,
                    reasons=reasons, store=final.store, disk_bytes=disk, host_peak=0 if device == "cpu" else host)
