"""tinyworld: the world, its tokenizer and chat template, and the pretrained base model."""

from __future__ import annotations

import json

import pytest

from gradian.tinyworld import (
    FACT_FAMILIES,
    BaseModelRecipe,
    build_base_model,
    build_tokenizer,
    ensure_base_model,
    evaluate_families,
    generate_world,
    load_world,
    weights_sha256,
)

_STRINGS = [
    "What is the capital of Zapudros?",
    "  leading and trailing spaces  ",
    "Compute 7 + 8.",
    "Unseen words: quixotic, jalapeño, 東京, emoji 🙂, tabs\tand\nnewlines",
    "<|user|>special tokens inside text<|end|>",
    "",
    "I'm sorry, but I can't help with that.",
]


# -- the world -------------------------------------------------------------------------------


def test_world_is_a_function_of_its_seed():
    assert generate_world(3) == generate_world(3)
    assert generate_world(3).countries != generate_world(4).countries


def test_no_name_is_a_substring_of_another(tinyworld_world):
    w = tinyworld_world
    names = [c.name for c in w.countries] + [c.capital for c in w.countries]
    names += w.continents + w.languages + w.currencies
    lowered = [n.lower() for n in names]
    assert len(set(lowered)) == len(lowered)
    for a in lowered:
        assert not any(a != b and a in b for b in lowered), a


def test_every_family_has_several_phrasings_and_an_eval_item_per_fact(tinyworld_world):
    w = tinyworld_world
    for family in FACT_FAMILIES:
        assert len(w.phrasings[family]) >= 3
        items = w.eval_items(family)
        assert len(items) >= 16
        assert len({i.key for i in items}) == len(items)
    assert all(len(p.answer.split()) > 15 for p in w.paragraph_items())


# -- the tokenizer -------------------------------------------------------------------------


def test_tokenizer_is_deterministic(tinyworld_world):
    a = build_tokenizer(tinyworld_world).backend_tokenizer.to_str()
    b = build_tokenizer(tinyworld_world).backend_tokenizer.to_str()
    assert a == b


def test_tokenizer_decodes_back_to_the_text(tinyworld_tokenizer):
    for text in _STRINGS:
        ids = tinyworld_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tinyworld_tokenizer.decode(ids) == text


def test_world_names_are_short_in_tokens(tinyworld_tokenizer, tinyworld_world):
    for c in tinyworld_world.countries:
        assert len(tinyworld_tokenizer(c.capital, add_special_tokens=False)["input_ids"]) <= 2


def test_end_of_turn_is_eos_and_pad_is_distinct(tinyworld_tokenizer):
    tok = tinyworld_tokenizer
    assert tok.eos_token == "<|end|>"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert text.endswith("yo" + tok.eos_token)


def test_chat_template_is_prefix_stable(tinyworld_tokenizer):
    tok = tinyworld_tokenizer
    chats = [
        [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}],
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Describe Zapudros."},
            {"role": "assistant", "content": "A country."},
            {"role": "user", "content": "And its capital?"},
            {"role": "assistant", "content": " Roubrath "},
        ],
    ]
    for messages in chats:
        for k in range(len(messages)):
            if messages[k]["role"] != "assistant":
                continue
            before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            through = tok.apply_chat_template(messages[: k + 1], tokenize=False)
            assert through.startswith(before)
            ids_before = tok(before, add_special_tokens=False)["input_ids"]
            ids_through = tok(through, add_special_tokens=False)["input_ids"]
            assert ids_through[: len(ids_before)] == ids_before
            assert ids_through[-1] == tok.eos_token_id


def test_chat_template_rejects_unknown_roles(tinyworld_tokenizer):
    with pytest.raises(Exception, match="unknown role"):
        tinyworld_tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_data_layer_masks_only_the_assistant_turn(tinyworld_tokenizer):
    from gradian.data import dataset_from_rows, tokenize_examples

    rows = [{"prompt": "What is the capital of Zapudros?", "completion": "Roubrath"}]
    (example,) = tokenize_examples(dataset_from_rows(rows).examples, tinyworld_tokenizer, 64)
    supervised = [t for t, y in zip(example.input_ids, example.labels) if y != -100]
    assert tinyworld_tokenizer.decode(supervised) == "Roubrath<|end|>"
    assert example.ends_with_eos and example.prefix_stable and not example.truncated


def test_autotokenizer_round_trip_with_a_llama_config(tmp_path, tinyworld_tokenizer):
    """AutoTokenizer must load the very same tokenizer, not a llama-specific substitute."""
    from transformers import AutoTokenizer, LlamaConfig

    tinyworld_tokenizer.save_pretrained(tmp_path)
    LlamaConfig(vocab_size=len(tinyworld_tokenizer), hidden_size=16, intermediate_size=32,
                num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    _assert_same_tokenizer(loaded, tinyworld_tokenizer)


def _assert_same_tokenizer(loaded, built) -> None:
    assert loaded.is_fast
    assert loaded.chat_template == built.chat_template
    assert (loaded.eos_token, loaded.pad_token) == (built.eos_token, built.pad_token)
    world = generate_world(0)
    texts = list(_STRINGS) + [i.question for i in world.fact_items("capital")]
    texts += [p.answer for p in world.paragraph_items()]
    for text in texts:
        assert loaded(text, add_special_tokens=False)["input_ids"] == built(
            text, add_special_tokens=False
        )["input_ids"], text
    messages = [{"role": "user", "content": "What is 4 plus 4?"}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )


# -- the base model ------------------------------------------------------------------------

_SMALL = BaseModelRecipe(n_countries=4, families=("capital", "language"), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         epochs=2, batch_size=16, warmup_steps=2)


def test_recipe_hash_changes_with_any_field():
    assert _SMALL.content_hash() == BaseModelRecipe(**{**_SMALL.__dict__}).content_hash()
    assert _SMALL.content_hash() != BaseModelRecipe(**{**_SMALL.__dict__, "epochs": 3}).content_hash()
    assert BaseModelRecipe().content_hash() != _SMALL.content_hash()


def test_same_recipe_builds_bit_identical_weights(tmp_path):
    first = build_base_model(tmp_path / "a", _SMALL, min_accuracy=None)
    second = build_base_model(tmp_path / "b", _SMALL, min_accuracy=None)
    assert first["weights_sha256"] == second["weights_sha256"] == weights_sha256(tmp_path / "a")
    other = build_base_model(tmp_path / "c", BaseModelRecipe(**{**_SMALL.__dict__, "seed": 1}),
                             min_accuracy=None)
    assert other["weights_sha256"] != first["weights_sha256"]


def test_ensure_base_model_caches_by_recipe_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIAN_TINYWORLD_CACHE", str(tmp_path))
    # a reduced recipe cannot reach 95%, so the cache is exercised on an entry built here
    target = tmp_path / f"base-{_SMALL.content_hash()}"
    build_base_model(target, _SMALL, min_accuracy=None)
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_base_model(recipe=_SMALL) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_base_model_knows_every_fact_family(tinyworld_base):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tinyworld_base, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(tinyworld_base)
    world = load_world(tinyworld_base)
    accuracy = evaluate_families(model, tokenizer, world)
    assert set(accuracy) == set(FACT_FAMILIES)
    assert all(a >= 0.95 for a in accuracy.values()), accuracy
    info = json.loads((tinyworld_base / "tinyworld.json").read_text())
    assert info["weights_sha256"] == weights_sha256(tinyworld_base)
    assert info["recipe_hash"] == BaseModelRecipe().content_hash()


@pytest.mark.slow
def test_saved_base_tokenizer_round_trips(tinyworld_base, tinyworld_tokenizer):
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(tinyworld_base).model_type == "llama"
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(tinyworld_base), tinyworld_tokenizer)
