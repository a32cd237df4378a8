"""A small real HF fast tokenizer with a chat template, built in memory (no hub, no files).

It is independent of tinyworld on purpose: the data layer must work with any template, so the
benchmarks and the tests use one written here (Llama-3-like headers, an end-of-turn token that is
EOS, a BOS the template emits itself), or the same tokenizer without a template.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE", "build_chat_tokenizer"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)

_WORDS = (
    "what is the capital of france paris japan tokyo answer question hello world you are a "
    "helpful assistant say translate to spanish hola yes no one two three four five and or "
    "system user assistant , . ? !"
).split()


def build_chat_tokenizer(with_template: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "<|start|>", "<|end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(_WORDS)) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.WhitespaceSplit(),
         pre_tokenizers.Punctuation()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|end|>",
        additional_special_tokens=["<|start|>"],
    )
    if with_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast
