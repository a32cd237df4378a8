"""Per-example language-model loss, computed from logits by this project.

Interface: ``collate(tokenized, pad_id, device)`` pads ``TokenizedExample`` rows on the right into
a ``TokenBatch``; ``per_example_loss(logits, labels, reduction)`` returns one loss per row.

Why not ``model(labels=...)``: some models route ``labels`` into fused cross-entropy kernels that
never materialize logits, and the gradient capture needs the plain autograd graph. Why gather
first: only supervised positions reach the fp32 upcast, so prompt and padding tokens cost no
memory there (the peak is ``supervised_tokens x vocab x 4`` bytes, not ``sequence x vocab x 4``).

Right padding is deliberate: under causal attention, pad tokens at the end cannot influence the
real positions before them, so a padded row's loss and gradient equal the unpadded row's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from gradian.data import IGNORE_INDEX

__all__ = ["TokenBatch", "collate", "per_example_loss", "LOSS_REDUCTIONS"]

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass
class TokenBatch:
    """Right-padded token ids, attention mask and labels (``IGNORE_INDEX`` where unsupervised)."""

    input_ids: Any
    attention_mask: Any
    labels: Any
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
    def n_supervised(self) -> Any:
        """Supervised (loss-bearing) tokens per row, after the one-token shift."""
        return (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def collate(tokenized: Sequence[Any], pad_id: int, device: Any = None) -> TokenBatch:
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


def per_example_loss(logits: Any, labels: Any, reduction: str = "mean") -> Any:
    """Next-token cross-entropy per row, in nats: shape ``[batch]``.

    ``mean`` averages over the row's supervised tokens, ``sum`` adds them. A row with no
    supervised token has loss 0 (and so a zero gradient).
    """
    import torch
    import torch.nn.functional as F

    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss reduction must be one of {LOSS_REDUCTIONS}, got {reduction!r}")
    shifted = labels[:, 1:]
    keep = shifted != IGNORE_INDEX
    rows = keep.nonzero(as_tuple=True)[0]
    # Gather the supervised positions first, then upcast: the fp32 copy is supervised x vocab.
    picked = logits[:, :-1][keep]
    upcast = torch.promote_types(picked.dtype, torch.float32)
    token_loss = F.cross_entropy(picked.to(upcast), shifted[keep], reduction="none")
    out = torch.zeros(labels.shape[0], dtype=upcast, device=logits.device)
    out = out.index_add(0, rows, token_loss)
    if reduction == "mean":
        out = out / keep.sum(dim=1).clamp(min=1).to(upcast)
    return out
