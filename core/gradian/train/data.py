"""Training batches built from the project's own tokenization and loss mask.

Interface: ``build_train_features(dataset, tokenizer, max_seq_length) -> TrainFeatures`` and
``PadCollator``. Training goes through ``gradian.data.tokenize_examples``, the function the audit
and attribution use, so the tokens a run was trained on are the tokens later lanes score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gradian.data import IGNORE_INDEX, Dataset, tokenize_examples
from gradian.errors import DatasetError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = ["TrainFeatures", "PadCollator", "build_train_features"]


@dataclass
class TrainFeatures:
    """Rows ready for the trainer, plus what tokenization cost."""

    rows: list[dict[str, list[int]]]
    #: ids of examples whose loss mask is empty after truncation; they are left out of
    #: training because a batch made only of them has a 0/0 loss (NaN weights), while
    #: inside a mixed batch they change nothing anyway
    without_supervised_tokens: list[str] = field(default_factory=list)
    n_truncated: int = 0
    n_completion_truncated: int = 0


def build_train_features(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_seq_length: int) -> TrainFeatures:
    tokenized = tokenize_examples(dataset.examples, tokenizer, max_seq_length)
    features = TrainFeatures(rows=[])
    for t in tokenized:
        features.n_truncated += int(t.truncated)
        features.n_completion_truncated += int(t.n_completion_lost > 0)
        if t.n_supervised == 0:
            features.without_supervised_tokens.append(t.example_id)
            continue
        features.rows.append({"input_ids": list(t.input_ids), "labels": list(t.labels)})
    if not features.rows:
        raise DatasetError(
            f"{dataset.path}: none of the {len(tokenized)} examples keeps a supervised token at "
            f"max_seq_length={max_seq_length}; raise train.max_seq_length"
        )
    return features


class PadCollator:
    """Right-pads ``input_ids`` with the pad id and ``labels`` with the ignore index."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        import torch

        width = max(len(row["input_ids"]) for row in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, row in enumerate(batch):
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.tensor(row["labels"], dtype=torch.long)
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
