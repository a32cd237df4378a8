"""How big a full-width index would be, and the projection that keeps it under ``grads.max_index_gb``.

Interface: ``index_bytes(gm, grads, n)`` is what ``n`` rows take on disk under these ``grads``
settings; ``store_rule(full, max_index_gb, free, disk=...)`` is the one rule of ``engine.store:
auto`` (the index when it fits the limit and the disk, the stream otherwise), which a run
(``gradian.index.stream.choose_store``) and a plan (``gradian.plan``) both apply; ``auto_projection(config, gm, n, engines) -> (config, AutoProjection | None)`` turns a
random projection on when ``grads.projection_dim`` is unset and the full-width index would pass
``grads.max_index_gb``. The width picked is the largest power of two, at least
``AUTO_PROJECTION_FLOOR``, whose index fits. Engines that fit Kronecker curvature (EK-FAC, K-FAC)
need whole gradients, so with one of them the limit is an error naming the ways out, never a
silent projection. Both the index build and the attribute lane call it before any gradient is
computed; the index manifest records the decision under ``projection_auto``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gradian.errors import ConfigError
from gradian.sizes import GIB, format_size

if TYPE_CHECKING:
    from gradian.config import GradianConfig, GradsConfig
    from gradian.grads import GradientModel

__all__ = ["AUTO_PROJECTION_FLOOR", "AutoProjection", "auto_projection", "index_bytes", "store_rule"]

#: the narrowest projection chosen automatically; below it the ranking is too coarse to act on
AUTO_PROJECTION_FLOOR = 256


@dataclass(frozen=True)
class AutoProjection:
    """A projection turned on because the full-width index would not fit."""

    full_bytes: int
    limit_bytes: int
    projection_dim: int
    stored_bytes: int

    def manifest(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def message(self) -> str:
        return (f"the full-width index would take {format_size(self.full_bytes)}, over grads.max_index_gb "
                f"({format_size(self.limit_bytes)}): projecting each block to {self.projection_dim} values "
                f"({format_size(self.stored_bytes)}); set grads.projection_dim to choose the width, or raise "
                "grads.max_index_gb to keep full gradients")


def store_rule(full: int, max_index_gb: float | None, free: int | None, *,
               disk: str = "the disk of cache_dir") -> tuple[str, str]:
    """``(store, reason)`` that ``engine.store: auto`` picks for a full index of ``full`` bytes: the
    stream when it passes ``grads.max_index_gb`` or the ``free`` bytes of ``disk`` (None: assumed to
    hold it), the index otherwise. The reason says which, and the way to the other store."""
    size = format_size(full)
    limit = None if max_index_gb is None else int(max_index_gb * GIB)
    if limit is not None and full > limit:
        return "stream", (f"the index would take {size}, over grads.max_index_gb ({format_size(limit)}), so the "
                          "gradients are recomputed in each pass and nothing is written; raise grads.max_index_gb, "
                          "or set engine.store: index, to write it")
    if free is not None and full > free:
        return "stream", (f"the index would take {size} and {disk} has {format_size(free)} free, so the gradients "
                          f"are recomputed in each pass and nothing is written; give {disk} more room to write it")
    return "index", f"the index takes {size}, within grads.max_index_gb and the free disk"


def _itemsize(storage_dtype: str) -> int:
    return 2 if storage_dtype == "float16" else 4


def index_bytes(gm: GradientModel, grads: GradsConfig, n: int) -> int:
    """Bytes of the gradient chunks for ``n`` rows of ``gm``'s blocks under ``grads``."""
    from gradian.grads import gradient_widths

    return n * sum(gradient_widths(gm, grads).values()) * _itemsize(grads.storage_dtype)


def auto_projection(config: GradianConfig, gm: GradientModel, n: int,
                    whole: Sequence[str]) -> tuple[GradianConfig, AutoProjection | None]:
    """``config`` with a projection when the full index would pass ``grads.max_index_gb``, and
    the decision (None when nothing changed). ``whole``: the engines reading the index that fit
    curvature on whole gradients (``gradian.engines.registry.needs_whole_gradients``), so that
    the index may not be projected."""
    grads = config.grads
    limit_gb = grads.max_index_gb
    if grads.projection_dim is not None or limit_gb is None:
        return config, None
    limit = int(limit_gb * GIB)
    full = index_bytes(gm, grads, n)
    if full <= limit:
        return config, None
    whole = list(dict.fromkeys(whole))
    size = f"the full-width index of {n} rows would take {format_size(full)}, over grads.max_index_gb ({format_size(limit)})"
    if whole:
        raise ConfigError(
            f"{size}, and {' and '.join(whole)} fit curvature on whole gradients, so it cannot be projected flat: "
            "set engine.store: stream (or auto) to recompute the gradients in each pass and write nothing, "
            "set grads.projection_kind: kronecker with a grads.projection_dim (a compact index the curvature "
            "is still fitted on), "
            "narrow grads.module_filter (e.g. the last layers), use grads.storage_dtype: float16, raise "
            "grads.max_index_gb if the disk holds it, or use engine.name: datainf (with --cross-check graddot "
            "or none), which is then projected automatically")
    widest = max(b.dim for b in gm.blocks)
    dim = 1 << (widest.bit_length() - 1)
    while dim >= AUTO_PROJECTION_FLOOR:
        candidate = dataclasses.replace(grads, projection_dim=dim)
        stored = index_bytes(gm, candidate, n)
        if stored <= limit:
            return (dataclasses.replace(config, grads=candidate),
                    AutoProjection(full_bytes=full, limit_bytes=limit, projection_dim=dim, stored_bytes=stored))
        dim //= 2
    raise ConfigError(f"{size}, and even a projection to {AUTO_PROJECTION_FLOOR} values per block would not fit: "
                      "narrow grads.module_filter, index fewer rows, or raise grads.max_index_gb")
