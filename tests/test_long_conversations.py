"""Long conversations: the loss-mask spans of many-turn rows in linear time, identical to rendering
every prefix (the per-prefix method the module keeps, ``_exact_spans``) for any chat template."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gradian.data import dataset_from_rows, tokenize_examples
from gradian.data import tokenize as tokenize_module
from gradian.data.rows import Example
from gradian.errors import DatasetError

# -- the reference: every assistant turn placed by rendering its prefixes ---------------------------


#: the module's own function, before any test patches it
_render_example = tokenize_module.render_example


def reference_render_example(tokenizer: Any, example: Example) -> tuple[str, list[tuple[int, int]], bool, bool]:
    """``render_example`` with every row placed by the per-prefix method (``_exact_spans``, the code
    rows of up to 32 assistant turns still take), whatever its length."""
    if not example.is_chat or not tokenize_module.has_chat_template(tokenizer):
        return _render_example(tokenizer, example)
    try:
        full = tokenize_module._render(tokenizer, example.messages, generation_prompt=False)
        spans, stable = tokenize_module._exact_spans(tokenizer, example.messages, full)
    except Exception as err:
        raise DatasetError(
            f"example {example.id}: the tokenizer's chat template failed to render it ({err})"
        ) from None
    spans = [tokenize_module._trim_after_eos(full, span, tokenizer.eos_token) for span in spans]
    return full, spans, False, stable


# -- templates: prefix-stable ones, and ones that rewrite, number or count turns ---------------------

#: Qwen-2.5-like: a default system turn when the row has none
QWEN_LIKE = (
    "{% if messages[0]['role'] != 'system' %}<|start|>system\nyou are a helpful assistant<|end|>\n{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
#: Gemma-like: the system turn folded into the first user turn, alternation checked by position
GEMMA_LIKE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<|start|>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (first if loop.first else '') + m['content'] | trim }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>model\n{% endif %}"
)
#: a final assistant turn is left open (no end-of-turn after it)
OPEN_LAST = (
    "{% for m in messages %}{% if not loop.first %} {% endif %}[{{ m['role'] }}] {{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant') %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} [assistant] {% endif %}"
)
#: Qwen-3-like: reasoning dropped from assistant turns before the last one (not prefix-stable)
STRIPS_REASONING = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
#: a running turn number: prefix-stable, but a short window cannot know the number
NUMBERED = (
    "{% for m in messages %}<|start|>{{ loop.index }} {{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>{{ messages | length + 1 }} assistant\n{% endif %}"
)
#: the generation prompt changes past 40 turns: local windows look fine, sampled exact turns do not
LONG_PROMPT = (
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}{% if messages | length > 40 %}<|start|>assistant again\n"
    "{% else %}<|start|>assistant\n{% endif %}{% endif %}"
)
#: Mistral-like: the system prompt goes into the last user turn (not prefix-stable)
SYSTEM_LAST = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}{% for m in loop_messages %}"
    "{% if m['role'] == 'user' %}{% if loop.last and sys is defined %}[INST] {{ sys }}\n\n{{ m['content'] }} [/INST]"
    "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}"
    "{% else %} {{ m['content'] }}<|end|>{% endif %}{% endfor %}"
)

STABLE_TEMPLATES = {"qwen_like": QWEN_LIKE, "gemma_like": GEMMA_LIKE, "open_last": OPEN_LAST}
OTHER_TEMPLATES = {"strips_reasoning": STRIPS_REASONING, "numbered": NUMBERED, "long_prompt": LONG_PROMPT,
                   "system_last": SYSTEM_LAST}


def _pair(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"what is the capital of france {i} ?"},
            {"role": "assistant", "content": f"paris {i} ."}]


def _turns(n_pairs: int, start: int = 0) -> list[dict[str, str]]:
    return [turn for i in range(start, start + n_pairs) for turn in _pair(i)]


def varied_rows() -> list[dict[str, Any]]:
    """Short and long rows of the shapes conversations come in."""
    system = {"role": "system", "content": "you are a helpful assistant ."}
    return [
        {"messages": _turns(1)},
        {"messages": [system] + _turns(3)},
        {"messages": _turns(2) + [{"role": "user", "content": "and japan ?"}]},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
                      {"role": "user", "content": "hello ?"}, {"role": "assistant", "content": "yes"}]},
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "one"},
                      {"role": "assistant", "content": "two"}, {"role": "user", "content": "three ?"},
                      {"role": "assistant", "content": "four"}]},
        {"messages": [{"role": "user", "content": f"say {i}"} if k % 2 == 0 else
                      {"role": "assistant", "content": f"<think>one two</think>hello {i}"}
                      for i in range(3) for k in range(2)]},
        {"messages": [system] + _turns(40)},
        {"messages": _turns(45) + [{"role": "user", "content": "and japan ?"}]},
        {"messages": _turns(20) + [{"role": "assistant", "content": "yes"}] + _turns(20, 20)},
        {"messages": [system] + [t for i in range(36) for t in
                                 (_pair(i) if i % 3 else [*_pair(i), {"role": "tool", "content": f"two {i}"},
                                                          {"role": "assistant", "content": f"yes {i}"}])]},
        {"messages": [turn for i in range(36) for turn in
                      ({"role": "user", "content": f"say {i}"},
                       {"role": "assistant", "content": f"<think>one {i}</think>hello {i}"})]},
        {"text": "one two three"},
    ]


def _tokenizer(base: Any, template: str | None) -> Any:
    tok = copy.deepcopy(base)
    if template is not None:
        tok.chat_template = template
    return tok


def _outcome(examples: list[Example], tokenizer: Any, max_seq_length: int | None) -> list[Any]:
    """Each row's TokenizedExample, or the error it raises (rows tokenized one at a time)."""
    out = []
    for example in examples:
        try:
            out.append(tokenize_examples([example], tokenizer, max_seq_length)[0])
        except DatasetError as err:
            out.append(("error", str(err)))
    return out


def _reference(examples: list[Example], tokenizer: Any, max_seq_length: int | None,
               monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    with monkeypatch.context() as m:
        m.setattr(tokenize_module, "render_example", reference_render_example)
        return _outcome(examples, tokenizer, max_seq_length)


@pytest.fixture(params=["chat", "tinyworld", *STABLE_TEMPLATES, *OTHER_TEMPLATES])
def any_tokenizer(request, chat_tokenizer):
    if request.param == "chat":
        return chat_tokenizer
    if request.param == "tinyworld":
        return request.getfixturevalue("tinyworld_tokenizer")
    return _tokenizer(chat_tokenizer, {**STABLE_TEMPLATES, **OTHER_TEMPLATES}[request.param])


@pytest.mark.parametrize("exact_turns", [1, 32])
@pytest.mark.parametrize("max_seq_length", [None, 37])
def test_same_tokens_and_masks_as_rendering_every_prefix(any_tokenizer, exact_turns, max_seq_length, monkeypatch):
    """input_ids, labels, counts and flags (and errors) equal the reference's, for every template;
    ``exact_turns=1`` puts every multi-turn row through the windowed method."""
    examples = dataset_from_rows(varied_rows()).examples
    expected = _reference(examples, any_tokenizer, max_seq_length, monkeypatch)
    monkeypatch.setattr(tokenize_module, "_EXACT_TURNS", exact_turns)
    assert _outcome(examples, any_tokenizer, max_seq_length) == expected


def test_long_rows_take_the_windowed_method_only_where_it_holds(chat_tokenizer, tinyworld_tokenizer):
    """Prefix-stable templates are placed by windows; the others fall back to every prefix."""
    messages = [{"role": "system", "content": "you are a helpful assistant ."}] + _turns(60)
    turns = [i for i, t in enumerate(messages) if t["role"] == "assistant"]
    stable = [chat_tokenizer, tinyworld_tokenizer] + [_tokenizer(chat_tokenizer, t) for t in STABLE_TEMPLATES.values()]
    for tok in stable:
        full = tok.apply_chat_template(messages, tokenize=False)
        assert tokenize_module._windowed_bounds(tok, messages, full, turns) is not None
    for name in ("numbered", "long_prompt", "system_last"):
        tok = _tokenizer(chat_tokenizer, OTHER_TEMPLATES[name])
        full = tok.apply_chat_template(messages, tokenize=False)
        assert tokenize_module._windowed_bounds(tok, messages, full, turns) is None, name


class _Counting:
    """Counts a tokenizer's template renderings and the turns they render, in total."""

    def __init__(self, tokenizer: Any):
        self.calls = 0
        self.turns = 0
        self._render = tokenizer.apply_chat_template

    def __call__(self, conversation, *args, **kwargs):
        self.calls += 1
        self.turns += len(conversation)
        return self._render(conversation, *args, **kwargs)


def _rendering_work(tokenizer: Any, rows: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> _Counting:
    counter = _Counting(tokenizer)
    with monkeypatch.context() as m:
        m.setattr(tokenizer, "apply_chat_template", counter)
        tokenize_examples(dataset_from_rows(rows).examples, tokenizer, None)
    return counter


@pytest.mark.parametrize("which", ["chat", "qwen_like"])
def test_ten_thousand_turns_render_in_linear_work(which, chat_tokenizer, monkeypatch):
    """A 10,000-turn row renders about as many turns as the same turns spread over 2,500 rows,
    and the work grows linearly with the turns (rendering every prefix: 50 million turns)."""
    tok = chat_tokenizer if which == "chat" else _tokenizer(chat_tokenizer, QWEN_LIKE)
    long = _rendering_work(tok, [{"messages": _turns(5000)}], monkeypatch)
    spread = _rendering_work(tok, [{"messages": _turns(2, 2 * k)} for k in range(2500)], monkeypatch)
    assert long.turns <= 10 * spread.turns
    assert long.calls <= 10 * spread.calls
    shorter = _rendering_work(tok, [{"messages": _turns(1000)}], monkeypatch)
    assert long.turns <= 7 * shorter.turns  # 5x the turns: linear is 5x, quadratic 25x


def test_ten_thousand_turns_keep_every_assistant_turn(chat_tokenizer):
    (te,) = tokenize_examples(dataset_from_rows([{"messages": _turns(5000)}]).examples, chat_tokenizer, None)
    assert te.prefix_stable and not te.whole_sequence and te.ends_with_eos
    supervised = chat_tokenizer.convert_ids_to_tokens([t for t in te.labels if t != -100])
    assert supervised.count("<|end|>") == 5000 and supervised.count("paris") == 5000
    assert "what" not in supervised and "assistant" not in supervised


def test_a_long_row_the_windows_cannot_place_is_refused_naming_the_bound(chat_tokenizer, monkeypatch):
    tok = _tokenizer(chat_tokenizer, NUMBERED)
    monkeypatch.setattr(tokenize_module, "_MAX_EXACT_TURNS", 50)
    rows = [{"messages": _turns(60)}]
    with pytest.raises(DatasetError, match=r"60 assistant turns.*above 50 assistant turns such a row is refused"):
        tokenize_examples(dataset_from_rows(rows).examples, tok, None)
    # under the bound the same row renders every prefix, as before
    monkeypatch.setattr(tokenize_module, "_MAX_EXACT_TURNS", 60)
    examples = dataset_from_rows(rows).examples
    assert _outcome(examples, tok, None) == _reference(examples, tok, None, monkeypatch)


def test_template_errors_are_reported_as_before(chat_tokenizer, monkeypatch):
    """A row the template refuses (roles out of order) fails with the same message either way."""
    tok = _tokenizer(chat_tokenizer, GEMMA_LIKE)
    rows = [{"messages": _turns(40) + [{"role": "assistant", "content": "one"}, {"role": "assistant", "content": "two"}]}]
    examples = dataset_from_rows(rows).examples
    got = _outcome(examples, tok, None)
    assert got == _reference(examples, tok, None, monkeypatch)
    assert got[0][0] == "error" and "roles must alternate" in got[0][1]
