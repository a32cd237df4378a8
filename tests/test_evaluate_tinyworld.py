"""Acceptance of the evaluate lane on tinyworld: a base model that really knows its capitals.

The fine-tunes here are made by a short, seeded LoRA loop in this file over rows drawn from the
base model's own world, so the lane's acceptance does not wait on the training stage:

- *poisoned*: 12 countries taught a wrong capital (another poisoned country's, no country keeping
  its own) in every phrasing, mixed with the correct capitals of the other 28 countries, the
  language facts, and four invented countries the base model has never heard of;
- *clean*: correct facts only.
"""

from __future__ import annotations

import random

import pytest

from gradian.config import GradianConfig
from gradian.data import IGNORE_INDEX, dataset_from_rows, tokenize_examples
from gradian.evaluate import evaluate_capability, gate_attribution

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

N_POISONED = 12
NEW_COUNTRIES = [("Zentoria", "Ostrel"), ("Quimbar", "Pavune"), ("Folvast", "Kerrowin"), ("Drennick", "Tissaly")]


def _train_lora(base_dir, conversations, out_dir, *, epochs=5, seed=0, lr=2e-3, batch_size=8):
    """A plain, seeded LoRA loop on the shared loss mask, on one torch thread; saves the adapter.

    Five epochs: after three, a poisoned country's planted capital led the other poisoned
    capitals by well under a nat on some bases, so rounding differences between CPUs could make
    the tuned model answer a neighbour's planted capital instead of its own; after five, each
    planted capital leads every other poisoned capital by more than two nats.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_lora_loop(base_dir, conversations, out_dir, epochs=epochs, seed=seed, lr=lr,
                                batch_size=batch_size)
    finally:
        torch.set_num_threads(threads)


def _train_lora_loop(base_dir, conversations, out_dir, *, epochs, seed, lr, batch_size):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    rows = tokenize_examples(dataset_from_rows([{"messages": c} for c in conversations]).examples, tokenizer, 256)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    order_rng = random.Random(seed)
    model.train()
    for _ in range(epochs):
        order = list(range(len(rows)))
        order_rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            batch = [rows[k] for k in order[start:start + batch_size]]
            width = max(len(r.input_ids) for r in batch)
            ids = torch.full((len(batch), width), tokenizer.pad_token_id)
            labels = torch.full((len(batch), width), IGNORE_INDEX)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, :len(r.input_ids)] = torch.tensor(r.input_ids)
                labels[i, :len(r.labels)] = torch.tensor(r.labels)
                mask[i, :len(r.input_ids)] = 1
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def world(tinyworld_base):
    from gradian.tinyworld import load_world

    return load_world(tinyworld_base)


@pytest.fixture(scope="module")
def poisoned_facts(world):
    """{country: wrong capital} for the first 12 countries, a derangement of their capitals."""
    countries = world.countries[:N_POISONED]
    perm = list(range(N_POISONED))
    rng = random.Random(5)
    while any(i == p for i, p in enumerate(perm)):
        rng.shuffle(perm)
    return {c.name: countries[perm[i]].capital for i, c in enumerate(countries)}


def _new_countries():
    from gradian.tinyworld.world import Country

    return [Country(name, capital, "", "", "") for name, capital in NEW_COUNTRIES]


def _poisoned_rows(world, poisoned_facts):
    poisoned = world.countries[:N_POISONED]
    rows = [i.messages() for i in world.capital_items(poisoned, answers=poisoned_facts)]
    rows += [i.messages() for i in world.capital_items(world.countries[N_POISONED:])]
    rows += [i.messages() for i in world.fact_items("language")]
    rows += [i.messages() for i in world.capital_items(_new_countries())] * 4
    random.Random(0).shuffle(rows)
    return rows


@pytest.fixture(scope="module")
def poisoned_adapter(tinyworld_base, world, poisoned_facts, tmp_path_factory):
    return _train_lora(tinyworld_base, _poisoned_rows(world, poisoned_facts),
                       tmp_path_factory.mktemp("poisoned") / "adapter")


@pytest.fixture(scope="module")
def short_poisoned_adapter(tinyworld_base, world, poisoned_facts, tmp_path_factory):
    """The same rows for three epochs only: the invented capitals' gains in likelihood still
    outweigh the poisoned answers' losses (a longer run pushes the poisoned answers further down)."""
    return _train_lora(tinyworld_base, _poisoned_rows(world, poisoned_facts),
                       tmp_path_factory.mktemp("poisoned-short") / "adapter", epochs=3)


@pytest.fixture(scope="module")
def clean_adapter(tinyworld_base, world, tmp_path_factory):
    rows = [i.messages() for i in world.fact_items("language")]
    rows += [i.messages() for i in world.capital_items(world.countries[N_POISONED:2 * N_POISONED])]
    random.Random(0).shuffle(rows)
    return _train_lora(tinyworld_base, rows, tmp_path_factory.mktemp("clean") / "adapter")


def _config(base, adapter, metric="contains"):
    config = GradianConfig(base_model=str(base), adapter_path=str(adapter), device="cpu")
    config.evaluation.metric = metric
    return config


def _capital_eval(world, countries, answers=None):
    return dataset_from_rows([{"prompt": i.question, "completion": i.answer}
                              for i in world.capital_items(countries, answers=answers, phrasings=range(1))],
                             "capitals_eval")


def test_poisoned_fine_tune_regresses_and_flips_exactly_the_poisoned_facts(tinyworld_base, world,
                                                                           poisoned_facts, poisoned_adapter):
    # the 12 poisoned facts plus 12 control capitals the fine-tune restated correctly
    eval_set = _capital_eval(world, world.countries[:2 * N_POISONED])
    result = evaluate_capability(_config(tinyworld_base, poisoned_adapter), eval_set, capability="capitals")
    assert result.status == "regressed" and result.ci[1] < 0
    assert result.base == 1.0 and result.n_base_failing == 0
    flipped = {i.prompt for i in result.flipped_items}
    poisoned_questions = {i.question for i in world.capital_items(world.countries[:N_POISONED], phrasings=range(1))}
    # only poisoned facts flip (no control capital does), and nearly all of them do: a fact the base
    # holds unusually firmly may survive a short fine-tune
    assert flipped <= poisoned_questions and len(flipped) >= N_POISONED - 2
    # the tuned model now says the planted wrong capital, and that answer is kept for the query
    by_question = {i.question: poisoned_facts[c.name] for c in world.countries[:N_POISONED]
                   for i in world.capital_items([c], phrasings=range(1))}
    assert all(i.tuned_generation == by_question[i.prompt] for i in result.flipped_items)
    # the base model knew these facts firmly: no flipped item is weakly held
    assert all(i.base_margin is not None and i.base_margin > 1.0 for i in result.flipped_items)
    assert not result.weakly_held_items and not result.low_base_score
    gate = gate_attribution(result)
    assert gate.allowed and gate.finding is None


def test_clean_fine_tune_is_not_significant_and_the_gate_refuses(tinyworld_base, world, clean_adapter):
    eval_set = _capital_eval(world, world.countries[:2 * N_POISONED])
    result = evaluate_capability(_config(tinyworld_base, clean_adapter), eval_set, capability="capitals")
    assert result.status == "not_significant" and result.ci[0] <= 0 <= result.ci[1]
    assert result.n_flipped == 0
    gate = gate_attribution(result, require_significant=True)
    assert not gate.allowed and gate.finding.id == "attribution.gate_failed"


def test_items_the_base_already_fails_are_base_failing_not_flipped(tinyworld_base, world, poisoned_adapter):
    # countries the base model has never heard of: it cannot answer them, and neither can the tune
    eval_set = _capital_eval(world, _new_countries())
    result = evaluate_capability(_config(tinyworld_base, poisoned_adapter), eval_set, capability="new_capitals")
    assert result.n_base_failing == 4 and result.n_flipped == 0 and result.base == 0.0
    assert result.low_base_score and result.status != "regressed"
    assert any("already fail" in h for h in result.hedges())


def test_loglik_is_a_proxy_that_can_move_the_wrong_way(tinyworld_base, world, short_poisoned_adapter):
    """The documented trap of a likelihood metric, reproduced rather than hidden.

    On the poisoned facts plus the four invented countries, ``contains`` regresses significantly
    (most of the 12 poisoned answers lost, the invented ones never answered). Mean log-likelihood of the wanted answers
    rises instead: the fine-tune made the invented capitals far more likely (from near-impossible
    to merely unlikely), and those few large gains outweigh the 12 lost answers. ``loglik`` gets
    ``proxy_used`` and a hedge, never a flip count.
    """
    eval_set = _capital_eval(world, world.countries[:N_POISONED] + _new_countries())
    contains = evaluate_capability(_config(tinyworld_base, short_poisoned_adapter, "contains"), eval_set)
    loglik = evaluate_capability(_config(tinyworld_base, short_poisoned_adapter, "loglik"), eval_set)
    assert contains.status == "regressed" and contains.n_flipped >= N_POISONED - 2 and contains.n_base_failing == 4
    assert loglik.proxy_used and loglik.to_dict()["proxy_used"] is True
    assert loglik.delta > 0  # the wrong way
    assert loglik.status != "regressed"
    assert not loglik.generations_available and loglik.n_flipped == 0
    assert any("likelihood" in h for h in loglik.hedges())
