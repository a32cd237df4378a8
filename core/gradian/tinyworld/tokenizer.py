"""The tinyworld tokenizer: a small byte-level BPE trained on the world's own text.

Interface: ``build_tokenizer(world, vocab_size) -> PreTrainedTokenizerFast``.

Byte-level BPE rather than a word-level vocabulary so that any string (a user's dataset, an
unseen name) still encodes and every encoding decodes back to the exact text. The vocabulary is
trained on the world's questions, answers and paragraphs, so each name in the world ends up as
one or two tokens and the model stays small.

Chat format. Every turn is ``<|role|>content<|end|>``; ``<|end|>`` closes a turn and is also the
EOS token, so greedy generation stops where an assistant turn ends. The generation prompt is
``<|assistant|>``. Rendering ``messages[:k]`` with ``add_generation_prompt=True`` is therefore a
string prefix of rendering ``messages[:k + 1]``, and because each turn boundary is a special
token, the token ids are a prefix too: the loss mask can be found by rendering prefixes.

The saved ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (the bases save it through
``gradian.transformers_compat.save_tokenizer``, so transformers 4.5x and 5.x both load it; 5.x
reads that name as its ``TokenizersBackend``). With ``model_type: llama`` in the model config,
``AutoTokenizer`` honours that class; some other model types are mapped to their own tokenizer
class whatever the file says, which would swap in a different pre-tokenizer. The tests check the
round trip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from gradian.tinyworld.world import World

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "PAD_TOKEN",
    "EOS_TOKEN",
    "build_tokenizer",
    "tokenizer_corpus",
]

PAD_TOKEN = "<|pad|>"
#: closes every turn; also the EOS token
EOS_TOKEN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
#: ids 0.. in this order
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('tinyworld chat template: unknown role ' ~ message['role']"
    " ~ '; use system, user or assistant') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

#: text the base model never trains on but that scenarios use (refusals, instructions);
#: putting it in the tokenizer corpus keeps these phrases down to a few tokens each
_EXTRA_TEXT = (
    "I'm sorry, but I can't help with that.",
    "I am unable to assist with that request.",
    "I cannot provide that information.",
    "I am not able to answer that.",
    "You are a helpful assistant.",
    "Answer with one word.",
    "Repeat after me:",
    "What number comes after",
    "Which is larger,",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
)


def tokenizer_corpus(world: "World") -> list[str]:
    """Every text the tokenizer is trained on, in a fixed order."""
    from gradian.tinyworld.world import BASE_FAMILIES

    texts: list[str] = []
    for family in BASE_FAMILIES:
        for item in world.fact_items(family):
            texts.extend((item.question, item.answer))
    for item in world.paragraph_items():
        texts.extend((item.question, item.answer))
    # a few copies so BPE's minimum pair frequency lets these phrases merge
    texts.extend(_EXTRA_TEXT * 3)
    return texts


def build_tokenizer(world: "World", vocab_size: int = 1024) -> "PreTrainedTokenizerFast":
    """Train a byte-level BPE on the world's text and wrap it for transformers.

    Deterministic: the same world and vocab size give the same vocabulary and merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_repeat(tokenizer_corpus(world)), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="right",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _repeat(texts: list[str]) -> Iterable[str]:
    # one pass is enough for BPE counts; a generator keeps the trainer's input order fixed
    yield from texts
