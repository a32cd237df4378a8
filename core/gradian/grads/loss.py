"""Per-example language-model loss, computed from logits by this project.

Interface: ``collate(tokenized, pad_id, device)`` pads ``TokenizedExample`` rows on the right into
a ``TokenBatch``; ``per_example_loss(logits, labels, reduction)`` returns one loss per row.

Why not ``model(labels=...)``: some models route ``labels`` into fused cross-entropy kernels that
never materialize logits, and the gradient capture needs the plain autograd graph.

Memory: the model's logits ``[rows, tokens, vocab]`` stay in the model's dtype. Only supervised
positions are read, and they are upcast to float32 (float64 stays float64) and reduced in chunks
of at most ``LOSS_CHUNK_BYTES`` of upcast values, in the forward and again in the backward
(``_ChunkedCrossEntropy`` keeps one log-sum-exp per position, not the softmax). So the upcast costs
one chunk, not ``supervised_tokens x vocab x 4`` bytes three times over (copy, saved log-softmax,
its gradient) as ``F.cross_entropy`` on the gathered rows did; the only full-size tensors are the
logits the model returned and their gradient, both in the model's dtype.

Right padding is deliberate: under causal attention, pad tokens at the end cannot influence the
real positions before them, so a padded row's loss and gradient equal the unpadded row's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gradian.data import IGNORE_INDEX

if TYPE_CHECKING:
    import torch
    from torch.autograd.function import FunctionCtx

    from gradian.data import TokenizedExample

__all__ = ["TokenBatch", "collate", "per_example_loss", "loss_chunk_positions", "LOSS_REDUCTIONS", "LOSS_CHUNK_BYTES"]

LOSS_REDUCTIONS = ("mean", "sum")

#: upcast logits held at once by the loss, forward or backward (one chunk of positions x vocab)
LOSS_CHUNK_BYTES = 64 << 20


@dataclass
class TokenBatch:
    """Right-padded token ids, attention mask and labels (``IGNORE_INDEX`` where unsupervised)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    example_ids: list[str]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def row(self, i: int) -> "TokenBatch":
        """Row ``i`` alone, with its padding stripped."""
        length = int(self.attention_mask[i].sum())
        return TokenBatch(
            self.input_ids[i : i + 1, :length],
            self.attention_mask[i : i + 1, :length],
            self.labels[i : i + 1, :length],
            [self.example_ids[i]],
        )

    @property
    def n_supervised(self) -> torch.Tensor:
        """Supervised (loss-bearing) tokens per row, after the one-token shift."""
        return (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def collate(tokenized: Sequence[TokenizedExample], pad_id: int, device: torch.device | str | None = None) -> TokenBatch:
    """Pad ``TokenizedExample`` rows (``input_ids``, ``labels``) on the right into tensors."""
    import torch

    width = max(len(t.input_ids) for t in tokenized)
    ids = torch.full((len(tokenized), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(tokenized), width), dtype=torch.long)
    labels = torch.full((len(tokenized), width), IGNORE_INDEX, dtype=torch.long)
    for i, t in enumerate(tokenized):
        n = len(t.input_ids)
        ids[i, :n] = torch.tensor(t.input_ids, dtype=torch.long)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(t.labels, dtype=torch.long)
    example_ids = [getattr(t, "example_id", str(i)) for i, t in enumerate(tokenized)]
    if device is not None:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    return TokenBatch(ids, mask, labels, example_ids)


def loss_chunk_positions(vocab: int, upcast_bytes: int = 4) -> int:
    """Positions per chunk of the loss: as many ``vocab``-wide upcast rows as fit ``LOSS_CHUNK_BYTES``."""
    return max(1, LOSS_CHUNK_BYTES // max(1, vocab * upcast_bytes))


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                     chunk_positions: int | None = None) -> torch.Tensor:
    """Next-token cross-entropy per row, in nats: shape ``[batch]``, float32 (float64 for float64 logits).

    ``mean`` averages over the row's supervised tokens, ``sum`` adds them. A row with no
    supervised token has loss 0 (and so a zero gradient). ``chunk_positions`` (default: from
    ``LOSS_CHUNK_BYTES``) bounds how many positions are upcast at once; it changes no number.
    """
    import torch

    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    rows_n, width, vocab = logits.shape
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    rows, cols = keep.nonzero(as_tuple=True)
    # position (row, col) of the logits predicts label (row, col + 1)
    positions = rows * width + cols
    upcast = torch.promote_types(logits.dtype, torch.float32)
    chunk = chunk_positions or loss_chunk_positions(vocab, torch.empty((), dtype=upcast).element_size())
    token_loss = _ChunkedCrossEntropy.apply(logits.reshape(rows_n * width, vocab), positions, shifted[keep], int(chunk))
    out = torch.zeros(rows_n, dtype=upcast, device=logits.device)
    out = out.index_add(0, rows, token_loss)
    if reduction == "mean":
        out = out / keep.sum(dim=1).clamp(min=1).to(upcast)
    return out


def _chunk_log_sum_exp(flat: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, chunk: int,
                       upcast: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse)`` per position: ``lse = log sum_v exp z_v`` and ``loss = lse - z_target``."""
    import torch

    n = positions.numel()
    loss = torch.empty(n, dtype=upcast, device=flat.device)
    lse = torch.empty(n, dtype=upcast, device=flat.device)
    for s in range(0, n, chunk):
        z = flat.index_select(0, positions[s : s + chunk]).to(upcast)
        part = torch.logsumexp(z, dim=1)
        lse[s : s + chunk] = part
        loss[s : s + chunk] = part - z.gather(1, targets[s : s + chunk].unsqueeze(1)).squeeze(1)
    return loss, lse


def _cross_entropy_class() -> type[torch.autograd.Function]:
    import torch

    class ChunkedCrossEntropy(torch.autograd.Function):
        """Cross-entropy of ``flat[positions]`` against ``targets``, upcast chunk by chunk.

        Backward: ``d loss_p / d z_p = softmax(z_p) - onehot(target_p)``, recomputed per chunk from
        the saved log-sum-exp and written into a gradient of ``flat``'s shape and dtype.
        """

        @staticmethod
        def forward(ctx: FunctionCtx, flat: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                    chunk: int) -> torch.Tensor:
            upcast = torch.promote_types(flat.dtype, torch.float32)
            loss, lse = _chunk_log_sum_exp(flat, positions, targets, chunk, upcast)
            ctx.save_for_backward(flat, positions, targets, lse)
            ctx.chunk = chunk
            return loss

        @staticmethod
        def backward(ctx: FunctionCtx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
            flat, positions, targets, lse = ctx.saved_tensors
            grad = torch.zeros_like(flat)
            upcast = lse.dtype
            for s in range(0, positions.numel(), ctx.chunk):
                where = positions[s : s + ctx.chunk]
                # index_select copies, so the upcast chunk can be turned into the softmax in place
                p = flat.index_select(0, where).to(upcast)
                p.sub_(lse[s : s + ctx.chunk].unsqueeze(1)).exp_()
                p.scatter_add_(1, targets[s : s + ctx.chunk].unsqueeze(1),
                               torch.full((where.numel(), 1), -1.0, dtype=upcast, device=p.device))
                p.mul_(grad_loss[s : s + ctx.chunk].unsqueeze(1))
                grad.index_copy_(0, where, p.to(grad.dtype))
            return grad, None, None, None

    return ChunkedCrossEntropy


class _LazyFunction:
    """Builds the autograd.Function on first use, so importing this module does not import torch."""

    def __init__(self) -> None:
        self._cls: type[torch.autograd.Function] | None = None

    def apply(self, *args: torch.Tensor | int) -> torch.Tensor:
        if self._cls is None:
            self._cls = _cross_entropy_class()
        return self._cls.apply(*args)


_ChunkedCrossEntropy = _LazyFunction()
