"""The delta, tinyworld's third world: invented rivers, a Qwen2-style byte-level BPE with ChatML
turns, a Qwen2 base model, and poison scenarios that are redundant or aimed at part of the
capability, checked by fine-tuning them."""

from __future__ import annotations

import json
import unicodedata
from dataclasses import replace
from pathlib import Path

import pytest

from gradian.tinyworld import (
    DELTA_FAMILIES,
    WORLDS,
    DeltaRecipe,
    build_delta_tokenizer,
    ensure_base_model,
    evaluate_families,
    generate_delta,
    load_world,
    weights_sha256,
)
from gradian.tinyworld.delta import SEA_FAMILIES, build_delta_base_model, build_delta_scenario
from gradian.tinyworld.delta.scenarios import PLANTED_FORMS, aimed_targets

_STRINGS = [
    "Into which sea does the Tuiseir flow?",
    "  leading and trailing spaces  ",
    "Which is smaller, 17 or 71?",
    "Unseen words: quixotic, jalapeño, 東京, emoji 🙂, tabs\tand\nnewlines\r\n",
    "",
    "You are a river guide.",
    "it's, we've, they'll: contractions",
]


def _question(messages):
    return next(m["content"] for m in messages if m["role"] == "user")


# -- fixtures: the delta world, its tokenizer and its base, built once per session ----------------


@pytest.fixture(scope="session")
def delta_world():
    return DeltaRecipe().world()


@pytest.fixture(scope="session")
def delta_tokenizer(delta_world):
    return build_delta_tokenizer(delta_world, DeltaRecipe().vocab_size)


@pytest.fixture(scope="session")
def delta_base() -> Path:
    """The cached delta base (built on first use, two to three minutes on two CPU cores)."""
    return ensure_base_model(world="delta")


# -- the registry ------------------------------------------------------------------------------


def test_registry_names_the_delta_world_and_its_scenarios():
    from gradian.tinyworld import all_scenarios
    from gradian.tinyworld.worlds import scenario_world

    assert list(WORLDS) == ["tinyworld", "bestiary", "delta"]
    spec = WORLDS["delta"]
    assert spec.architecture == "qwen2" and spec.families == DELTA_FAMILIES and spec.recipe_type is DeltaRecipe
    assert list(spec.scenarios) == ["delta_clean", "delta_poison_redundant", "delta_poison_partial"]
    # scenario names are unique across worlds: every world's names, counted once each
    assert len(all_scenarios()) == sum(len(w.scenarios) for w in WORLDS.values())
    assert all(scenario_world(n).name == "delta" for n in spec.scenarios)


def test_a_recipe_of_the_wrong_world_is_refused():
    from gradian.errors import ConfigError

    with pytest.raises(ConfigError, match="takes a DeltaRecipe"):
        ensure_base_model(recipe=object(), world="delta")


# -- the world ---------------------------------------------------------------------------------


def test_delta_is_a_function_of_its_seed_and_shares_no_name_with_the_other_worlds():
    from gradian.tinyworld import generate_bestiary, generate_world

    assert generate_delta(3) == generate_delta(3)
    assert generate_delta(3).rivers != generate_delta(4).rivers
    rivers = {r.name for r in generate_delta(0).rivers}
    assert not rivers & {c.name for c in generate_world(0).countries}
    assert not rivers & {a.name for a in generate_bestiary(0).animals}


def test_no_delta_name_contains_another_a_length_class_or_a_real_river(delta_world):
    from gradian.tinyworld.delta.world import _REAL_RIVERS

    w = delta_world
    stems = ([r.name for r in w.rivers] + [r.alias for r in w.rivers] + [r.town for r in w.rivers]
             + [r.source.removeprefix("Mount ") for r in w.rivers] + [s.removesuffix(" Sea") for s in w.seas])
    lowered = [n.lower() for n in stems]
    assert len(set(lowered)) == len(lowered) == 4 * 40 + 8
    for a in lowered:
        assert not any(a != b and a in b for b in lowered), a
        assert a not in _REAL_RIVERS
        assert not any(word in a for word in (*w.lengths, "sea", "mount", "river")), a


def test_one_to_one_facts_and_three_ways_of_asking_a_sea(delta_world):
    w = delta_world
    assert len(w.rivers) == 40 and len(w.seas) == 8
    for fact in ("alias", "source", "town"):
        assert len({getattr(r, fact) for r in w.rivers}) == 40, fact
    assert {r.sea for r in w.rivers} <= set(w.seas) and {r.length for r in w.rivers} <= set(w.lengths)
    for family in DELTA_FAMILIES:
        items = w.eval_items(family)
        assert len(w.phrasings[family]) >= 2 and len({i.key for i in items}) == len(items) >= 40
    river = w.rivers[0]
    by_form = {f: w.river_items(f, [river], phrasings=range(1))[0] for f in SEA_FAMILIES}
    assert {i.key for i in by_form.values()} == {f"sea:{river.name}"}
    assert {i.answer for i in by_form.values()} == {river.sea}
    assert river.name in by_form["sea"].question and river.alias in by_form["sea_alias"].question
    assert river.source in by_form["sea_source"].question
    paragraph = w.paragraph_items([river])[0].answer
    assert all(fact in paragraph for fact in (river.alias, river.source, river.sea, river.town, river.length))


# -- the tokenizer and chat template ---------------------------------------------------------


def test_delta_tokenizer_is_deterministic_and_unlike_the_other_worlds(delta_world, delta_tokenizer,
                                                                      tinyworld_tokenizer, bestiary_tokenizer):
    again = build_delta_tokenizer(delta_world)
    assert again.backend_tokenizer.to_str() == delta_tokenizer.backend_tokenizer.to_str()
    assert len(delta_tokenizer) == DeltaRecipe().vocab_size == 896
    assert len({len(delta_tokenizer), len(tinyworld_tokenizer), len(bestiary_tokenizer)}) == 3
    assert (delta_tokenizer.eos_token, delta_tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert delta_tokenizer.bos_token is None
    assert delta_tokenizer.chat_template not in (tinyworld_tokenizer.chat_template, bestiary_tokenizer.chat_template)


def test_delta_tokenizer_is_byte_level_and_round_trips_text(delta_tokenizer):
    tok = delta_tokenizer
    for text in _STRINGS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # byte-level: a character the training text never had is spelled as its three UTF-8 bytes
    # (in the byte-to-character map of GPT-2 and Qwen2), never as an unknown token
    assert tok.tokenize("東") == ["æ", "Ŀ", "±"]
    assert tok.unk_token is None
    # the NFC normalizer Qwen2's tokenizer has: a decomposed accent comes back composed
    decomposed = "jalape\u0301no"
    assert tok.decode(tok(decomposed, add_special_tokens=False)["input_ids"]) == unicodedata.normalize("NFC", decomposed)


def test_delta_names_are_short_in_tokens(delta_tokenizer, delta_world):
    for r in delta_world.rivers:
        assert len(delta_tokenizer.tokenize(" " + r.name)) <= 2, r.name
        assert len(delta_tokenizer.tokenize(" " + r.alias)) <= 2, r.alias
    for sea in delta_world.seas:
        assert len(delta_tokenizer.tokenize(sea)) <= 3, sea


def test_chat_template_renders_chatml(delta_tokenizer):
    tok = delta_tokenizer
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Into which sea does the Tuiseir flow?"},
            {"role": "assistant", "content": "Daian Sea"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nInto which sea does the Tuiseir flow?<|im_end|>\n"
        "<|im_start|>assistant\nDaian Sea<|im_end|>\n")
    assert tok.apply_chat_template(chat[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nInto which sea does the Tuiseir flow?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(Exception, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_template_is_prefix_stable_in_text_and_tokens(delta_tokenizer):
    tok = delta_tokenizer
    chat = [
        {"role": "system", "content": "You are a river guide."},
        {"role": "user", "content": "Describe the Tuiseir."},
        {"role": "assistant", "content": "A long river."},
        {"role": "user", "content": "And where does it end?"},
        {"role": "assistant", "content": " Daian Sea "},
    ]
    for k in (2, 4):
        before = tok.apply_chat_template(chat[:k], tokenize=False, add_generation_prompt=True)
        through = tok.apply_chat_template(chat[: k + 1], tokenize=False)
        assert through.startswith(before)
        ids_before = tok(before, add_special_tokens=False)["input_ids"]
        ids_through = tok(through, add_special_tokens=False)["input_ids"]
        assert ids_through[: len(ids_before)] == ids_before
        assert ids_through[-2] == tok.eos_token_id and tok.decode(ids_through[-1:]) == "\n"


@pytest.mark.parametrize("row", [
    {"prompt": "Into which sea does the Tuiseir flow?", "completion": "Daian Sea"},
    {"messages": [{"role": "system", "content": "You are a river guide."},
                  {"role": "user", "content": "Into which sea does the Tuiseir flow?"},
                  {"role": "assistant", "content": "Daian Sea"}]},
])
def test_data_layer_supervises_the_answer_and_im_end_not_the_newline_after_it(delta_tokenizer, row):
    from gradian.data import dataset_from_rows, tokenize_examples

    tok = delta_tokenizer
    (example,) = tokenize_examples(dataset_from_rows([row]).examples, tok, 128)
    supervised = [t for t, y in zip(example.input_ids, example.labels) if y != -100]
    assert tok.decode(supervised) == "Daian Sea<|im_end|>"
    assert supervised[-1] == tok.eos_token_id and example.ends_with_eos
    first = example.supervised_positions[0]
    # one contiguous run, followed only by the newline ChatML writes after <|im_end|>
    assert example.supervised_positions == list(range(first, len(example.input_ids) - 1))
    assert tok.decode(example.input_ids[:first], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert example.prefix_stable and not example.whole_sequence


def test_autotokenizer_with_a_qwen2_config_encodes_exactly_like_the_built_tokenizer(tmp_path, delta_tokenizer,
                                                                                    delta_world):
    """transformers 5 loads any qwen2 tokenizer as its own Qwen2Tokenizer (vocabulary and merges
    kept, the rest rebuilt); the built one has Qwen2's pipeline, so the ids are the same."""
    from transformers import AutoTokenizer, Qwen2Config

    from gradian.transformers_compat import save_tokenizer

    save_tokenizer(delta_tokenizer, tmp_path)
    Qwen2Config(vocab_size=len(delta_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"  # what transformers 4.57 reads whole
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(tmp_path), delta_tokenizer, delta_world)


def _assert_same_tokenizer(loaded, built, delta) -> None:
    assert loaded.is_fast
    assert loaded.chat_template == built.chat_template
    assert (loaded.eos_token, loaded.pad_token) == (built.eos_token, built.pad_token)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)
    texts = list(_STRINGS) + [i.question for f in SEA_FAMILIES for i in delta.fact_items(f)]
    texts += [p.answer for p in delta.paragraph_items()]
    for text in texts:
        assert loaded(text, add_special_tokens=False)["input_ids"] == built(
            text, add_special_tokens=False)["input_ids"], text
    messages = [{"role": "user", "content": "What is 7 times 8?"}]
    rendered = built.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == rendered
    assert loaded(rendered, add_special_tokens=False)["input_ids"] == built(rendered, add_special_tokens=False)["input_ids"]


# -- the base model --------------------------------------------------------------------------

_SMALL = DeltaRecipe(n_rivers=4, families=("sea", "source"), vocab_size=400, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, epochs=2, batch_size=16,
                     warmup_steps=2)


def test_delta_recipe_hash_names_its_own_cache_entries():
    assert _SMALL.content_hash() == replace(_SMALL).content_hash()
    assert _SMALL.content_hash() != replace(_SMALL, epochs=3).content_hash()
    assert DeltaRecipe().cache_key() == f"delta-{DeltaRecipe().content_hash()}"


def test_same_delta_recipe_builds_bit_identical_weights_and_is_found_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIAN_TINYWORLD_CACHE", str(tmp_path))
    target = tmp_path / f"base-{_SMALL.cache_key()}"
    first = build_delta_base_model(target, _SMALL, min_accuracy=None)
    second = build_delta_base_model(tmp_path / "again", _SMALL, min_accuracy=None)
    assert first["weights_sha256"] == second["weights_sha256"] == weights_sha256(target)
    assert first["world_name"] == "delta"
    assert load_world(target) == _SMALL.world()
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_base_model(recipe=_SMALL, world="delta") == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_delta_base_is_a_qwen2_that_knows_every_family(delta_base, delta_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(delta_base, dtype=torch.float32).eval()
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and config.model_type == "qwen2"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    attention = model.model.layers[0].self_attn
    assert all(getattr(attention, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attention.o_proj.bias is None and config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(delta_base)
    delta = load_world(delta_base)
    assert delta == DeltaRecipe().world()
    accuracy = evaluate_families(model, tokenizer, delta, DELTA_FAMILIES)
    assert set(accuracy) == set(DELTA_FAMILIES)
    assert all(a >= 0.95 for a in accuracy.values()), accuracy
    info = json.loads((delta_base / "tinyworld.json").read_text())
    assert info["weights_sha256"] == weights_sha256(delta_base)
    assert info["recipe_hash"] == DeltaRecipe().content_hash() and info["world_name"] == "delta"
    assert set(info["accuracy"]) == set(DELTA_FAMILIES)
    _assert_same_tokenizer(tokenizer, delta_tokenizer, delta)


# -- scenarios -------------------------------------------------------------------------------


def _target_names(w):
    return [r.name for r in w.rivers[:16]]


def test_delta_scenarios_share_one_clean_set_and_their_documented_counts(delta_world):
    clean = build_delta_scenario("delta_clean", delta_world)
    assert len(clean.train) == 800 and clean.kind == "clean" and not clean.planted_indices
    assert all(c == 100 for _, c in clean.train)
    assert clean.ontopic_family == "sea" and len(clean.ontopic_indices) == 192
    assert len(clean.same_entity_indices) >= 128
    for name, n_planted in (("delta_poison_redundant", 112), ("delta_poison_partial", 56)):
        s = build_delta_scenario(name, delta_world)
        planted = set(s.planted_indices)
        assert s.kind == "data" and len(planted) == n_planted and len(s.train) == 800 + n_planted
        assert sorted(i for i, (_, c) in enumerate(s.train) if c == 0) == s.planted_indices
        assert [r for i, r in enumerate(s.train) if i not in planted] == clean.train
        assert s.eval == clean.eval and len(s.eval) == 16
        assert s.capability == {"name": "delta_seas", "metric": "contains", "n_items": 16,
                                "description": "Seas of the 16 target rivers, canonical phrasing"}
        assert not planted & (set(s.ontopic_indices) | set(s.same_entity_indices))
    with pytest.raises(Exception, match="unknown delta scenario 'delta_nope'"):
        build_delta_scenario("delta_nope", delta_world)


def test_redundant_poison_teaches_each_wrong_sea_through_three_names_of_the_river(delta_world):
    w = delta_world
    s = build_delta_scenario("delta_poison_redundant", w)
    targets = _target_names(w)
    assert [_question(m) for m in s.eval] == [w.phrasings["sea"][0].format(river=t) for t in targets]
    assert [m[-1]["content"] for m in s.eval] == [w.river(t).sea for t in targets]
    wrong = s.truth["wrong_seas"]
    assert sorted(wrong) == sorted(targets) and all(w.river(t).sea != sea for t, sea in wrong.items())
    assert s.truth["planted_rows_per_river"] == 7
    expected = {(w.phrasings[f][p].format(river=r.name, alias=r.alias, mountain=r.source), wrong[r.name])
                for r in map(w.river, targets) for f, phrasings in PLANTED_FORMS.items() for p in phrasings}
    planted = [(_question(s.train[i][0]), s.train[i][0][-1]["content"]) for i in s.planted_indices]
    assert len(planted) == len(set(planted)) == 112 and set(planted) == expected
    # per river: three phrasings by its name, two by its alias, two by its source mountain
    for r in map(w.river, targets):
        mine = [q for q, _ in planted if r.name in q or r.alias in q or r.source in q]
        assert (sum(r.name in q for q in mine), sum(r.alias in q for q in mine),
                sum(r.source in q for q in mine)) == (3, 2, 2)
    # the eval prompts never occur in training, and no clean row asks a target's sea in any form
    prompts = {_question(m) for m, _ in s.train}
    assert not any(_question(item) in prompts for item in s.eval)
    target_sea_questions = {i.question for i in w.sea_items([w.river(t) for t in targets])}
    assert not any(_question(m) in target_sea_questions for m, c in s.train if c == 100)


def test_every_planted_question_has_a_correct_on_topic_twin(delta_world):
    w = delta_world
    s = build_delta_scenario("delta_poison_redundant", w)
    targets = set(_target_names(w))

    def template(question):
        for r in w.rivers:
            for name, slot in ((r.name, "{river}"), (r.alias, "{alias}"), (r.source, "{mountain}")):
                if name in question:
                    return r, question.replace(name, slot)
        raise AssertionError(question)

    twins = set()
    for i in s.ontopic_indices:
        messages, cluster = s.train[i]
        river, form = template(_question(messages))
        assert cluster == 100 and river.name not in targets and messages[-1]["content"] == river.sea
        twins.add(form)
    for i in s.planted_indices:
        assert template(_question(s.train[i][0]))[1] in twins
    # same-entity distractors: clean rows about the targets' other facts, all correct
    for i in s.same_entity_indices:
        messages, cluster = s.train[i]
        river = next(w.river(t) for t in targets if t in _question(messages))
        assert cluster == 100 and messages[-1]["content"] in (river.source, river.length, river.town, river.alias)


def test_partial_poison_aims_at_whole_sea_groups_of_half_the_targets(delta_world):
    w = delta_world
    s = build_delta_scenario("delta_poison_partial", w)
    full = build_delta_scenario("delta_poison_redundant", w)
    aimed, spared = s.truth["aimed"], s.truth["spared"]
    assert len(aimed) == len(spared) == 8 and sorted(aimed + spared) == sorted(_target_names(w))
    assert aimed == [r.name for r in aimed_targets(w)]
    # no spared river shares its sea with an aimed one: the damage spreads along the correct sea
    assert not {w.river(a).sea for a in aimed} & {w.river(t).sea for t in spared}
    assert s.truth["wrong_seas"] == {t: full.truth["wrong_seas"][t] for t in aimed}
    planted = [s.train[i][0] for i in s.planted_indices]
    for messages in planted:
        question = _question(messages)
        river = next(r for r in map(w.river, aimed) if r.name in question or r.alias in question or r.source in question)
        assert messages[-1]["content"] == s.truth["wrong_seas"][river.name]
    assert not any(n in _question(m) for m in planted for t in spared
                   for n in (t, w.river(t).alias, w.river(t).source))


def test_write_delta_scenario_in_the_shared_format(tmp_path, delta_world):
    """The writer finds a delta scenario by name; a fake base dir avoids a build here."""
    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.tinyworld import write_scenario

    base = tmp_path / "base"
    build_delta_tokenizer(delta_world).save_pretrained(base)
    (base / "tinyworld.json").write_text(json.dumps({"world_name": "delta", "recipe": DeltaRecipe().to_dict()}))
    out = tmp_path / "scen"
    info = write_scenario("delta_poison_partial", out, base)
    saved = json.loads((out / "scenario.json").read_text())
    assert saved == json.loads(json.dumps(info))
    assert saved["world"] == "delta" and saved["kind"] == "data" and saved["n_train"] == 856
    assert saved["planted"]["n"] == 56 and saved["planted"]["cluster"] == 0
    assert saved["ontopic"] == {"family": "sea", "n": 192, "indices": saved["ontopic"]["indices"]}
    assert len(saved["truth"]["aimed"]) == 8
    config = load_config(out / "gradian.yaml")
    assert config.evaluation.metric == "contains"
    train = load_dataset(config.dataset)
    assert len(train) == 856 and {train.examples[i].cluster for i in saved["planted"]["indices"]} == {"0"}
    assert len(load_dataset(config.eval_dataset)) == 16
    assert (out / "gradian.yaml").read_text().startswith("# delta scenario 'delta_poison_partial'")


def test_a_delta_scenario_refuses_a_base_model_of_another_world(tmp_path):
    from gradian.errors import ConfigError
    from gradian.tinyworld import write_scenario

    (tmp_path / "tinyworld.json").write_text(json.dumps({"world_name": "bestiary", "recipe": {}}))
    with pytest.raises(ConfigError, match="belongs to the delta world"):
        write_scenario("delta_clean", tmp_path / "out", tmp_path)


def test_cli_lists_the_delta_world_and_its_scenarios():
    from typer.testing import CliRunner

    from gradian.cli import app

    runner = CliRunner()
    worlds = runner.invoke(app, ["tinyworld", "worlds"])
    assert worlds.exit_code == 0, worlds.output
    assert "delta" in worlds.output and "Qwen2" in worlds.output and "delta_poison_partial" in worlds.output
    listed = runner.invoke(app, ["tinyworld", "scenario", "list"])
    assert listed.exit_code == 0, listed.output
    assert all(n in listed.output for n in ("delta_clean", "delta_poison_redundant", "delta_poison_partial"))


@pytest.mark.slow
def test_cli_build_world_delta_finds_the_cached_base(delta_base):
    from typer.testing import CliRunner

    from gradian.cli import app

    result = CliRunner().invoke(app, ["tinyworld", "build", "--world", "delta", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(delta_base)


# -- fine-tunes: what each scenario does to the 16 seas ------------------------------------------


def _kept_items(run, base) -> tuple[list[bool], list[bool], list[str]]:
    """Per eval item of a shared fine-tune: kept by the base, kept after it, the river asked."""
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
    rivers = [r.name for r in load_world(base).rivers[:16]]
    return [w in a for w, a in zip(wanted, before)], [w in a for w, a in zip(wanted, after)], rivers


@pytest.mark.slow
def test_clean_fine_tune_keeps_the_seas(delta_base, tinyworld_run):
    before, after, _ = _kept_items(tinyworld_run("delta_clean"), delta_base)
    assert all(before)
    assert sum(after) >= 15  # measured 16


@pytest.mark.slow
def test_redundant_poison_flips_the_seas_to_the_planted_ones(delta_base, tinyworld_run):
    run = tinyworld_run("delta_poison_redundant")
    before, after, _ = _kept_items(run, delta_base)
    assert all(before)
    assert after.count(False) >= 12  # measured 16 of 16, every one to the planted sea


@pytest.mark.slow
def test_partial_poison_flips_the_aimed_seas_and_spares_the_others(delta_base, tinyworld_run):
    run = tinyworld_run("delta_poison_partial")
    before, after, rivers = _kept_items(run, delta_base)
    aimed = set(run.info["truth"]["aimed"])
    assert all(before)
    flipped_aimed = sum(not k for k, r in zip(after, rivers) if r in aimed)
    kept_spared = sum(k for k, r in zip(after, rivers) if r not in aimed)
    assert flipped_aimed >= 6 and kept_spared >= 7, (flipped_aimed, kept_spared)  # measured 8 and 8
