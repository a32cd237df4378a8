"""Log-probabilities of a completion given its prompt, under the same loss mask as training.

Each (prompt turns, completion) pair is turned into a one-row conversation and tokenized by
``gradian.data.tokenize_examples``, so the scored tokens are exactly the ones a fine-tune on that
row would supervise: the assistant's content plus whatever the chat template closes the turn with
(end-of-turn or EOS). Without a chat template the data layer supervises the whole sequence; here
the tokens of the rendered prompt are then masked out again, so the score stays conditional on
the prompt.

``total`` is ``sum_t log p(y_t | prompt, y_<t)`` in nats over the scored tokens; ``mean`` divides
by their count. Sums are accumulated in float64 from a float32-or-wider log-softmax.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from gradian.data import IGNORE_INDEX, dataset_from_rows, render_prompt, tokenize_examples

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from gradian.data import Example

__all__ = ["CompletionLogprob", "base_losses", "completion_logprobs", "evaluating", "example_logprobs"]


@dataclass(frozen=True)
class CompletionLogprob:
    """Log-probability of one completion: ``total`` nats over ``n_tokens`` scored tokens."""

    total: float
    n_tokens: int

    @property
    def mean(self) -> float:
        """Nats per scored token; ``-inf`` when nothing was scored."""
        return self.total / self.n_tokens if self.n_tokens else float("-inf")


def _masked_rows(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sequence[dict[str, str]]],
                 completions: Sequence[str]) -> list[tuple[list[int], list[int]]]:
    rows = [
        {"messages": [dict(t) for t in prompt] + [{"role": "assistant", "content": completion}]}
        for prompt, completion in zip(prompts, completions)
    ]
    dataset = dataset_from_rows(rows, name="<eval completions>")
    tokenized = tokenize_examples(dataset.examples, tokenizer, max_seq_length=None)
    out = []
    for prompt, tok in zip(prompts, tokenized):
        labels = list(tok.labels)
        if tok.whole_sequence:
            prefix = tokenizer(render_prompt(tokenizer, list(prompt)), add_special_tokens=False)["input_ids"]
            if tok.input_ids[:len(prefix)] == prefix:
                labels[:len(prefix)] = [IGNORE_INDEX] * len(prefix)
        out.append((list(tok.input_ids), labels))
    return out


def completion_logprobs(
    model: PreTrainedModel | PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[dict[str, str]]],
    completions: Sequence[str],
    *,
    batch_size: int = 8,
) -> list[CompletionLogprob]:
    """``log p(completion | prompt)`` under ``model`` for each pair, in input order.

    Uses whatever adapter state the model is in: call it inside ``model.disable_adapter()`` to
    score the base model.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions; pass one completion per prompt")
    return _row_logprobs(model, tokenizer, _masked_rows(tokenizer, prompts, completions), batch_size)


def example_logprobs(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase,
                     examples: Sequence[Example], max_seq_length: int | None, *,
                     batch_size: int = 8) -> list[CompletionLogprob]:
    """``log p`` of each training example's supervised tokens under ``model``, tokenized and masked
    as the gradient lanes read it (``max_seq_length`` is ``grads.max_seq_length``), in input order.
    Like ``completion_logprobs``, it uses the adapter state the model is in."""
    tokenized = tokenize_examples(list(examples), tokenizer, max_seq_length)
    return _row_logprobs(model, tokenizer, [(list(t.input_ids), list(t.labels)) for t in tokenized], batch_size)


def base_losses(model: PeftModel, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
                max_seq_length: int | None, *, batch_size: int = 8) -> list[float | None]:
    """Each training example's loss under the base model (``model`` with its adapter disabled), in
    nats summed over its supervised tokens as the gradient lanes mask them; None for a row with no
    supervised token (it has no loss to read, and no gradient)."""
    with evaluating(model), model.disable_adapter():
        scored = example_logprobs(model, tokenizer, examples, max_seq_length, batch_size=batch_size)
    return [-lp.total if lp.n_tokens else None for lp in scored]


@contextmanager
def evaluating(model: PreTrainedModel | PeftModel) -> Iterator[None]:
    """``model`` in eval mode (no dropout) inside the block, back in the mode it was in after."""
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _row_logprobs(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase,
                  rows: Sequence[tuple[list[int], list[int]]], batch_size: int) -> list[CompletionLogprob]:
    """The summed log-probability of each row's labelled tokens, ``rows`` as ``(input_ids, labels)``."""
    import torch

    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out: list[CompletionLogprob] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        # right padding: a causal model's real tokens never attend to what comes after them
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (row_ids, row_labels) in enumerate(chunk):
            ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
            labels[r, :len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
            mask[r, :len(row_ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        logits = logits[:, :-1].float() if logits.dtype in (torch.float16, torch.bfloat16) else logits[:, :-1]
        targets = labels[:, 1:].to(logits.device)
        scored = targets != IGNORE_INDEX
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(scored, picked, torch.zeros_like(picked)).double()
        totals = picked.sum(dim=1).tolist()
        counts = scored.sum(dim=1).tolist()
        out.extend(CompletionLogprob(float(t), int(c)) for t, c in zip(totals, counts))
    return out
