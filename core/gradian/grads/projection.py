"""Random projections that shrink each block's gradient to a fixed width.

Interface: ``BlockProjector(kind, width, seed)``; ``projector.project(block_name, grads)`` maps a
``[rows, dim]`` tensor to ``[rows, width]`` (or returns it unchanged when ``dim <= width``, since
projecting up only adds noise); ``projector.out_dim(dim)`` says which.

Both families preserve inner products in expectation, so dot-product engines see the same scores
on average, with a variance that shrinks as the width grows:

- ``countsketch``: each coordinate ``i`` goes to bucket ``h(i)`` with sign ``s(i)``:
  ``y[h(i)] += s(i) x[i]``. Costs one pass over the vector and no matrix.
- ``rademacher``: ``y = R x / sqrt(width)`` with ``R_ij = +-1``. Denser, lower variance for
  the same width, and it materializes a ``width x dim`` matrix per block.

- ``kronecker`` (``KroneckerProjector``): each LoRA matrix ``G`` (``[out, in]``, one linear
  layer of the block) becomes ``P_out G P_in^T`` (``[min(out, width), min(in, width)]``), a
  Rademacher projection of each side, and a side no wider than ``width`` is kept as it is. The
  per-example gradient of a linear layer is ``sum_t g_t x_t^T``, so the projected one is
  ``sum_t (P_out g_t)(P_in x_t)^T``: the gradient of a smaller linear layer whose inputs are
  ``P_in x`` and whose output gradients are ``P_out g``. Its Kronecker factors are
  ``P_in A P_in^T`` and ``P_out S P_out^T``, so K-FAC and EK-FAC still apply in the projected
  space (``side_matrix`` gives each side's matrix to the factor collection). The stored width of
  a layer is the product of its two projected sides, not a fixed width per block.

Each block's projection is seeded by ``seed`` and the block's name (and, for ``kronecker``, the
layer's place in the block and the side), so a block keeps its projection when other blocks are
filtered out. ``block_width(block)`` is a block's stored width under either projector.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Mapping, Sequence

from gradian.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from gradian.grads.model import GradientBlock

__all__ = ["BlockProjector", "KroneckerProjector", "PROJECTION_KINDS", "projection_of"]

PROJECTION_KINDS = ("countsketch", "rademacher", "kronecker")
#: the kinds that keep each LoRA matrix's two sides apart, so Kronecker curvature still applies
STRUCTURED_KINDS = ("kronecker",)


def _block_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _check(kind: str, width: int) -> None:
    if kind not in PROJECTION_KINDS:
        raise ConfigError(f"grads.projection_kind '{kind}' is not one of {', '.join(PROJECTION_KINDS)}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ConfigError(f"grads.projection_dim must be a positive integer, got {width!r}")


class BlockProjector:
    """Seeded per-block random projection of the flattened block to ``width`` coordinates."""

    structured = False

    def __init__(self, kind: str, width: int, seed: int = 0) -> None:
        if kind in STRUCTURED_KINDS:
            raise ConfigError(f"grads.projection_kind '{kind}' projects each LoRA matrix's sides: it needs the "
                              "model's layer shapes (KroneckerProjector)")
        if kind not in PROJECTION_KINDS:
            raise ConfigError(f"grads.projection_kind '{kind}' is not one of {', '.join(PROJECTION_KINDS)}")
        if width < 1:
            raise ConfigError(f"grads.projection_dim must be a positive integer, got {width}")
        self.kind, self.width, self.seed = kind, int(width), int(seed)
        #: (block, dim, device) -> countsketch (buckets, signs) or the rademacher sign matrix
        self._sketches: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._matrices: dict[tuple[str, int, str], torch.Tensor] = {}

    def out_dim(self, dim: int) -> int:
        return min(dim, self.width)

    def block_width(self, block: GradientBlock) -> int:
        """The stored width of ``block``."""
        return self.out_dim(int(block.dim))

    def project(self, name: str, grads: torch.Tensor) -> torch.Tensor:
        """``[rows, dim]`` -> ``[rows, out_dim(dim)]``, in ``grads``' dtype and device."""
        import torch

        dim = grads.shape[1]
        if dim <= self.width:
            return grads
        key = (name, dim, str(grads.device))
        if key not in self._sketches and key not in self._matrices:
            gen = torch.Generator(device="cpu").manual_seed(_block_seed(self.seed, name))
            if self.kind == "countsketch":
                buckets = torch.randint(0, self.width, (dim,), generator=gen)
                signs = torch.randint(0, 2, (dim,), generator=gen) * 2 - 1
                self._sketches[key] = (buckets.to(grads.device), signs.to(grads.device))
            else:
                signs = torch.randint(0, 2, (self.width, dim), generator=gen, dtype=torch.int8) * 2 - 1
                self._matrices[key] = signs.to(grads.device)
        if self.kind == "countsketch":
            buckets, signs = self._sketches[key]
            out = torch.zeros((grads.shape[0], self.width), dtype=grads.dtype, device=grads.device)
            return out.index_add_(1, buckets, grads * signs.to(grads.dtype))
        matrix = self._matrices[key].to(grads.dtype)
        return (grads @ matrix.T) / math.sqrt(self.width)


class KroneckerProjector:
    """Seeded projection of each side of every LoRA matrix to at most ``width`` (see the module doc).

    ``shapes`` maps each block's name to its LoRA matrices' shapes ``[(out, in), ...]`` in storage
    order (``GradientBlock.shapes``); ``project`` maps a block's flattened full gradient
    ``[rows, dim]`` to ``[rows, block_width]``, layer by layer.
    """

    structured = True
    kind = "kronecker"

    def __init__(self, width: int, seed: int, shapes: Mapping[str, Sequence[tuple[int, int]]]) -> None:
        _check(self.kind, width)
        self.width, self.seed = int(width), int(seed)
        self.shapes = {name: [(int(o), int(i)) for o, i in layer_shapes] for name, layer_shapes in shapes.items()}
        self._cache: dict[tuple[str, int, str, int, str, str], torch.Tensor] = {}

    def projected_shapes(self, name: str) -> list[tuple[int, int]]:
        """The stored ``(out, in)`` of each LoRA matrix of block ``name``."""
        return [(min(o, self.width), min(i, self.width)) for o, i in self._shapes(name)]

    def block_width(self, block: GradientBlock) -> int:
        return sum(o * i for o, i in self.projected_shapes(block.name))

    def out_dim(self, dim: int) -> int:
        raise ConfigError("a kronecker projection's width depends on the layer shapes: use block_width(block)")

    def _shapes(self, name: str) -> list[tuple[int, int]]:
        if name not in self.shapes:
            raise ConfigError(f"the kronecker projection knows no block '{name}' (its blocks: "
                              f"{', '.join(sorted(self.shapes)) or 'none'})")
        return self.shapes[name]

    def side_matrix(self, name: str, layer: int, side: str, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """``P`` (``[width, d]``, entries +-1/sqrt(width)) for ``side`` ``"in"`` or ``"out"`` of layer
        ``layer`` of block ``name``, or None when that side is no wider than ``width`` (kept exact)."""
        import torch

        out_dim, in_dim = self._shapes(name)[layer]
        d = in_dim if side == "in" else out_dim
        if d <= self.width:
            return None
        dtype = dtype if dtype is not None else torch.float32
        key = (name, layer, side, d, str(device), str(dtype))
        if key not in self._cache:
            gen = torch.Generator(device="cpu").manual_seed(_block_seed(self.seed, f"{name}#{layer}:{side}"))
            signs = torch.randint(0, 2, (self.width, d), generator=gen, dtype=torch.int8) * 2 - 1
            self._cache[key] = (signs.to(dtype) / math.sqrt(self.width)).to(device)
        return self._cache[key]

    def project_sides(self, name: str, layer: int, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's inputs ``x`` (``[..., in]``) and output gradients ``g`` (``[..., out]``) in the
        projected space: ``x P_in^T`` and ``g P_out^T``."""
        p_in = self.side_matrix(name, layer, "in", x.device, x.dtype)
        p_out = self.side_matrix(name, layer, "out", g.device, g.dtype)
        return (x if p_in is None else x @ p_in.T), (g if p_out is None else g @ p_out.T)

    def project(self, name: str, grads: torch.Tensor) -> torch.Tensor:
        """``[rows, dim]`` -> ``[rows, block_width]``: ``P_out G P_in^T`` of each LoRA matrix."""
        import torch

        rows = grads.shape[0]
        parts, offset = [], 0
        for j, (o, i) in enumerate(self._shapes(name)):
            g = grads[:, offset: offset + o * i].reshape(rows, o, i)
            offset += o * i
            p_out = self.side_matrix(name, j, "out", grads.device, grads.dtype)
            p_in = self.side_matrix(name, j, "in", grads.device, grads.dtype)
            if p_out is not None:
                g = p_out @ g
            if p_in is not None:
                g = g @ p_in.T
            parts.append(g.reshape(rows, -1))
        if offset != grads.shape[1]:
            raise ConfigError(f"block '{name}' gradient is {grads.shape[1]} wide, its LoRA matrices hold {offset}")
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def projection_of(kind: str, width: int | None, seed: int,
                  blocks: Sequence[GradientBlock] = ()) -> "BlockProjector | KroneckerProjector | None":
    """The projector of a ``grads`` section: None without a width; ``blocks`` (``GradientBlock``s,
    with ``name`` and ``shapes``) are needed by the ``kronecker`` kind."""
    if width is None:
        return None
    if kind in STRUCTURED_KINDS:
        return KroneckerProjector(width, seed, {b.name: list(b.shapes) for b in blocks})
    return BlockProjector(kind, width, seed)
