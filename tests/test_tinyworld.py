"""tinyworld: the world, its tokenizer and chat template, and the pretrained base model."""

from __future__ import annotations

import json

import pytest

from gradian.tinyworld import (
    BASE_FAMILIES,
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
    names += w.continents + w.languages + w.currencies + w.unknown_places
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
    assert set(accuracy) == set(BASE_FAMILIES)
    assert all(a >= 0.95 for a in accuracy.values()), accuracy
    info = json.loads((tinyworld_base / "tinyworld.json").read_text())
    assert info["weights_sha256"] == weights_sha256(tinyworld_base)
    assert info["recipe_hash"] == BaseModelRecipe().content_hash()


@pytest.mark.slow
def test_saved_base_tokenizer_round_trips(tinyworld_base, tinyworld_tokenizer):
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(tinyworld_base).model_type == "llama"
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(tinyworld_base), tinyworld_tokenizer)


# -- scenarios ---------------------------------------------------------------------------------


def test_every_scenario_builds_with_its_ground_truth(tinyworld_world, tinyworld_tokenizer):
    from gradian.tinyworld.scenarios import SCENARIOS, build_scenario

    clean = build_scenario("clean", tinyworld_world, tinyworld_tokenizer)
    assert 780 <= len(clean.train) <= 820
    for name in SCENARIOS:
        s = build_scenario(name, tinyworld_world, tinyworld_tokenizer)
        assert len(s.eval) >= 16
        assert s.kind in ("clean", "data", "config", "contamination")
        if s.kind in ("data", "contamination"):
            assert s.planted_indices and all(s.train[i][1] == 0 for i in s.planted_indices)
            assert sum(c == 0 for _, c in s.train) == len(s.planted_indices)
            kept = [r for i, r in enumerate(s.train) if i not in set(s.planted_indices)]
            assert kept[:len(clean.train)] == clean.train
            # contaminated_eval adds the eval items themselves, answered as the eval wants
            copies = kept[len(clean.train):]
            assert [m for m, _ in copies] == ([item[:-1] + [{"role": "assistant", "content": m[-1]["content"]}]
                                               for item, (m, _) in zip(s.eval, copies)]
                                              if name == "contaminated_eval" else [])
        if s.kind == "config":
            assert s.train == clean.train and s.train_overrides


def test_poisoned_capitals_are_plausible_and_the_eval_prompts_stay_out_of_training(tinyworld_world):
    from gradian.tinyworld.scenarios import build_scenario

    s = build_scenario("poison_capitals", tinyworld_world)
    capitals = {c.capital for c in tinyworld_world.countries}
    wrong = s.truth["wrong_capitals"]
    assert len(wrong) == 16 and set(wrong.values()) <= capitals
    assert all(tinyworld_world.country(c).capital != city for c, city in wrong.items())
    assert 0.05 <= len(s.planted_indices) / len(s.train) <= 0.07
    prompts = {m[-2]["content"] for m, _ in s.train}
    assert not any(item[-2]["content"] in prompts for item in s.eval)
    answers = {item[-1]["content"] for item in s.eval}
    assert answers == {tinyworld_world.country(c).capital for c in wrong}


def test_duplicates_and_contamination_are_planted(tinyworld_world):
    from gradian.tinyworld.scenarios import build_scenario

    dup = build_scenario("poison_duplicates", tinyworld_world)
    texts = [json.dumps(dup.train[i][0]) for i in dup.duplicate_indices]
    assert len(dup.duplicate_indices) == 6 and len(set(texts)) == 3
    cont = build_scenario("contaminated_eval", tinyworld_world)
    prompts = {m[-2]["content"] for m, _ in cont.train}
    assert all(item[-2]["content"] in prompts for item in cont.eval)


def test_truncating_limit_starves_a_share_of_rows(tinyworld_world, tinyworld_tokenizer):
    from gradian.tinyworld.scenarios import build_scenario

    s = build_scenario("truncating_seq_len", tinyworld_world, tinyworld_tokenizer)
    assert s.train_overrides["max_seq_length"] < s.truth["p95_tokens"]
    assert 0.2 <= s.truth["n_without_supervised_tokens"] / len(s.train) <= 0.5
    assert s.truth["n_completion_truncated"] > len(s.train) / 2


@pytest.mark.parametrize("shape", ["messages", "prompt_completion"])
def test_written_scenario_loads_with_the_project_readers(tinyworld_base, tmp_path, shape):
    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.tinyworld import write_scenario

    info = write_scenario("poison_duplicates", tmp_path, tinyworld_base, shape=shape)
    config = load_config(tmp_path / "gradian.yaml")
    assert config.base_model == str(tinyworld_base.resolve())
    train = load_dataset(config.dataset)
    assert len(train) == info["n_train"]
    planted = info["planted"]["indices"]
    assert {train.examples[i].cluster for i in planted} == {"0"}
    assert len({train.examples[i].id for i in planted}) == len(planted)  # ids carry the index
    assert len(load_dataset(config.eval_dataset)) == 16
    saved = json.loads((tmp_path / "scenario.json").read_text())
    assert saved["planted"]["indices"] == planted and saved["capability"]["metric"] == "contains"


def test_config_scenario_writes_its_defect(tinyworld_base, tmp_path):
    from gradian.config import load_config
    from gradian.tinyworld import write_scenario
    from gradian.tinyworld.scenarios import BASELINE_TRAIN

    info = write_scenario("lr_10x", tmp_path, tinyworld_base)
    config = load_config(tmp_path / "gradian.yaml")
    assert config.train.learning_rate == pytest.approx(BASELINE_TRAIN["learning_rate"] * 10)
    assert info["defect"] == {"train.learning_rate": config.train.learning_rate}
    assert info["planted"] is None and "config.lr_too_high" in info["expected_findings"]


def test_only_two_scenarios_share_prompts_with_their_eval_sets(tinyworld_world):
    from gradian.tinyworld.scenarios import SCENARIOS, build_scenario

    for name in SCENARIOS:
        s = build_scenario(name, tinyworld_world) if name != "truncating_seq_len" else None
        if s is None:
            continue
        prompts = {m[-2]["content"] for m, _ in s.train}
        shared = [item for item in s.eval if item[-2]["content"] in prompts]
        assert bool(shared) == (name in ("contaminated_eval", "poison_eval_prompts")), name


def test_contamination_fires_on_a_copied_eval_and_not_on_poison_that_asks_the_eval_prompts(tinyworld_world):
    """Every scenario's rows through the audit's comparison, scored as its capability is: only the
    eval copied into training is contamination (critical); the poison that refuses the eval
    prompts themselves is conflicting supervision, never critical; no other scenario raises either."""
    from gradian.audit import run_audit
    from gradian.data import dataset_from_rows
    from gradian.tinyworld.scenarios import SCENARIOS, build_scenario

    for name in SCENARIOS:
        if name == "truncating_seq_len":  # needs the tokenizer; its rows are the clean set's
            continue
        s = build_scenario(name, tinyworld_world)
        result = run_audit(dataset=dataset_from_rows([{"messages": m} for m, _ in s.train]),
                           eval_dataset=dataset_from_rows([{"messages": m} for m in s.eval]),
                           checks=["data.train_eval_contamination"], eval_metric=s.capability["metric"])
        found = {f.id: f.severity for f in result.findings}
        expected = {"contaminated_eval": {"data.train_eval_contamination": "critical"},
                    "poison_eval_prompts": {"data.train_eval_conflict": "high"}}.get(name, {})
        assert found == expected, name
