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

Each block's projection is seeded by ``seed`` and the block's name, so a block keeps its
projection when other blocks are filtered out.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from gradian.errors import ConfigError

__all__ = ["BlockProjector", "PROJECTION_KINDS"]

PROJECTION_KINDS = ("countsketch", "rademacher")


def _block_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


class BlockProjector:
    """Seeded per-block random projection to ``width`` coordinates."""

    def __init__(self, kind: str, width: int, seed: int = 0) -> None:
        if kind not in PROJECTION_KINDS:
            raise ConfigError(f"grads.projection_kind '{kind}' is not one of {', '.join(PROJECTION_KINDS)}")
        if width < 1:
            raise ConfigError(f"grads.projection_dim must be a positive integer, got {width}")
        self.kind, self.width, self.seed = kind, int(width), int(seed)
        self._cache: dict[tuple[str, int, str], Any] = {}

    def out_dim(self, dim: int) -> int:
        return min(dim, self.width)

    def project(self, name: str, grads: Any) -> Any:
        """``[rows, dim]`` -> ``[rows, out_dim(dim)]``, in ``grads``' dtype and device."""
        import torch

        dim = grads.shape[1]
        if dim <= self.width:
            return grads
        key = (name, dim, str(grads.device))
        if key not in self._cache:
            gen = torch.Generator(device="cpu").manual_seed(_block_seed(self.seed, name))
            if self.kind == "countsketch":
                buckets = torch.randint(0, self.width, (dim,), generator=gen)
                signs = torch.randint(0, 2, (dim,), generator=gen) * 2 - 1
                self._cache[key] = (buckets.to(grads.device), signs.to(grads.device))
            else:
                signs = torch.randint(0, 2, (self.width, dim), generator=gen, dtype=torch.int8) * 2 - 1
                self._cache[key] = signs.to(grads.device)
        if self.kind == "countsketch":
            buckets, signs = self._cache[key]
            out = torch.zeros((grads.shape[0], self.width), dtype=grads.dtype, device=grads.device)
            return out.index_add_(1, buckets, grads * signs.to(grads.dtype))
        matrix = self._cache[key].to(grads.dtype)
        return (grads @ matrix.T) / math.sqrt(self.width)
