"""Tokenization and loss masks: the one place every lane turns an Example into tokens.

With a chat template, the conversation is rendered once and each assistant turn's character span
is found by rendering the prefix before it (with the generation prompt) and the prefix through
it. Tokens whose offsets fall inside an assistant span are supervised: the assistant's content
plus whatever the template closes the turn with (end-of-turn / EOS, where the template puts it).

Rendering every prefix is quadratic in a row's turns, so a row with more than ``_EXACT_TURNS``
assistant turns is placed turn by turn from short rendering windows instead, each checked against
the full rendering (and a few turns against their exact prefixes): the same spans in linear time.
Where the template fails those checks the row renders every prefix as before, up to
``_MAX_EXACT_TURNS`` assistant turns; a longer such row is refused, naming the bound.

Without a chat template the turns are joined with newlines, EOS is appended, and the whole
sequence is supervised; ``whole_sequence`` records that fallback. Text rows are always supervised
whole.

Truncation keeps the first ``max_seq_length`` tokens and records how many supervised tokens fell
off the end (``n_completion_lost``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

from gradian.data.rows import Example
from gradian.errors import DatasetError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def has_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> str:
    """The text a model is given to produce the next assistant turn (for generation)."""
    if has_chat_template(tokenizer):
        return _render(tokenizer, messages, generation_prompt=True)
    return "\n".join(t["content"] for t in messages) + "\n"


def render_example(tokenizer: PreTrainedTokenizerBase, example: Example) -> tuple[str, list[tuple[int, int]], bool, bool]:
    """(text, supervised char spans, whole_sequence, prefix_stable) for one example."""
    if not example.is_chat:
        return (example.text or "") + (tokenizer.eos_token or ""), [], True, True
    if not has_chat_template(tokenizer):
        text = "\n".join(t["content"] for t in example.messages) + (tokenizer.eos_token or "")
        return text, [], True, True
    messages = example.messages
    try:
        full = _render(tokenizer, messages, generation_prompt=False)
        turns = [i for i, turn in enumerate(messages) if turn["role"] == "assistant"]
        bounds = _windowed_bounds(tokenizer, messages, full, turns) if len(turns) > _EXACT_TURNS else None
        if bounds is not None:
            spans, stable = bounds, True
        elif len(turns) > _MAX_EXACT_TURNS:
            raise DatasetError(
                f"example {example.id}: {len(turns):,} assistant turns in one conversation, and the chat "
                "template does not render this conversation turn by turn as string prefixes (or a turn's "
                "rendering depends on turns far before it), so every turn's prefix would have to be "
                f"rendered on its own, which is quadratic in the turns; above {_MAX_EXACT_TURNS:,} assistant "
                "turns such a row is refused: split the conversation into shorter rows"
            )
        else:
            spans, stable = _exact_spans(tokenizer, messages, full)
    except DatasetError:
        raise
    except Exception as err:  # jinja raises its own types; a template may also raise on purpose
        raise DatasetError(
            f"example {example.id}: the tokenizer's chat template failed to render it ({err})"
        ) from None
    return full, [_trim_after_eos(full, span, tokenizer.eos_token) for span in spans], False, stable


#: rows with at most this many assistant turns render every turn's prefix (``_exact_spans``)
_EXACT_TURNS = 32
#: how many turns before the previous assistant turn a rendering window may start
_WINDOW_REACH = 16
#: the most assistant turns a row may have when only per-prefix rendering can place its turns
_MAX_EXACT_TURNS = 1000


def _exact_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], full: str
) -> tuple[list[tuple[int, int]], bool]:
    """(untrimmed spans, prefix_stable) by rendering the prefix before and through each assistant turn.

    The reference method, for any template: two renderings per assistant turn, each as long as the
    conversation up to it, so quadratic in the turns of a row.
    """
    spans: list[tuple[int, int]] = []
    stable = True
    cursor = 0
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        bounds = _exact_bounds(tokenizer, messages, full, i)
        if bounds is not None:
            spans.append(bounds)
            cursor = bounds[1]
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
    return spans, stable


def _exact_bounds(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], full: str, i: int
) -> tuple[int, int] | None:
    """Assistant turn ``i``'s (start, end) in ``full`` from its rendered prefixes; None where either
    prefix is not a string prefix of ``full``."""
    before = _render(tokenizer, messages[:i], generation_prompt=True)
    through = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], generation_prompt=False)
    if full.startswith(before) and full.startswith(through) and len(through) >= len(before):
        return len(before), len(through)
    return None


def _windowed_bounds(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], full: str, turns: list[int]
) -> list[tuple[int, int]] | None:
    """The spans ``_exact_spans`` finds on a prefix-stable row, in time linear in its turns; None
    where this row and template cannot be vouched for (the caller then renders every prefix).

    The first assistant turn is placed exactly. Each later one is placed from the end of the one
    before it: a short window (the leading system turns, then the conversation from a turn of the
    first turn's role at the same parity, just before the previous assistant turn) is rendered
    through the previous assistant turn, before this one (with the generation prompt) and through
    it. The growth between those renderings is where this turn starts and ends, provided each is a
    string prefix of the next and the text they add is the full rendering's text at that place, so
    the windows tile ``full`` exactly. Templates whose output depends on more than the nearby turns
    (a running turn number, the conversation's length) fail that check or the exact renderings
    of a few sampled turns (the second and third, the quartiles, the last), and fall back.
    """
    head = 0
    while head < len(messages) and messages[head]["role"] not in ("user", "assistant"):
        head += 1
    try:
        first = _exact_bounds(tokenizer, messages, full, turns[0])
        if first is None:
            return None
        bounds = [first]
        lead = list(messages[:head])
        for previous, i in zip(turns, turns[1:]):
            start = _window_start(messages, head, previous)
            if start is None:
                return None
            base = _render(tokenizer, lead + list(messages[start : previous + 1]), generation_prompt=False)
            before = _render(tokenizer, lead + list(messages[start:i]), generation_prompt=True)
            through = _render(tokenizer, lead + list(messages[start : i + 1]), generation_prompt=False)
            if not (before.startswith(base) and through.startswith(before)):
                return None
            offset = bounds[-1][1]
            if not full.startswith(through[len(base) :], offset):
                return None
            bounds.append((offset + len(before) - len(base), offset + len(through) - len(base)))
        if turns[-1] == len(messages) - 1 and bounds[-1][1] != len(full):
            return None
        n = len(turns)
        for k in sorted({1, 2, n // 4, n // 2, (3 * n) // 4, n - 1} - {0}):
            if k < n and _exact_bounds(tokenizer, messages, full, turns[k]) != bounds[k]:
                return None
    except Exception:  # a window the template refuses: the exact method decides (and reports errors)
        return None
    return bounds


def _window_start(messages: Sequence[dict[str, str]], head: int, previous: int) -> int | None:
    """Where the rendering window before assistant turn ``previous`` starts: the nearest turn at or
    before it with the role of the first non-system turn, an even number of turns after it (so
    templates that check alternation by position accept the window), else the nearest with that
    role; None when neither is within ``_WINDOW_REACH`` turns."""
    role = messages[head]["role"]
    reach = range(previous, max(head, previous - _WINDOW_REACH) - 1, -1)
    for start in reach:
        if messages[start]["role"] == role and (start - head) % 2 == 0:
            return start
    for start in reach:
        if messages[start]["role"] == role:
            return start
    return None


def _trim_after_eos(full: str, span: tuple[int, int], eos: str | None) -> tuple[int, int]:
    """Drop whitespace a template writes after the turn's EOS (Qwen's newline after im_end)."""
    start, end = span
    segment = full[start:end].rstrip()
    if eos and segment.endswith(eos):
        return start, start + len(segment)
    return span


def tokenize_examples(
    examples: Iterable[Example],
    tokenizer: PreTrainedTokenizerBase,
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
