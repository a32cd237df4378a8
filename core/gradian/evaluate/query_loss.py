"""The query's own loss on the base and the tuned model: what the regression cost, in its units.

Every attribution score is a first-order change of one function, the query loss
``Q = mean over the query items of l(wanted)`` (target) or ``l(wanted) - l(generated)``
(contrastive; ``l(wanted)`` alone for an item still answered right, ``QueryItem.kept``), with ``l(text)`` the loss of ``text`` as the assistant's answer to the item's
prompt, per supervised token under ``grads.loss_reduction: mean`` and summed under ``sum``.
``query_loss_change`` measures ``Q`` with the adapter on and off, so the report can say how much
the regressed items' loss rose, in nats, and state a row set's harm as a part of that rise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gradian.evaluate.likelihood import CompletionLogprob, completion_logprobs, evaluating

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from gradian.query import QueryItem

__all__ = ["QueryLossChange", "query_loss_change", "wanted_loglik_drops"]

_UNITS = {"mean": "nats per token", "sum": "nats"}


@dataclass(frozen=True)
class QueryLossChange:
    """``Q`` on the base and the tuned model over ``n_items`` query items, in ``unit``."""

    signal: str
    unit: str
    base: float
    tuned: float
    n_items: int

    @property
    def rise(self) -> float:
        """``tuned - base``: how much the fine-tune raised the query loss (positive: it got worse)."""
        return self.tuned - self.base


def _loss(lp: CompletionLogprob, reduction: str) -> float:
    if lp.n_tokens == 0:
        return math.nan
    return -(lp.total / lp.n_tokens if reduction == "mean" else lp.total)


def _query_loss(model: PeftModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[QueryItem], signal: str,
                reduction: str, batch_size: int) -> float:
    prompts = [item.prompt_messages for item in items]
    wanted = completion_logprobs(model, tokenizer, prompts, [i.wanted for i in items], batch_size=batch_size)
    losses = [_loss(w, reduction) for w in wanted]
    if signal == "contrastive":  # an item still answered right (kept) has no other answer to subtract
        contrasted = [k for k, item in enumerate(items) if item.contrasts]
        said = completion_logprobs(model, tokenizer, [prompts[k] for k in contrasted],
                                   [items[k].generated or "" for k in contrasted], batch_size=batch_size)
        for k, s in zip(contrasted, said):
            losses[k] -= _loss(s, reduction)
    kept = [x for x in losses if math.isfinite(x)]
    return sum(kept) / len(kept) if kept else math.nan


def query_loss_change(model: PeftModel, tokenizer: PreTrainedTokenizerBase, items: Sequence[QueryItem], signal: str,
                      reduction: str = "mean", *, batch_size: int = 8) -> QueryLossChange:
    """``Q`` of ``items`` (the query's items and its signal, ``contrastive`` or ``target``) with the
    adapter on and with it disabled; ``reduction`` is ``grads.loss_reduction``."""
    if reduction not in _UNITS:
        raise ValueError(f"loss reduction {reduction!r} is not one of {', '.join(_UNITS)}")
    with evaluating(model):
        tuned = _query_loss(model, tokenizer, items, signal, reduction, batch_size)
        with model.disable_adapter():
            base = _query_loss(model, tokenizer, items, signal, reduction, batch_size)
    return QueryLossChange(signal=signal, unit=_UNITS[reduction], base=base, tuned=tuned, n_items=len(items))


def wanted_loglik_drops(model: PeftModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sequence[dict[str, str]]],
                        wanted: Sequence[str], *, batch_size: int = 8) -> list[float]:
    """Per item, ``log p_base(wanted) - log p_tuned(wanted)`` in nats (summed over the answer's
    supervised tokens): how much likelihood the fine-tune took from the wanted answer (negative:
    it gained some)."""
    with evaluating(model):
        tuned = completion_logprobs(model, tokenizer, prompts, wanted, batch_size=batch_size)
        with model.disable_adapter():
            base = completion_logprobs(model, tokenizer, prompts, wanted, batch_size=batch_size)
    return [b.total - t.total for b, t in zip(base, tuned)]
