"""Tokenization and loss masks: the one place every lane turns an Example into tokens.

With a chat template, the conversation is rendered once and each assistant turn's character span
is found by rendering the prefix before it (with the generation prompt) and the prefix through
it. Tokens whose offsets fall inside an assistant span are supervised: the assistant's content
plus whatever the template closes the turn with (end-of-turn / EOS, where the template puts it).

Without a chat template the turns are joined with newlines, EOS is appended, and the whole
sequence is supervised; ``whole_sequence`` records that fallback. Text rows are always supervised
whole.

Truncation keeps the first ``max_seq_length`` tokens and records how many supervised tokens fell
off the end (``n_completion_lost``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from gradian.data.rows import Example
from gradian.errors import DatasetError

__all__ = [
    "IGNORE_INDEX",
    "TokenizedExample",
    "tokenize_examples",
    "render_example",
    "render_prompt",
    "has_chat_template",
]

#: label value of positions the loss skips (the convention of HF causal LMs)
IGNORE_INDEX = -100


@dataclass
class TokenizedExample:
    example_id: str
    input_ids: list[int]
    #: token id where supervised, IGNORE_INDEX elsewhere; same length as input_ids
    labels: list[int]
    #: tokens before truncation
    n_tokens_full: int
    #: tokens before the first supervised token (before truncation)
    n_prompt_tokens: int
    #: supervised tokens before truncation
    n_completion_tokens: int
    #: supervised tokens cut off by max_seq_length
    n_completion_lost: int
    truncated: bool
    #: the last supervised token, before truncation, is the tokenizer's EOS
    ends_with_eos: bool
    #: supervised tokens that belong to system/user turns (only under the whole-sequence fallback)
    prompt_tokens_in_mask: int
    #: no chat template (or a text row): every token is supervised
    whole_sequence: bool
    #: the template rendered this conversation's prefixes as string prefixes of the whole
    prefix_stable: bool = True

    @property
    def n_supervised(self) -> int:
        """Supervised tokens that survived truncation."""
        return self.n_completion_tokens - self.n_completion_lost

    @property
    def supervised_positions(self) -> list[int]:
        return [i for i, label in enumerate(self.labels) if label != IGNORE_INDEX]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """The text a model is given to produce the next assistant turn (for generation)."""
    if has_chat_template(tokenizer):
        return _render(tokenizer, messages, generation_prompt=True)
    return "\n".join(t["content"] for t in messages) + "\n"


def render_example(tokenizer: Any, example: Example) -> tuple[str, list[tuple[int, int]], bool, bool]:
    """(text, supervised char spans, whole_sequence, prefix_stable) for one example."""
    if not example.is_chat:
        return (example.text or "") + (tokenizer.eos_token or ""), [], True, True
    if not has_chat_template(tokenizer):
        text = "\n".join(t["content"] for t in example.messages) + (tokenizer.eos_token or "")
        return text, [], True, True
    messages = example.messages
    try:
        full = _render(tokenizer, messages, generation_prompt=False)
        spans: list[tuple[int, int]] = []
        stable = True
        cursor = 0
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before = _render(tokenizer, messages[:i], generation_prompt=True)
            last = i == len(messages) - 1
            through = full if last else _render(tokenizer, messages[: i + 1], generation_prompt=False)
            if full.startswith(before) and full.startswith(through) and len(through) >= len(before):
                spans.append((len(before), len(through)))
                cursor = len(through)
                continue
            # The template rewrites earlier turns (some strip reasoning from past turns): fall back
            # to locating the assistant content in the full rendering.
            stable = False
            start = full.find(turn["content"], cursor) if turn["content"] else -1
            if start < 0:
                continue
            end = start + len(turn["content"])
            eos = tokenizer.eos_token or ""
            if eos and full.startswith(eos, end):
                end += len(eos)
            spans.append((start, end))
            cursor = end
    except Exception as err:  # jinja raises its own types; a template may also raise on purpose
        raise DatasetError(
            f"example {example.id}: the tokenizer's chat template failed to render it ({err})"
        ) from None
    return full, [_trim_after_eos(full, span, tokenizer.eos_token) for span in spans], False, stable


def _trim_after_eos(full: str, span: tuple[int, int], eos: str | None) -> tuple[int, int]:
    """Drop whitespace a template writes after the turn's EOS (Qwen's newline after im_end)."""
    start, end = span
    segment = full[start:end].rstrip()
    if eos and segment.endswith(eos):
        return start, start + len(segment)
    return span


def tokenize_examples(
    examples: Iterable[Example],
    tokenizer: Any,
    max_seq_length: int | None,
    batch_size: int = 512,
) -> list[TokenizedExample]:
    """Tokenize with the loss mask every lane shares. Requires a fast tokenizer (offsets)."""
    if not getattr(tokenizer, "is_fast", False):
        raise DatasetError(
            f"{type(tokenizer).__name__} is a slow tokenizer; loss masks need character offsets. "
            "Load the fast tokenizer (AutoTokenizer.from_pretrained(..., use_fast=True))."
        )
    examples = list(examples)
    rendered = [render_example(tokenizer, e) for e in examples]
    eos_id = tokenizer.eos_token_id
    out: list[TokenizedExample] = []
    for start in range(0, len(examples), batch_size):
        chunk = rendered[start : start + batch_size]
        enc = tokenizer(
            [r[0] for r in chunk],
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
        )
        for j, (text, spans, whole, stable) in enumerate(chunk):
            ids = enc["input_ids"][j]
            offsets = enc["offset_mapping"][j]
            example = examples[start + j]
            out.append(_mask(example, ids, offsets, spans, whole, stable, eos_id, max_seq_length))
    return out


def _mask(
    example: Example,
    ids: list[int],
    offsets: list[tuple[int, int]],
    spans: list[tuple[int, int]],
    whole: bool,
    stable: bool,
    eos_id: int | None,
    max_seq_length: int | None,
) -> TokenizedExample:
    if whole:
        supervised = [True] * len(ids)
    else:
        supervised = [False] * len(ids)
        k = 0
        for i, (a, b) in enumerate(offsets):
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            if k < len(spans) and b > spans[k][0] and a < spans[k][1] and b > a:
                supervised[i] = True
    n_full = len(ids)
    n_sup = sum(supervised)
    first = next((i for i, s in enumerate(supervised) if s), n_full)
    last = max((i for i, s in enumerate(supervised) if s), default=-1)
    limit = n_full if max_seq_length is None else min(n_full, max_seq_length)
    kept_sup = sum(supervised[:limit])
    labels = [tok if sup else IGNORE_INDEX for tok, sup in zip(ids[:limit], supervised[:limit])]
    prompt_in_mask = 0
    if whole and example.is_chat:
        prompt_in_mask = _prompt_token_count(example, offsets)
    return TokenizedExample(
        example_id=example.id,
        input_ids=list(ids[:limit]),
        labels=labels,
        n_tokens_full=n_full,
        n_prompt_tokens=first,
        n_completion_tokens=n_sup,
        n_completion_lost=n_sup - kept_sup,
        truncated=n_full > limit,
        ends_with_eos=last >= 0 and eos_id is not None and ids[last] == eos_id,
        prompt_tokens_in_mask=prompt_in_mask,
        whole_sequence=whole,
        prefix_stable=stable,
    )


def _prompt_token_count(example: Example, offsets: list[tuple[int, int]]) -> int:
    """Tokens of the plain-joined rendering that lie before the final assistant turn's text."""
    prompt = "\n".join(t["content"] for t in example.prompt_messages)
    boundary = len(prompt) + (1 if prompt else 0)
    return sum(1 for a, b in offsets if a < boundary)
