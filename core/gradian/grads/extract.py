"""From tokenized examples to stored-ready per-example gradients, batch by batch.

Interface: ``iter_example_gradients(gm, tokenized, grads_config, pad_id)`` yields
``(start, {block: float32 ndarray [rows, width]})`` in dataset order, after the optional
normalization and projection of ``grads_config``. ``gradient_widths`` gives each block's stored
width. The index builder and the query builder both go through here, so a query is measured in
exactly the space its training examples are stored in.

Normalization (applied to the whole example's gradient, before projection):
``none``; ``l2``: unit norm over all blocks together; ``token_count``: divided by the example's
supervised token count (meant for ``loss_reduction: sum``, where it recovers a per-token scale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Literal, Sequence, overload

from gradian.errors import ConfigError
from gradian.grads.capture import capture_per_example_grads
from gradian.grads.loss import collate
from gradian.grads.projection import BlockProjector, KroneckerProjector, projection_of

if TYPE_CHECKING:
    import numpy as np
    import torch

    from gradian.config import GradsConfig
    from gradian.data import TokenizedExample
    from gradian.grads.model import GradientModel

__all__ = ["iter_example_gradients", "gradient_widths", "make_projector", "NORMALIZATIONS"]

NORMALIZATIONS = ("none", "l2", "token_count")


def make_projector(grads_config: GradsConfig,
                   gm: GradientModel | None = None) -> BlockProjector | KroneckerProjector | None:
    """The projection ``grads_config`` asks for (None when ``projection_dim`` is null); the
    ``kronecker`` kind needs ``gm``, whose blocks give each LoRA matrix's shape."""
    if grads_config.projection_dim is None:
        return None
    if grads_config.projection_kind == "kronecker" and gm is None:
        raise ConfigError("grads.projection_kind kronecker needs the model's LoRA shapes (make_projector(grads, gm))")
    return projection_of(grads_config.projection_kind, grads_config.projection_dim, grads_config.projection_seed,
                         gm.blocks if gm is not None else ())


def gradient_widths(gm: GradientModel, grads_config: GradsConfig) -> dict[str, int]:
    """Stored width of each block: its dim, or what its projection keeps when that is smaller."""
    projector = make_projector(grads_config, gm)
    return {b.name: (projector.block_width(b) if projector else b.dim) for b in gm.blocks}


def normalize_rows(grads: dict[str, torch.Tensor], how: str, n_supervised: torch.Tensor) -> dict[str, torch.Tensor]:
    import torch

    if how == "none":
        return grads
    if how == "l2":
        total = torch.sqrt(sum((g.double() ** 2).sum(dim=1) for g in grads.values()))
        scale = 1.0 / total.clamp(min=1e-30)
    elif how == "token_count":
        scale = 1.0 / n_supervised.double().clamp(min=1)
    else:
        raise ConfigError(f"grads.normalization '{how}' is not one of {', '.join(NORMALIZATIONS)}")
    return {k: g * scale.to(g.dtype).unsqueeze(1) for k, g in grads.items()}


@overload
def iter_example_gradients(gm: GradientModel, tokenized: Sequence[TokenizedExample], grads_config: GradsConfig,
                           pad_id: int, start: int = 0, projector: BlockProjector | KroneckerProjector | None = None,
                           as_numpy: Literal[True] = True) -> Iterator[tuple[int, dict[str, np.ndarray]]]: ...


@overload
def iter_example_gradients(gm: GradientModel, tokenized: Sequence[TokenizedExample], grads_config: GradsConfig,
                           pad_id: int, start: int = 0, projector: BlockProjector | KroneckerProjector | None = None,
                           *, as_numpy: Literal[False]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]: ...


def iter_example_gradients(
    gm: GradientModel, tokenized: Sequence[TokenizedExample], grads_config: GradsConfig, pad_id: int,
    start: int = 0, projector: BlockProjector | KroneckerProjector | None = None, as_numpy: bool = True,
) -> Iterator[tuple[int, dict[str, np.ndarray] | dict[str, torch.Tensor]]]:
    """Yield ``(offset, {block: [rows, width]})`` for ``tokenized[start:]`` in batches."""
    import torch

    projector = projector if projector is not None else make_projector(grads_config, gm)
    size = grads_config.batch_size
    for offset in range(start, len(tokenized), size):
        rows = tokenized[offset : offset + size]
        batch = collate(rows, pad_id, gm.device)
        grads = capture_per_example_grads(gm, batch, grads_config.strategy, grads_config.loss_reduction)
        grads = normalize_rows(grads, grads_config.normalization, batch.n_supervised)
        if projector is not None:
            grads = {k: projector.project(k, g) for k, g in grads.items()}
        if as_numpy:
            grads = {k: g.detach().to(torch.float64 if g.dtype == torch.float64 else torch.float32).cpu().numpy()
                     for k, g in grads.items()}
        yield offset, grads
