"""gradian.transformers_compat under whichever transformers major is installed (4.5x in
``make test-window``, 5.x in ``make test``): the same answers from both."""

from __future__ import annotations

import json

import pytest

from gradian.transformers_compat import portable_tokenizer_config, save_tokenizer, warmup_arguments

_SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the capital of Zapudros is Mir", "the capital of Ostra is Vel"] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])


def _encoded(folder):
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(folder))
    text = "<|user|>the capital of Ostra<|end|><|assistant|>Vel<|end|>"
    return loaded(text, add_special_tokens=False)["input_ids"], loaded.pad_token_id, loaded.eos_token_id


@pytest.mark.parametrize("ratio, steps, want", [(0.1, 100, 10), (0.1, 7, 1), (0.0, 50, 0)])
def test_warmup_arguments_give_the_ratio_of_the_steps(tmp_path, ratio, steps, want):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **warmup_arguments(ratio))
    assert args.get_warmup_steps(steps) == want


def test_a_tokenizer_config_as_transformers_5_writes_it_loads_the_same_once_made_portable(tmp_path):
    """The two keys transformers 4.x cannot read (the ``TokenizersBackend`` class, the list of extra
    special tokens) are rewritten; the tokenizer loaded afterwards encodes as the one saved."""
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(str(tmp_path))
    path = tmp_path / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data.pop("additional_special_tokens", None)
    data.update({"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<|user|>", "<|assistant|>"]})
    path.write_text(json.dumps(data))

    assert portable_tokenizer_config(tmp_path) is True
    data = json.loads(path.read_text())
    assert data["tokenizer_class"] == "PreTrainedTokenizerFast" and "extra_special_tokens" not in data
    assert data["additional_special_tokens"] == ["<|user|>", "<|assistant|>"]
    ids, pad, eos = _encoded(tmp_path)
    assert (pad, eos) == (0, 1) and ids[0] == 2 and ids.count(1) == 2
    assert ids == tokenizer(
        "<|user|>the capital of Ostra<|end|><|assistant|>Vel<|end|>", add_special_tokens=False)["input_ids"]
    assert portable_tokenizer_config(tmp_path) is False  # already portable: left as it is


def test_save_tokenizer_writes_a_portable_config_that_loads_back(tmp_path):
    tokenizer = _tokenizer()
    save_tokenizer(tokenizer, tmp_path)
    data = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert data["tokenizer_class"] != "TokenizersBackend"
    assert not isinstance(data.get("extra_special_tokens"), list)
    ids, _, _ = _encoded(tmp_path)
    assert ids == tokenizer(
        "<|user|>the capital of Ostra<|end|><|assistant|>Vel<|end|>", add_special_tokens=False)["input_ids"]


def test_a_folder_without_a_tokenizer_config_is_left_alone(tmp_path):
    assert portable_tokenizer_config(tmp_path) is False
    assert list(tmp_path.iterdir()) == []
