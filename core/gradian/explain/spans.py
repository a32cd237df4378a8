"""Per-token influence of one training example, aggregated to words and sentences.

A training example's loss is ``L = w sum_t l_t`` over its supervised tokens (``w = 1/T`` for
``loss_reduction: mean``, 1 for ``sum``), so its score against the preconditioned query
direction ``d`` splits exactly into token terms:

    score = N <grad L, d> = sum_t  N w <grad l_t, d>  =:  sum_t c_t

(``N`` the index's normalization of the example's gradient: 1, ``1/|grad L|`` for ``l2``,
``1/T`` for ``token_count``). ``c_t`` is token ``t``'s contribution in the engine's units, with
the engine's sign: negative means that token's loss pushed the model away from the queried
behaviour. All ``<grad l_t, d>`` come from one double-backward pass: with weights ``u`` (all
ones) on the token losses, ``d/du_t <grad_theta sum_s u_s l_s, d> = <grad l_t, d>``. This is
exact where the alternatives are not: a leave-span-out difference re-normalizes the mean loss
(the left-out span also changes every other token's weight), and masking labels one token at a
time costs one backward per token.

Interface: ``score_example_spans(gm, tokenizer, example, direction, grads_config, ...) ->
SpanExplanation``: tokens, words and sentences with their contributions, ``span`` the most
harmful sentence, and ``token_sum`` (which equals the engine's score of the example).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradsConfig
    from gradian.data import Example
    from gradian.explain.direction import QueryDirection
    from gradian.grads.model import GradientModel
    from gradian.jsontypes import JsonObject

__all__ = ["SpanExplanation", "TextPiece", "score_example_spans", "split_sentences", "split_words"]

_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)")
_WORD = re.compile(r"\S+")


@dataclass
class TextPiece:
    """A token, word or sentence of the example's supervised text: ``[start, end)`` and its score."""

    text: str
    start: int
    end: int
    score: float


@dataclass
class SpanExplanation:
    """Where inside one training example its influence on the query sits.

    ``text`` is the supervised part of the example as rendered (the answer); offsets index it.
    ``score`` is the engine's score of the whole example against this query and ``token_sum`` the
    sum of the token contributions (equal up to rounding). ``span`` is the sentence with the most
    negative contribution (the harmful span), or None when no sentence is harmful.
    """

    example_id: str
    item_id: str
    engine: str
    signal: str
    text: str
    token_sum: float
    tokens: list[TextPiece]
    words: list[TextPiece]
    sentences: list[TextPiece]
    span: TextPiece | None
    score: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> JsonObject:
        """The report's ``attribution.spans`` row: ids, text, span offsets, words and sentences."""
        out = asdict(self)
        out.pop("tokens")
        out["span_start"] = self.span.start if self.span else None
        out["span_end"] = self.span.end if self.span else None
        out["span_text"] = self.span.text if self.span else ""
        out["span_score"] = self.span.score if self.span else None
        return out


def split_words(text: str) -> list[tuple[int, int]]:
    """Whitespace-separated words as ``(start, end)``."""
    return [(m.start(), m.end()) for m in _WORD.finditer(text)]


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Sentences (ending in ``.``, ``!``, ``?``, a newline or the text's end) as ``(start, end)``, stripped."""
    out = []
    for m in _SENTENCE.finditer(text):
        start, end = m.start(), m.end()
        while start < end and text[start].isspace():
            start += 1
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            out.append((start, end))
    return out


def _aggregate(text: str, bounds: list[tuple[int, int]], tokens: list[TextPiece]) -> list[TextPiece]:
    """Sum token contributions into the pieces ``bounds``; a token counts where its first letter is."""
    pieces = [TextPiece(text[a:b], a, b, 0.0) for a, b in bounds]
    j = 0
    for tok in sorted(tokens, key=lambda t: t.start):
        anchor = tok.start + (len(tok.text) - len(tok.text.lstrip()))
        while j < len(pieces) and pieces[j].end <= anchor:
            j += 1
        if j < len(pieces) and pieces[j].start <= anchor < pieces[j].end:
            pieces[j].score += tok.score
        elif j > 0 and pieces[j - 1].end <= anchor and anchor < (pieces[j].start if j < len(pieces) else len(text) + 1):
            pieces[j - 1].score += tok.score  # trailing space or punctuation: the piece before it
    return pieces


def _token_dots(gm: GradientModel, input_ids: torch.Tensor, labels: torch.Tensor,
                direction: QueryDirection) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(``<grad l_t, d>`` per supervised token, their positions, ``|grad sum_t l_t|``)."""
    import torch

    linears = [lin for block in gm.blocks for lin in block.linears]
    weights = [lin.weight for lin in linears]
    d = [direction.per_linear[id(lin)] for lin in linears]
    with torch.enable_grad():
        logits = gm.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        upcast = torch.promote_types(logits.dtype, torch.float32)
        target = labels[:, 1:]
        keep = target != -100
        logp = torch.log_softmax(logits[:, :-1].to(upcast), dim=-1)
        token_loss = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep]
        u = torch.ones_like(token_loss, requires_grad=True)
        grads = torch.autograd.grad((u * token_loss).sum(), weights, create_graph=True)
        along = sum((g.to(upcast) * dd.to(upcast)).sum() for g, dd in zip(grads, d))
        (dots,) = torch.autograd.grad(along, u)
    norm = float(torch.sqrt(sum((g.detach().double() ** 2).sum() for g in grads)))
    positions = torch.nonzero(keep[0]).flatten() + 1  # label index of each supervised token
    return dots.detach().double().cpu(), positions.cpu(), norm


def score_example_spans(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, example: Example,
                        direction: QueryDirection, grads_config: GradsConfig, *,
                        item_id: str = "", signal: str = "", score: float | None = None) -> SpanExplanation:
    """Token, word and sentence contributions of ``example`` (a ``gradian.data.Example``) to ``direction``.

    ``direction`` is a ``QueryDirection`` (``gradian.explain.direction``); ``grads_config`` the
    index's ``GradsConfig`` (its loss reduction, normalization and ``max_seq_length``); ``score``
    the engine's score of the example, recorded beside ``token_sum`` for comparison.
    """
    import torch

    from gradian.data import tokenize_examples
    from gradian.data.tokenize import render_example

    tokenized = tokenize_examples([example], tokenizer, grads_config.max_seq_length)[0]
    input_ids = torch.tensor([tokenized.input_ids], dtype=torch.long, device=gm.device)
    labels = torch.tensor([tokenized.labels], dtype=torch.long, device=gm.device)
    dots, positions, norm = _token_dots(gm, input_ids, labels, direction)
    n_tokens = max(len(dots), 1)
    weight = 1.0 / n_tokens if grads_config.loss_reduction == "mean" else 1.0
    scale = {"none": 1.0, "l2": 1.0 / max(weight * norm, 1e-300), "token_count": 1.0 / n_tokens}[
        grads_config.normalization]
    contributions = (dots * weight * scale).tolist()

    rendered = render_example(tokenizer, example)[0]
    offsets = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = [tuple(offsets[p]) if p < len(offsets) else (len(rendered), len(rendered)) for p in positions.tolist()]
    lo = min((a for a, b in spans if b > a), default=0)
    hi = max((b for a, b in spans if b > a), default=0)
    text = rendered[lo:hi]
    eos = tokenizer.eos_token or ""
    if eos and text.endswith(eos):
        text = text[: -len(eos)]
    tokens = [TextPiece(rendered[a:b], a - lo, b - lo, float(c)) for (a, b), c in zip(spans, contributions)]
    shown = [t for t in tokens if t.end <= len(text)]
    words = _aggregate(text, split_words(text), shown)
    sentences = _aggregate(text, split_sentences(text), shown)
    harmful = [s for s in sentences if s.score < 0]
    span = min(harmful, key=lambda s: s.score) if harmful else None
    return SpanExplanation(
        example_id=example.id, item_id=item_id, engine=direction.engine, signal=signal, text=text,
        token_sum=float(sum(contributions)), tokens=tokens, words=words, sentences=sentences, span=span,
        score=score, notes=list(direction.notes),
    )
