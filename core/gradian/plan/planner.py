"""One plan: a settings set priced over every batch of the dataset, and the settings that fit.

Interface: ``make_plan(model, adapter, dataset, settings, budgets) -> Plan``: the predicted peak
memory of the worst batch, the index's bytes on disk, whether both fit the budgets, and a
``Proposal`` of settings that do (``propose_settings``). ``parse_size("24GiB")`` reads a budget.
Pure functions of shapes and numbers: nothing is loaded and nothing is printed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gradian.errors import ConfigError
from gradian.sizes import format_size, parse_size
from gradian.plan.memory import CaptureSettings, MemoryEstimate, block_widths, estimate_memory, index_bytes
from gradian.plan.shapes import AdapterShape, BatchShape, DatasetShape, LoraLinear, ModelShape, lora_linears

__all__ = ["PlanSettings", "Budgets", "Plan", "Proposal", "make_plan", "propose_settings", "parse_size",
           "format_size", "HEADROOM"]

#: share of a memory budget a proposal may fill: allocator fragmentation and the framework's own
#: buffers (a CUDA context, kernels' workspaces) are not in the formulas
HEADROOM = 0.9

@dataclass(frozen=True)
class PlanSettings:
    """The settings a plan prices: what the capture and the store will be run with."""

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

    @classmethod
    def from_config(cls, config: Any, device: str) -> "PlanSettings":
        """From a ``GradianConfig``; ``dtype: auto`` is bfloat16 on CUDA and float32 elsewhere."""
        grads = config.grads
        dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
        capture = CaptureSettings(dtype=dtype, attn_implementation=config.attn_implementation,
                                  projection_dim=grads.projection_dim, projection_kind=grads.projection_kind,
                                  normalization=grads.normalization, storage_dtype=grads.storage_dtype,
                                  chunk_size=grads.chunk_size, block_granularity=grads.block_granularity)
        return cls(batch_size=grads.batch_size, max_seq_length=grads.max_seq_length, module_filter=grads.module_filter,
                   projection_dim=grads.projection_dim, storage_dtype=grads.storage_dtype, chunk_size=grads.chunk_size,
                   capture=capture, device=device, engine=config.engine.name)

    def with_changes(self, **changes: Any) -> "PlanSettings":
        capture_keys = {"projection_dim", "storage_dtype", "chunk_size"}
        capture = replace(self.capture, **{k: v for k, v in changes.items() if k in capture_keys})
        return replace(self, capture=capture, **changes)

    def config_values(self) -> dict[str, Any]:
        """The settings under their config keys (``grads.*``, ``engine.name``)."""
        return {"grads.batch_size": self.batch_size, "grads.projection_dim": self.projection_dim,
                "grads.module_filter": self.module_filter, "grads.storage_dtype": self.storage_dtype,
                "grads.chunk_size": self.chunk_size, "grads.max_seq_length": self.max_seq_length,
                "engine.name": self.engine}

    @property
    def needs_full_gradients(self) -> bool:
        """The engine fits Kronecker curvature on whole per-example gradients, so no projection."""
        from gradian.engines.registry import needs_whole_gradients

        return needs_whole_gradients(self.engine)


@dataclass(frozen=True)
class Budgets:
    """Bytes available: memory per device and disk for the index; ``None`` means unlimited."""

    memory: int | None = None
    disk: int | None = None


@dataclass
class Proposal:
    """Settings that fit the budgets: the changed config keys and what they cost."""

    changes: dict[str, Any]
    peak_memory: int
    index_bytes: int
    fits: bool
    #: why each change was made, in the order they were made
    reasons: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """Predicted cost of indexing a dataset with one settings set."""

    model: ModelShape
    adapter: AdapterShape
    settings: PlanSettings
    n_examples: int
    max_tokens: int
    total_tokens: int
    n_blocks: int
    values_per_example: int
    stored_per_example: int
    #: the batch shape priced: per row count, the widest batch's width and the most supervised
    #: positions of any batch (every term grows with both, so this bounds every batch)
    worst_batch: BatchShape
    memory: MemoryEstimate
    index_bytes: int
    budgets: Budgets
    proposal: Proposal | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def device_peak(self) -> int:
        """Peak on the device; on a CPU run the index writer's buffer shares the same memory."""
        return self.memory.peak + (self.memory.writer_buffer if self.settings.device == "cpu" else 0)

    @property
    def fits_memory(self) -> bool:
        return self.budgets.memory is None or self.device_peak <= self.budgets.memory

    @property
    def fits_disk(self) -> bool:
        return self.budgets.disk is None or self.index_bytes <= self.budgets.disk

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_disk


def _cost(model: ModelShape, linears: list[LoraLinear], dataset: DatasetShape,
          settings: PlanSettings) -> tuple[BatchShape, MemoryEstimate, int]:
    """The worst batch, its memory, and the index bytes, under ``settings``."""
    capture = replace(settings.capture, projection_dim=settings.projection_dim, storage_dtype=settings.storage_dtype,
                      chunk_size=settings.chunk_size)
    lengths = dataset if settings.max_seq_length is None else _truncated(dataset, settings.max_seq_length)
    # every term grows with the padded width and the supervised count, so per row count the
    # widest batch with the most supervision bounds the rest: one estimate instead of thousands
    bounds: dict[int, BatchShape] = {}
    for batch in lengths.batches(settings.batch_size):
        was = bounds.get(batch.rows, BatchShape(batch.rows, 0, 0))
        bounds[batch.rows] = BatchShape(batch.rows, max(was.width, batch.width), max(was.supervised, batch.supervised))
    worst, estimate = BatchShape(1, 1, 1), None
    for batch in bounds.values():
        candidate = estimate_memory(model, linears, batch, capture)
        if estimate is None or candidate.peak > estimate.peak:
            worst, estimate = batch, candidate
    if estimate is None:
        estimate = estimate_memory(model, linears, worst, capture)
    widths = [w for _, w in block_widths(linears, capture.block_granularity, settings.projection_dim)]
    return worst, estimate, index_bytes(dataset.n, widths, settings.storage_dtype, settings.chunk_size)


def _truncated(dataset: DatasetShape, limit: int) -> DatasetShape:
    if all(length <= limit for length in dataset.lengths):
        return dataset
    return DatasetShape([min(length, limit) for length in dataset.lengths],
                        [min(s, limit) for s in dataset.supervised], dataset.source)


def make_plan(model: ModelShape, adapter: AdapterShape, dataset: DatasetShape, settings: PlanSettings,
              budgets: Budgets = Budgets(), propose: bool = True) -> Plan:
    """Price ``settings`` over every batch of ``dataset``; with budgets, propose settings that fit."""
    linears = lora_linears(model, adapter, settings.module_filter)
    if not linears:
        raise ConfigError(
            f"no LoRA module of {model.name or model.model_type} matches target_modules {adapter.target_modules!r}"
            + (f" and grads.module_filter '{settings.module_filter}'" if settings.module_filter else "")
        )
    worst, memory, disk = _cost(model, linears, dataset, settings)
    blocks = block_widths(linears, settings.capture.block_granularity, settings.projection_dim)
    lengths = _truncated(dataset, settings.max_seq_length) if settings.max_seq_length else dataset
    plan = Plan(model=model, adapter=adapter, settings=settings, n_examples=dataset.n,
                max_tokens=max(lengths.lengths, default=0), total_tokens=sum(lengths.lengths), n_blocks=len(blocks),
                values_per_example=sum(d for d, _ in blocks), stored_per_example=sum(w for _, w in blocks),
                worst_batch=worst, memory=memory, index_bytes=disk, budgets=budgets)
    if not model.llama_style:
        plan.notes.append(f"model type '{model.model_type}' is not Llama-style: activations are estimated as if it were")
    if settings.projection_dim and settings.needs_full_gradients:
        plan.notes.append(f"engine.name {settings.engine} refuses a projected index (grads.projection_dim "
                          f"{settings.projection_dim}): set grads.projection_dim: null, or engine.name: datainf")
    if settings.capture.projection_kind == "rademacher" and memory.projection_cache:
        plan.notes.append(f"rademacher projection keeps {format_size(memory.projection_cache)} of matrices on the "
                          "device; countsketch keeps none")
    if propose and (budgets.memory is not None or budgets.disk is not None):
        plan.proposal = propose_settings(model, adapter, dataset, settings, budgets)
    return plan


def _layer_filter(first: int, last: int) -> str:
    """A ``grads.module_filter`` keeping layers ``first..last``."""
    return r"\.layers\.(" + "|".join(str(k) for k in range(first, last + 1)) + r")\."


def propose_settings(model: ModelShape, adapter: AdapterShape, dataset: DatasetShape, settings: PlanSettings,
                     budgets: Budgets) -> Proposal:
    """Settings that fit ``budgets``, changing as little as possible, in this order.

    Disk: float16 storage (halves the index; scores barely move), then the widest power-of-two
    projection that fits, then fewer layers (the last ones). Memory: the largest batch size up
    to the configured one that fits ``HEADROOM`` of the budget, then (at batch 1) fewer layers,
    since activations are kept only from the first layer holding a selected module; on a CPU run
    a smaller index chunk when the writer's buffer is what does not fit.
    """
    current = settings
    reasons: list[str] = []

    def cost(s: PlanSettings) -> tuple[int, int]:
        linears = lora_linears(model, adapter, s.module_filter)
        if not linears:
            return 2**62, 2**62
        _, memory, disk = _cost(model, linears, dataset, s)
        peak = memory.peak + (memory.writer_buffer if s.device == "cpu" else 0)
        return peak, disk

    def disk_ok(s: PlanSettings) -> bool:
        return budgets.disk is None or cost(s)[1] <= budgets.disk

    def memory_ok(s: PlanSettings) -> bool:
        return budgets.memory is None or cost(s)[0] <= HEADROOM * budgets.memory

    if not disk_ok(current) and current.storage_dtype != "float16":
        current = current.with_changes(storage_dtype="float16")
        reasons.append("float16 storage halves the index")
    if not disk_ok(current):
        widest = max((lin.dim for lin in lora_linears(model, adapter, current.module_filter)), default=1)
        for p in (2**k for k in range(24, 5, -1)):
            if p >= widest:
                continue
            trial = current.with_changes(projection_dim=p)
            if disk_ok(trial):
                current = trial
                reasons.append(f"a {p}-wide projection per block fits the disk budget")
                if current.needs_full_gradients:
                    current = current.with_changes(engine="datainf")
                    reasons.append(f"{settings.engine} needs unprojected gradients, so a projected index is "
                                   "scored with datainf")
                break
    if not disk_ok(current):
        for first in range(1, model.num_layers):
            trial = current.with_changes(module_filter=_layer_filter(first, model.num_layers - 1))
            if disk_ok(trial):
                current = trial
                reasons.append(f"only layers {first}..{model.num_layers - 1} are indexed (disk)")
                break

    if budgets.memory is not None and settings.device == "cpu":
        while not memory_ok(current) and current.chunk_size > 16:
            _, memory, _ = _cost(model, lora_linears(model, adapter, current.module_filter), dataset, current)
            if memory.writer_buffer < 0.25 * budgets.memory:
                break
            current = current.with_changes(chunk_size=max(16, current.chunk_size // 2))
        if current.chunk_size != settings.chunk_size:
            reasons.append(f"index chunks of {current.chunk_size} rows keep the writer's buffer small")
    if not memory_ok(current):
        for size in range(current.batch_size - 1, 0, -1):
            trial = current.with_changes(batch_size=size)
            if memory_ok(trial):
                current = trial
                reasons.append(f"batches of {size} fit the memory budget")
                break
        else:
            current = current.with_changes(batch_size=1)
    if not memory_ok(current):
        for first in range(1, model.num_layers):
            trial = current.with_changes(module_filter=_layer_filter(first, model.num_layers - 1))
            if memory_ok(trial):
                current = trial
                reasons.append(f"only layers {first}..{model.num_layers - 1} are differentiated (memory)")
                break
    peak, disk = cost(current)
    changes = {k: v for k, v in current.config_values().items() if settings.config_values()[k] != v}
    fits = (budgets.memory is None or peak <= budgets.memory) and (budgets.disk is None or disk <= budgets.disk)
    if not fits and budgets.memory is not None and peak > budgets.memory and current.capture.model_bytes > 2:
        reasons.append("even so it does not fit: a bfloat16 model (dtype: bfloat16) halves the weights")
    return Proposal(changes=changes, peak_memory=peak, index_bytes=disk, fits=fits, reasons=reasons)
