"""The bestiary tokenizer: a SentencePiece-style BPE with byte fallback, and its chat template.

Interface: ``build_bestiary_tokenizer(bestiary, vocab_size) -> PreTrainedTokenizerFast``.

Where tinyworld's tokenizer is byte-level BPE, this one is laid out like the Llama 2 / Mistral
tokenizers: spaces become ``▁`` and every word carries its leading ``▁``; BPE merges never cross
a word boundary; a character the vocabulary lacks is spelled as its UTF-8 bytes (``<0xE6>``...),
the 256 byte tokens having fixed ids right after the special tokens. Any string therefore
encodes, and decodes back to itself.

Chat format, one turn per line, the system prompt folded into the first user turn (as Mistral's
and Gemma's templates do, there is no system turn of its own)::

    <s>
    <user>{system}\\n\\n{question}</turn>
    <bot>{answer}</turn>

``</turn>`` closes every turn and is the EOS token; ``<s>`` (BOS) opens the conversation; the
generation prompt is ``\\n<bot>``. Rendering ``messages[:k]`` with the generation prompt is a
string prefix of rendering ``messages[:k + 1]``, and since ``<bot>`` and ``</turn>`` are special
tokens, the token ids are a prefix too. So ``gradian.data`` supervises exactly the answer and
its ``</turn>``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from gradian.tinyworld.bestiary.world import Bestiary

__all__ = [
    "BESTIARY_BOS_TOKEN",
    "BESTIARY_CHAT_TEMPLATE",
    "BESTIARY_EOS_TOKEN",
    "BESTIARY_PAD_TOKEN",
    "BESTIARY_SPECIAL_TOKENS",
    "bestiary_tokenizer_corpus",
    "build_bestiary_tokenizer",
]

BESTIARY_PAD_TOKEN = "<pad>"
BESTIARY_BOS_TOKEN = "<s>"
#: closes every turn; also the EOS token
BESTIARY_EOS_TOKEN = "</turn>"
_ROLE_TOKENS = ("<user>", "<bot>")
#: ids 0.. in this order; the 256 byte tokens follow
BESTIARY_SPECIAL_TOKENS: tuple[str, ...] = (BESTIARY_PAD_TOKEN, BESTIARY_BOS_TOKEN,
                                            BESTIARY_EOS_TOKEN, *_ROLE_TOKENS)
_SPACE = "\u2581"  # ▁, SentencePiece's visible space

BESTIARY_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not loop.first or loop.last or messages[1]['role'] != 'user' -%}"
    "{{- raise_exception('bestiary chat template: a system turn must come first and be followed"
    " by a user turn') -}}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '\\n<user>' -}}"
    "{%- if loop.index0 == 1 -%}{{- messages[0]['content'] ~ '\\n\\n' -}}{%- endif -%}"
    "{{- message['content'] ~ '</turn>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '\\n<bot>' ~ message['content'] ~ '</turn>' -}}"
    "{%- else -%}"
    "{{- raise_exception('bestiary chat template: unknown role ' ~ message['role']"
    " ~ '; use system, user or assistant') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\n<bot>' -}}{%- endif -%}"
)

#: text scenarios and users put in prompts; in the corpus so it stays a few tokens long
_EXTRA_TEXT = (
    "You are a helpful assistant.",
    "You are a careful naturalist.",
    "Answer with one word.",
    "What letter comes before",
    "What is double",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "\n",
)


def bestiary_tokenizer_corpus(bestiary: "Bestiary") -> list[str]:
    """Every text the tokenizer is trained on, in a fixed order."""
    from gradian.tinyworld.bestiary.world import BESTIARY_FAMILIES

    texts: list[str] = []
    for family in BESTIARY_FAMILIES:
        for item in bestiary.fact_items(family):
            texts.extend((item.question, item.answer))
    for item in bestiary.paragraph_items():
        texts.extend((item.question, item.answer))
    texts.extend(_EXTRA_TEXT * 3)
    return texts


def build_bestiary_tokenizer(bestiary: "Bestiary", vocab_size: int = 768) -> "PreTrainedTokenizerFast":
    """Train the BPE on the bestiary's text and wrap it for transformers.

    Deterministic: the same bestiary and vocab size give the same vocabulary and merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    # each text segment (between special tokens) gets a leading ▁, and spaces become ▁
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    # a word is a ▁ and what follows it up to the next ▁: merges stay inside words
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_SPACE), behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        # the 256 byte tokens are added below, outside what BPE learns
        vocab_size=vocab_size - 256,
        min_frequency=2,
        special_tokens=list(BESTIARY_SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(iter(bestiary_tokenizer_corpus(bestiary)), trainer=trainer)
    tok = _with_byte_tokens(tok)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=BESTIARY_PAD_TOKEN,
        bos_token=BESTIARY_BOS_TOKEN,
        eos_token=BESTIARY_EOS_TOKEN,
        additional_special_tokens=list(_ROLE_TOKENS),
        padding_side="right",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = BESTIARY_CHAT_TEMPLATE
    return wrapped


def _with_byte_tokens(tok: "Tokenizer") -> "Tokenizer":
    """The trained tokenizer with ``<0x00>``..``<0xFF>`` inserted after the special tokens.

    ``BpeTrainer`` has no notion of byte fallback tokens, so the vocabulary is renumbered here:
    special tokens, then the bytes, then the learned tokens in their trained order.
    """
    from tokenizers import Tokenizer as _Tokenizer

    spec = json.loads(tok.to_str())
    trained = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(BESTIARY_SPECIAL_TOKENS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in trained:
        if token not in vocab:
            vocab[token] = len(vocab)
    spec["model"]["vocab"] = vocab
    spec["model"]["byte_fallback"] = True
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    return _Tokenizer.from_str(json.dumps(spec))
