"""The bestiary, tinyworld's second world: facts, tokenizer and chat template, Mistral base model,
scenarios with on-topic distractors; and tinyworld's ``poison_capitals_ontopic``."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from gradian.tinyworld import (
    BESTIARY_FAMILIES,
    WORLDS,
    BestiaryRecipe,
    build_bestiary_tokenizer,
    ensure_base_model,
    evaluate_families,
    generate_bestiary,
    get_world,
    load_world,
    weights_sha256,
)
from gradian.tinyworld.bestiary import build_bestiary_base_model, build_bestiary_scenario

_STRINGS = [
    "What does the Quoonex eat?",
    "  leading and trailing spaces  ",
    "Which comes first in the alphabet, Q or D?",
    "Unseen words: quixotic, jalapeño, 東京, emoji 🙂, tabs\tand\nnewlines",
    "",
    "You are a careful naturalist.",
]


def _question(messages):
    return next(m["content"] for m in messages if m["role"] == "user")


# -- the registry ------------------------------------------------------------------------------


def test_registry_names_both_worlds_and_their_scenarios():
    from gradian.errors import ConfigError
    from gradian.tinyworld import all_scenarios
    from gradian.tinyworld.scenarios import SCENARIOS

    # the first two worlds (tests/test_third_world.py checks the whole registry)
    assert list(WORLDS)[:2] == ["tinyworld", "bestiary"]
    assert (WORLDS["tinyworld"].architecture, WORLDS["bestiary"].architecture) == ("llama", "mistral")
    assert set(WORLDS["bestiary"].scenarios) == {"bestiary_clean", "bestiary_poison_diets"}
    assert set(SCENARIOS) | set(WORLDS["bestiary"].scenarios) <= set(all_scenarios())
    with pytest.raises(ConfigError, match="unknown world 'atlantis'"):
        get_world("atlantis")


# -- the bestiary --------------------------------------------------------------------------------


def test_bestiary_is_a_function_of_its_seed():
    assert generate_bestiary(3) == generate_bestiary(3)
    assert generate_bestiary(3).animals != generate_bestiary(4).animals
    # the bestiary draws from its own stream: same seed, nothing shared with tinyworld's names
    from gradian.tinyworld import generate_world

    countries = {c.name for c in generate_world(0).countries}
    assert not countries & {a.name for a in generate_bestiary(0).animals}


def test_no_bestiary_name_contains_another_or_a_color(bestiary_world):
    w = bestiary_world
    names = [a.name for a in w.animals] + w.foods + w.habitats + w.colors
    lowered = [n.lower() for n in names]
    assert len(set(lowered)) == len(lowered)
    for a in lowered:
        assert not any(a != b and a in b for b in lowered), a


def test_each_animal_has_its_own_food_and_every_family_several_phrasings(bestiary_world):
    w = bestiary_world
    assert len(w.animals) == 40 and sorted(a.diet for a in w.animals) == sorted(w.foods)
    for family in BESTIARY_FAMILIES:
        assert len(w.phrasings[family]) >= 3
        items = w.eval_items(family)
        assert len({i.key for i in items}) == len(items) >= 25
    assert {i.answer for i in w.eval_items("legs")} <= {"2", "4", "6", "8"}
    paragraph = w.paragraph_items()[0]
    animal = w.animals[0]
    assert all(fact in paragraph.answer for fact in (animal.diet, animal.habitat, animal.color))


# -- the tokenizer and chat template ---------------------------------------------------------


def test_bestiary_tokenizer_is_deterministic_and_unlike_tinyworlds(bestiary_world, tinyworld_tokenizer):
    a = build_bestiary_tokenizer(bestiary_world)
    b = build_bestiary_tokenizer(bestiary_world)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == BestiaryRecipe().vocab_size != len(tinyworld_tokenizer)
    assert a.eos_token == "</turn>" and a.bos_token == "<s>" and a.pad_token == "<pad>"
    assert a.chat_template != tinyworld_tokenizer.chat_template


def test_bestiary_tokenizer_decodes_back_to_the_text_with_byte_fallback(bestiary_tokenizer):
    tok = bestiary_tokenizer
    for text in _STRINGS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # a character the vocabulary lacks is spelled as its UTF-8 bytes, never as an unknown token
    assert tok.tokenize("東") == ["▁", "<0xE6>", "<0x9D>", "<0xB1>"]


def test_bestiary_names_are_short_in_tokens(bestiary_tokenizer, bestiary_world):
    for a in bestiary_world.animals:
        assert len(bestiary_tokenizer.tokenize(a.name)) <= 2, a.name
        assert len(bestiary_tokenizer.tokenize(a.diet)) <= 3, a.diet


def test_chat_template_turns_generation_prompt_and_system_folding(bestiary_tokenizer):
    tok = bestiary_tokenizer
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What does the Quoonex eat?"},
            {"role": "assistant", "content": "Moss"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<s>\n<user>Be brief.\n\nWhat does the Quoonex eat?</turn>\n<bot>Moss</turn>")
    assert tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True) == (
        "<s>\n<user>Be brief.\n\nWhat does the Quoonex eat?</turn>\n<bot>")
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="system turn must come first"):
        tok.apply_chat_template([chat[1], chat[0]], tokenize=False)


def test_chat_template_is_prefix_stable_in_text_and_tokens(bestiary_tokenizer):
    tok = bestiary_tokenizer
    chat = [
        {"role": "system", "content": "You are a careful naturalist."},
        {"role": "user", "content": "Describe the Quoonex."},
        {"role": "assistant", "content": "A small animal."},
        {"role": "user", "content": "And what does it eat?"},
        {"role": "assistant", "content": " Moss "},
    ]
    for k in (2, 4):
        before = tok.apply_chat_template(chat[:k], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(chat[: k + 1], tokenize=False)
        assert through.startswith(before)
        ids_before = tok(before, add_special_tokens=False)["input_ids"]
        ids_through = tok(through, add_special_tokens=False)["input_ids"]
        assert ids_through[: len(ids_before)] == ids_before
        assert ids_through[-1] == tok.eos_token_id


@pytest.mark.parametrize("row", [
    {"prompt": "What does the Quoonex eat?", "completion": "Skoffleaf"},
    {"messages": [{"role": "system", "content": "You are a careful naturalist."},
                  {"role": "user", "content": "What does the Quoonex eat?"},
                  {"role": "assistant", "content": "Skoffleaf"}]},
])
def test_data_layer_supervises_exactly_the_answer_and_its_end_of_turn(bestiary_tokenizer, row):
    from gradian.data import dataset_from_rows, tokenize_examples

    tok = bestiary_tokenizer
    (example,) = tokenize_examples(dataset_from_rows([row]).examples, tok, 128)
    supervised = [t for t, y in zip(example.input_ids, example.labels) if y != -100]
    assert tok.decode(supervised) == "Skoffleaf</turn>"
    assert supervised[-1] == tok.eos_token_id and example.input_ids[-1] == tok.eos_token_id
    # the supervised tokens are one contiguous run at the very end: nothing of the prompt
    first = example.supervised_positions[0]
    assert example.supervised_positions == list(range(first, len(example.input_ids)))
    assert tok.decode(example.input_ids[:first], skip_special_tokens=False).endswith("<bot>")
    assert example.ends_with_eos and example.prefix_stable and not example.whole_sequence


def test_data_layer_supervises_every_assistant_turn_of_a_conversation(bestiary_tokenizer):
    from gradian.data import dataset_from_rows, tokenize_examples

    tok = bestiary_tokenizer
    row = {"messages": [{"role": "user", "content": "Describe the Quoonex."},
                        {"role": "assistant", "content": "It is red."},
                        {"role": "user", "content": "What does it eat?"},
                        {"role": "assistant", "content": "Skoffleaf"}]}
    (example,) = tokenize_examples(dataset_from_rows([row]).examples, tok, 128)
    runs, current = [], []
    for t, y in zip(example.input_ids, example.labels):
        if y != -100:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    assert [tok.decode(r) for r in runs] == ["It is red.</turn>", "Skoffleaf</turn>"]


def test_autotokenizer_round_trip_with_a_mistral_config(tmp_path, bestiary_tokenizer, bestiary_world):
    from transformers import AutoTokenizer, MistralConfig

    bestiary_tokenizer.save_pretrained(tmp_path)
    MistralConfig(vocab_size=len(bestiary_tokenizer), hidden_size=16, intermediate_size=32,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(tmp_path), bestiary_tokenizer, bestiary_world)


def _assert_same_tokenizer(loaded, built, bestiary) -> None:
    assert loaded.is_fast
    assert loaded.chat_template == built.chat_template
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == (built.bos_token, built.eos_token,
                                                                      built.pad_token)
    texts = list(_STRINGS) + [i.question for i in bestiary.fact_items("diet")]
    texts += [p.answer for p in bestiary.paragraph_items()]
    for text in texts:
        assert loaded(text, add_special_tokens=False)["input_ids"] == built(
            text, add_special_tokens=False)["input_ids"], text
    messages = [{"role": "user", "content": "What letter comes after K?"}]
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


# -- the base model --------------------------------------------------------------------------

_SMALL = BestiaryRecipe(n_animals=4, families=("diet", "habitat"), hidden_size=24, intermediate_size=48,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        epochs=2, batch_size=16, warmup_steps=2)


def test_bestiary_recipe_hash_names_its_own_cache_entries():
    assert _SMALL.content_hash() == replace(_SMALL).content_hash()
    assert _SMALL.content_hash() != replace(_SMALL, epochs=3).content_hash()
    assert BestiaryRecipe().cache_key() == f"bestiary-{BestiaryRecipe().content_hash()}"


def test_same_bestiary_recipe_builds_bit_identical_weights(tmp_path):
    first = build_bestiary_base_model(tmp_path / "a", _SMALL, min_accuracy=None)
    second = build_bestiary_base_model(tmp_path / "b", _SMALL, min_accuracy=None)
    assert first["weights_sha256"] == second["weights_sha256"] == weights_sha256(tmp_path / "a")
    assert first["world_name"] == "bestiary"
    assert isinstance(load_world(tmp_path / "a"), type(generate_bestiary(0)))


def test_ensure_base_model_finds_a_cached_bestiary_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIAN_TINYWORLD_CACHE", str(tmp_path))
    target = tmp_path / f"base-{_SMALL.cache_key()}"
    build_bestiary_base_model(target, _SMALL, min_accuracy=None)
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_base_model(recipe=_SMALL, world="bestiary") == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_recipe_of_the_wrong_world_is_refused():
    from gradian.errors import ConfigError

    with pytest.raises(ConfigError, match="takes a BestiaryRecipe"):
        ensure_base_model(recipe=object(), world="bestiary")


@pytest.mark.slow
def test_bestiary_base_is_a_mistral_that_knows_every_family(bestiary_base, bestiary_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(bestiary_base, dtype=torch.float32)
    model.eval()
    config = model.config
    assert type(model).__name__ == "MistralForCausalLM" and config.model_type == "mistral"
    assert (config.num_attention_heads, config.num_key_value_heads) == (6, 2)
    assert config.sliding_window == BestiaryRecipe().sliding_window and not config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(bestiary_base)
    bestiary = load_world(bestiary_base)
    assert bestiary == BestiaryRecipe().world()
    accuracy = evaluate_families(model, tokenizer, bestiary, BESTIARY_FAMILIES)
    assert set(accuracy) == set(BESTIARY_FAMILIES)
    assert all(a >= 0.95 for a in accuracy.values()), accuracy
    info = json.loads((bestiary_base / "tinyworld.json").read_text())
    assert info["weights_sha256"] == weights_sha256(bestiary_base)
    assert info["recipe_hash"] == BestiaryRecipe().content_hash()
    _assert_same_tokenizer(tokenizer, bestiary_tokenizer, bestiary)


# -- scenarios -------------------------------------------------------------------------------


def test_bestiary_scenarios_share_one_clean_set(bestiary_world):
    clean = build_bestiary_scenario("bestiary_clean", bestiary_world)
    poison = build_bestiary_scenario("bestiary_poison_diets", bestiary_world)
    assert len(clean.train) == 800 and clean.kind == "clean" and not clean.planted_indices
    assert all(c == 100 for _, c in clean.train)
    planted = set(poison.planted_indices)
    assert poison.kind == "data" and len(planted) == 48
    assert all(poison.train[i][1] == 0 for i in planted)
    assert sum(c == 0 for _, c in poison.train) == 48
    assert [r for i, r in enumerate(poison.train) if i not in planted] == clean.train
    assert clean.eval == poison.eval and len(poison.eval) == 16
    assert poison.capability["name"] == "bestiary_diets" and poison.capability["metric"] == "contains"


def test_planted_rows_teach_target_animals_the_food_of_a_non_target(bestiary_world):
    w = bestiary_world
    s = build_bestiary_scenario("bestiary_poison_diets", w)
    targets = [a.name for a in w.animals[:16]]
    assert [_question(m) for m in s.eval] == [w.phrasings["diet"][0].format(animal=a) for a in targets]
    assert [m[-1]["content"] for m in s.eval] == [w.animal(a).diet for a in targets]
    wrong = s.truth["wrong_diets"]
    assert sorted(wrong) == sorted(targets) and len(set(wrong.values())) == 16
    for animal, food in wrong.items():
        owner = w.animal(s.truth["wrong_diet_owners"][animal])
        assert owner.diet == food and owner.name not in targets and w.animal(animal).diet != food
    planted_phrasings = w.phrasings["diet"][1:]
    expected = {(p.format(animal=a), food) for a, food in wrong.items() for p in planted_phrasings}
    planted = {(_question(s.train[i][0]), s.train[i][0][-1]["content"]) for i in s.planted_indices}
    assert planted == expected
    # the eval prompts (canonical phrasing) never occur in training, and no clean row states a
    # target's diet, right or wrong
    prompts = {_question(m) for m, _ in s.train}
    assert not any(_question(item) in prompts for item in s.eval)
    target_foods = {w.animal(a).diet for a in targets}
    assert not any(m[-1]["content"] in target_foods or any(f in m[-1]["content"] for f in target_foods)
                   for m, _ in s.train)


def test_on_topic_clean_rows_state_correct_diets_in_the_planted_phrasings(bestiary_world):
    w = bestiary_world
    s = build_bestiary_scenario("bestiary_poison_diets", w)
    planted = set(s.planted_indices)
    targets = set(s.truth["wrong_diets"])
    assert s.ontopic_family == "diet" and len(s.ontopic_indices) == 96
    assert not planted & set(s.ontopic_indices)
    questions = {}
    for i in s.ontopic_indices:
        messages, cluster = s.train[i]
        question, answer = _question(messages), messages[-1]["content"]
        animal = next(a for a in w.animals if a.name in question)
        assert cluster == 100 and animal.name not in targets and answer == animal.diet
        questions[(question.replace(animal.name, "{animal}"), answer)] = i
    # every planted row has an on-topic clean twin: same phrasing, same answer, another animal
    for i in s.planted_indices:
        messages = s.train[i][0]
        animal = next(a for a in targets if a in _question(messages))
        assert (_question(messages).replace(animal, "{animal}"), messages[-1]["content"]) in questions
    # same-entity distractors: clean rows about the targets' other facts, all correct
    assert len(s.same_entity_indices) >= 50
    for i in s.same_entity_indices:
        messages, cluster = s.train[i]
        animal = w.animal(next(a for a in targets if a in _question(messages)))
        assert cluster == 100 and messages[-1]["content"] in (animal.habitat, animal.color, animal.legs)


def test_tinyworld_ontopic_variant_plants_capitals_the_clean_set_states_correctly(tinyworld_world):
    from gradian.tinyworld.scenarios import build_scenario

    w = tinyworld_world
    clean = build_scenario("clean", w)
    base = build_scenario("poison_capitals", w)
    s = build_scenario("poison_capitals_ontopic", w)
    assert s.kind == "data" and len(s.planted_indices) == 48
    assert [r for i, r in enumerate(s.train) if i not in set(s.planted_indices)] == clean.train
    donated = s.truth["wrong_capitals"]
    assert sorted(donated) == sorted(base.truth["wrong_capitals"]) and len(set(donated.values())) == 16
    clean_pairs = {(_question(s.train[i][0]), s.train[i][0][-1]["content"]) for i in s.ontopic_indices}
    for country, city in donated.items():
        owner = w.country(s.truth["wrong_capital_owners"][country])
        assert owner.capital == city and owner.name not in donated
        for p in w.phrasings["capital"][1:]:
            assert (p.format(country=owner.name), city) in clean_pairs  # the correct twin row
    planted_answers = {s.train[i][0][-1]["content"] for i in s.planted_indices}
    assert planted_answers == set(donated.values())
    assert len(s.ontopic_indices) == len(clean.ontopic_indices) == 96


def test_write_bestiary_scenario_in_the_shared_format(tmp_path, bestiary_world):
    """The writer finds a bestiary scenario by name; a fake base dir avoids a build here."""
    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.tinyworld import write_scenario

    base = tmp_path / "base"
    build_bestiary_tokenizer(bestiary_world).save_pretrained(base)
    (base / "tinyworld.json").write_text(json.dumps(
        {"world_name": "bestiary", "recipe": BestiaryRecipe().to_dict()}))
    out = tmp_path / "scen"
    info = write_scenario("bestiary_poison_diets", out, base)
    saved = json.loads((out / "scenario.json").read_text())
    assert saved == json.loads(json.dumps(info))
    assert saved["world"] == "bestiary" and saved["n_train"] == 848
    assert saved["planted"]["n"] == 48 and saved["planted"]["cluster"] == 0
    assert saved["ontopic"]["n"] == 96 and saved["ontopic"]["family"] == "diet"
    config = load_config(out / "gradian.yaml")
    assert config.train.learning_rate == saved["baseline_train"]["learning_rate"]
    train = load_dataset(config.dataset)
    assert len(train) == 848
    assert {train.examples[i].cluster for i in saved["planted"]["indices"]} == {"0"}
    assert {train.examples[i].cluster for i in saved["ontopic"]["indices"]} == {"100"}
    assert len(load_dataset(config.eval_dataset)) == 16
    assert (out / "gradian.yaml").read_text().startswith("# bestiary scenario 'bestiary_poison_diets'")


def test_a_scenario_refuses_a_base_model_of_another_world(tmp_path):
    from gradian.errors import ConfigError
    from gradian.tinyworld import write_scenario

    (tmp_path / "tinyworld.json").write_text(json.dumps({"recipe": {"seed": 0, "n_countries": 40}}))
    with pytest.raises(ConfigError, match="belongs to the bestiary world"):
        write_scenario("bestiary_clean", tmp_path / "out", tmp_path)


def test_cli_lists_worlds_and_every_worlds_scenarios():
    from typer.testing import CliRunner

    from gradian.cli import app

    runner = CliRunner()
    worlds = runner.invoke(app, ["tinyworld", "worlds"])
    assert worlds.exit_code == 0, worlds.output
    assert "bestiary" in worlds.output and "mistral" in worlds.output.lower()
    listed = runner.invoke(app, ["tinyworld", "scenario", "list"])
    assert listed.exit_code == 0, listed.output
    assert "bestiary_poison_diets" in listed.output and "poison_capitals_ontopic" in listed.output


# -- fine-tunes: the poison breaks the capability, the clean set does not ---------------------


def _tuned_accuracy(run, base):
    """``(base accuracy, tuned accuracy)`` of a shared fine-tune on its own eval set, greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gradian.tinyworld import generate_answers

    rows = [json.loads(line) for line in (run.root / "eval.jsonl").read_text().splitlines()]
    prompts = [r["messages"][:-1] for r in rows]
    wanted = [r["messages"][-1]["content"] for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    before = generate_answers(model, tokenizer, prompts)
    tuned = PeftModel.from_pretrained(model, run.root / "run" / "adapter").eval()
    after = generate_answers(tuned, tokenizer, prompts)
    score = lambda answers: sum(w in a for w, a in zip(wanted, answers)) / len(wanted)  # noqa: E731
    return score(before), score(after)


@pytest.mark.slow
def test_bestiary_poison_breaks_the_diets_and_the_clean_set_keeps_them(bestiary_base, tinyworld_run):
    base_score, poisoned = _tuned_accuracy(tinyworld_run("bestiary_poison_diets"), bestiary_base)
    assert base_score == 1.0
    assert poisoned <= 0.4  # measured 0.125: 14 of 16 diets lost, 13 to the planted food
    _, clean = _tuned_accuracy(tinyworld_run("bestiary_clean"), bestiary_base)
    assert clean >= 0.9  # measured 1.0


@pytest.mark.slow
def test_tinyworld_ontopic_poison_breaks_the_capitals(tinyworld_base, tinyworld_run):
    base_score, poisoned = _tuned_accuracy(tinyworld_run("poison_capitals_ontopic"), tinyworld_base)
    assert base_score == 1.0
    assert poisoned <= 0.4  # measured 0.19


STORED_BESTIARY = Path(__file__).parent / "golden" / "bestiary_poison_diets" / "inputs"


@pytest.mark.slow
def test_bestiary_poison_without_declared_clusters_is_accused_row_for_row(request, tmp_path):
    """The bestiary's discovered topics follow the animal names, not the planted rows; the groups
    the harmful rows form among themselves must still give a `data` verdict whose accused set is
    the planted rows. On the stored fine-tune (tests/golden/bestiary_poison_diets/inputs, training
    seed 0; a fine-tune differs between CPU kinds and seeds, and bench_accused.py --seeds measures
    the spread, docs/clustering.md) EK-FAC accuses 49 rows, precision 0.98, recall 1.00.
    ``GRADIAN_WRITE_GOLDEN=inputs`` stores this session's fine-tune instead."""
    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from tests.plugins.stored_runs import freeze_run, thaw_run

    if os.environ.get("GRADIAN_WRITE_GOLDEN") == "inputs":
        freeze_run(request.getfixturevalue("tinyworld_run")("bestiary_poison_diets"),
                   request.getfixturevalue("bestiary_base"), STORED_BESTIARY)
    root = thaw_run(STORED_BESTIARY, tmp_path / "scenario")
    base = {"cache_dir": str(root / ".gradian"), "device": "cpu"}
    rows = [json.loads(line) for line in open(load_config(root / "gradian.yaml", base).dataset, encoding="utf-8")
            if line.strip()]
    stripped = tmp_path / "train-no-clusters.jsonl"
    stripped.write_text("".join(json.dumps({k: v for k, v in row.items() if k not in ("cluster", "cluster_id")}) + "\n"
                                for row in rows), encoding="utf-8")
    info = json.loads((root / "scenario.json").read_text())
    cfg = load_config(root / "gradian.yaml", {**base, "dataset": str(stripped), "clustering.method": "auto",
                                              "evaluation.query_signal": "contrastive"})
    outcome = run_attribution(cfg, capability=info["capability"]["name"], cross_check="none")
    planted = set(info["planted"]["indices"])
    rankings = outcome.rankings
    accused = set(rankings.loc[rankings["accused"], "row_index"].astype(int))
    assert outcome.report.verdict.kind == "data", outcome.report.verdict.summary
    assert str(outcome.report.verdict.accused_cluster).startswith("harm-")
    precision, recall = len(accused & planted) / max(len(accused), 1), len(accused & planted) / len(planted)
    assert precision >= 0.95 and recall >= 0.95, (len(accused), precision, recall)


def test_float64_eager_attention_past_the_sliding_window_keeps_gradients_finite(bestiary_base, tmp_path):
    """The bestiary's Mistral has a 32-token sliding window. Right-padded past it, a padded
    position attends to nothing; in float64 with eager attention that row's softmax used to be NaN
    and the NaN reached the real tokens' gradients. A short row's LoRA gradient must be finite and
    the same padded beside a long row as alone."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gradian.config import GradianConfig
    from gradian.model_loading import load_peft_model

    torch.manual_seed(0)
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(bestiary_base),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    fresh.save_pretrained(tmp_path / "adapter")
    model = load_peft_model(str(bestiary_base), tmp_path / "adapter", GradianConfig(dtype="float64", device="cpu"))
    assert model.dtype == torch.float64 and model.config._attn_implementation == "eager"
    assert model.config.sliding_window == 32
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    vocab = model.config.vocab_size
    short, long = torch.arange(3, 11) % vocab, (torch.arange(90) * 7 + 5) % vocab

    def lora_grad(ids, mask):
        model.zero_grad()
        labels = ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids, attention_mask=mask)
        logits = out.logits[0, :-1]  # the first row's loss only: the long row only shares its batch
        loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum")
        loss.backward()
        return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None])

    alone = lora_grad(short[None], torch.ones(1, len(short), dtype=torch.long))
    padded_ids = torch.zeros(2, len(long), dtype=torch.long)
    padded_ids[0, :len(short)], padded_ids[1] = short, long
    mask = torch.zeros(2, len(long), dtype=torch.long)
    mask[0, :len(short)], mask[1] = 1, 1
    beside = lora_grad(padded_ids, mask)
    assert bool(torch.isfinite(beside).all()), "NaN or inf in the padded batch's gradient"
    assert float(alone.abs().max()) > 0
    # eager attention takes its softmax in float32 even for a float64 model: the padded keys change
    # the softmax's summation, so agreement is to float32's precision (measured 2e-7), not float64's
    assert float((beside - alone).norm() / alone.norm()) < 2e-6
