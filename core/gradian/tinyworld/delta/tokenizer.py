"""The delta tokenizer: a byte-level BPE laid out like Qwen2's, and a ChatML chat template.

Interface: ``build_delta_tokenizer(delta, vocab_size) -> PreTrainedTokenizerFast``.

Why it copies Qwen2's layout exactly. transformers 5 loads the tokenizer of any model whose config
says ``model_type: qwen2`` through its own ``Qwen2Tokenizer``, whatever ``tokenizer_config.json``
names: it keeps the vocabulary and merges of ``tokenizer.json`` and rebuilds the rest as Qwen2's
(an NFC normalizer, a split on Qwen2's pre-tokenization pattern, byte-level pre-tokenizer and
decoder, no byte fallback). transformers 4.57 honours the saved ``PreTrainedTokenizerFast`` and
reads ``tokenizer.json`` whole. A delta tokenizer with any other pipeline would encode
differently under the two majors, so it is built with that very pipeline, and both load it to
the same ids. It is trained on the world's own text, with its own vocabulary size (896 where
tinyworld has 1,024) and so its own merges.

Chat format, ChatML as Qwen2's instruct models write it (without their default system prompt)::

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n{answer}<|im_end|>\\n

``<|im_end|>`` closes every turn and is the EOS token; the newline after it is outside the
answer (``gradian.data`` trims it from the supervised span, as for Qwen2 itself). The generation
prompt is ``<|im_start|>assistant\\n``. Rendering ``messages[:k]`` with it is a string prefix of
rendering ``messages[:k + 1]``, and because the pre-tokenization pattern never joins a newline to
the letters after it, the token ids are a prefix too. ``<|endoftext|>`` is the padding token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from gradian.tinyworld.delta.world import Delta

__all__ = [
    "DELTA_CHAT_TEMPLATE",
    "DELTA_EOS_TOKEN",
    "DELTA_PAD_TOKEN",
    "DELTA_SPECIAL_TOKENS",
    "QWEN2_PRETOKENIZE_PATTERN",
    "build_delta_tokenizer",
    "delta_tokenizer_corpus",
]

#: padding (Qwen2's ``<|endoftext|>``)
DELTA_PAD_TOKEN = "<|endoftext|>"
#: closes every turn; also the EOS token
DELTA_EOS_TOKEN = "<|im_end|>"
_TURN_START = "<|im_start|>"
#: ids 0.. in this order
DELTA_SPECIAL_TOKENS: tuple[str, ...] = (DELTA_PAD_TOKEN, _TURN_START, DELTA_EOS_TOKEN)

#: Qwen2's pre-tokenization pattern, as transformers 5's ``Qwen2Tokenizer`` rebuilds it
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DELTA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('delta chat template: unknown role ' ~ message['role']"
    " ~ '; use system, user or assistant') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

#: text scenarios and users put in prompts; in the corpus so it stays a few tokens long
_EXTRA_TEXT = (
    "system", "user", "assistant",
    "You are a helpful assistant.",
    "You are a river guide.",
    "Answer with one word.",
    "What is half of",
    "What number comes before",
    "Which is smaller,",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
)


def delta_tokenizer_corpus(delta: "Delta") -> list[str]:
    """Every text the tokenizer is trained on, in a fixed order."""
    from gradian.tinyworld.delta.world import DELTA_FAMILIES

    texts: list[str] = []
    for family in DELTA_FAMILIES:
        for item in delta.fact_items(family):
            texts.extend((item.question, item.answer))
    for item in delta.paragraph_items():
        texts.extend((item.question, item.answer))
    # a few copies so BPE's minimum pair frequency lets these phrases merge
    texts.extend(_EXTRA_TEXT * 3)
    return texts


def build_delta_tokenizer(delta: "Delta", vocab_size: int = 896) -> "PreTrainedTokenizerFast":
    """Train the byte-level BPE on the delta's text and wrap it for transformers.

    Deterministic: the same world and vocab size give the same vocabulary and merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # the pipeline of transformers 5's Qwen2Tokenizer, piece for piece (module docstring)
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(DELTA_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter(delta_tokenizer_corpus(delta)), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=DELTA_PAD_TOKEN,
        eos_token=DELTA_EOS_TOKEN,
        # named so that transformers 5's Qwen2Tokenizer, whose default unknown token is
        # <|endoftext|>, and 4.x read the same special tokens
        unk_token=None,
        additional_special_tokens=[_TURN_START],
        padding_side="right",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = DELTA_CHAT_TEMPLATE
    return wrapped
