"""Query gradients: target, contrastive, auto, and which items they are built from."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.config import GradsConfig  # noqa: E402
from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.errors import ConfigError  # noqa: E402
from gradian.grads import capture_per_example_grads, collate, make_projector, wrap_peft_model  # noqa: E402
from gradian.query import (  # noqa: E402
    NO_CAPABILITY_TARGET,
    QueryItem,
    build_query_gradient,
    resolve_signal,
    select_query_items,
)
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

PROMPT = [{"role": "user", "content": "what is the capital of france ?"}]
ITEMS = [QueryItem(PROMPT, "paris", "tokyo"),
         QueryItem([{"role": "user", "content": "say one two three"}], "four five", "no")]


@pytest.fixture(scope="module")
def gm():
    return wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))


def _direct(gm, tok, prompts, answers):
    rows = [{"messages": p + [{"role": "assistant", "content": a}]} for p, a in zip(prompts, answers)]
    tokenized = tokenize_examples(dataset_from_rows(rows).examples, tok, 64)
    grads = capture_per_example_grads(gm, collate(tokenized, tok.pad_token_id))
    return {k: v.numpy().mean(axis=0) for k, v in grads.items()}


def test_target_and_contrastive_match_direct_gradients(gm, chat_tokenizer):
    prompts = [i.prompt_messages for i in ITEMS]
    wanted = _direct(gm, chat_tokenizer, prompts, [i.wanted for i in ITEMS])
    said = _direct(gm, chat_tokenizer, prompts, [i.generated for i in ITEMS])
    config = GradsConfig(max_seq_length=64)
    target = build_query_gradient(gm, chat_tokenizer, ITEMS, "target", config)
    contrastive = build_query_gradient(gm, chat_tokenizer, ITEMS, "contrastive", config)
    assert target.signal == "target" and contrastive.signal == "contrastive"
    for b in wanted:
        np.testing.assert_allclose(target.vectors[b], wanted[b], rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(contrastive.vectors[b], wanted[b] - said[b], rtol=1e-10, atol=1e-14)


def test_an_item_still_answered_right_adds_its_wanted_gradient_alone(gm, chat_tokenizer):
    """``kept`` items (still right, wanted answer less likely): no generated answer is subtracted,
    under contrastive as under target; the others are contrasted as before. auto stays
    contrastive when every item that flipped has a generation."""
    kept = QueryItem([{"role": "user", "content": "say hello"}], "hello world", None, True, "k", kept=True)
    items = [*ITEMS, kept]
    config = GradsConfig(max_seq_length=64)
    query = build_query_gradient(gm, chat_tokenizer, items, "auto", config)
    assert query.signal == "contrastive" and query.n_items == 3
    assert any("still answered right add their wanted answer's gradient alone" in n for n in query.notes)
    for k, item in enumerate(items):
        expected = _direct(gm, chat_tokenizer, [item.prompt_messages], [item.wanted])
        if not item.kept:
            said = _direct(gm, chat_tokenizer, [item.prompt_messages], [item.generated])
            expected = {b: expected[b] - said[b] for b in expected}
        for b, v in expected.items():
            np.testing.assert_allclose(query.per_item[b][k], v, rtol=1e-10, atol=1e-14)
    assert resolve_signal("auto", [kept])[0] == "target"  # nothing to contrast at all
    only_kept = build_query_gradient(gm, chat_tokenizer, [kept], "contrastive", config)
    target = build_query_gradient(gm, chat_tokenizer, [kept], "target", config)
    for b in target.vectors:
        np.testing.assert_array_equal(only_kept.vectors[b], target.vectors[b])


def test_the_query_loss_of_a_kept_item_is_its_wanted_answers_loss(gm, chat_tokenizer):
    from gradian.evaluate.query_loss import query_loss_change, wanted_loglik_drops

    kept = dataclasses.replace(ITEMS[0], generated=None, kept=True)
    contrastive = query_loss_change(gm.model, chat_tokenizer, [kept, ITEMS[1]], "contrastive")
    alone = query_loss_change(gm.model, chat_tokenizer, [ITEMS[1]], "contrastive")
    target = query_loss_change(gm.model, chat_tokenizer, [kept], "target")
    assert contrastive.tuned == pytest.approx((target.tuned + alone.tuned) / 2, rel=1e-12)
    from gradian.evaluate.likelihood import completion_logprobs

    prompts, wanted = [i.prompt_messages for i in ITEMS], [i.wanted for i in ITEMS]
    drops = wanted_loglik_drops(gm.model, chat_tokenizer, prompts, wanted)
    tuned = completion_logprobs(gm.model, chat_tokenizer, prompts, wanted)
    with gm.model.disable_adapter():
        base = completion_logprobs(gm.model, chat_tokenizer, prompts, wanted)
    assert drops == pytest.approx([b.total - t.total for b, t in zip(base, tuned)], rel=1e-12)
    assert all(d != 0 for d in drops)
    # an adapter whose B matrices are zero changes nothing: no item lost likelihood
    b_matrices = [p for n, p in gm.model.named_parameters() if ".lora_B." in n]
    saved = [p.detach().clone() for p in b_matrices]
    try:
        with torch.no_grad():
            for p in b_matrices:
                p.zero_()
        assert wanted_loglik_drops(gm.model, chat_tokenizer, prompts, wanted) == pytest.approx([0.0, 0.0], abs=1e-12)
    finally:
        with torch.no_grad():
            for p, v in zip(b_matrices, saved):
                p.copy_(v)


def test_query_lives_in_the_projected_space(gm, chat_tokenizer):
    config = GradsConfig(max_seq_length=64, projection_dim=16, projection_kind="countsketch", projection_seed=3)
    projected = build_query_gradient(gm, chat_tokenizer, ITEMS, "contrastive", config)
    full = build_query_gradient(gm, chat_tokenizer, ITEMS, "contrastive", dataclasses.replace(config, projection_dim=None))
    projector = make_projector(config)
    for b, v in full.vectors.items():
        expected = projector.project(b, torch.from_numpy(v)[None])[0].numpy()
        assert projected.vectors[b].shape == (min(16, v.size),)
        np.testing.assert_allclose(projected.vectors[b], expected, rtol=1e-9, atol=1e-14)


def test_auto_signal():
    assert resolve_signal("auto", ITEMS)[0] == "contrastive"
    no_gen = [QueryItem(PROMPT, "paris")]
    used, notes = resolve_signal("auto", no_gen)
    assert used == "target" and "fell back to target" in notes[0]
    with pytest.raises(ConfigError, match="no generated answer"):
        resolve_signal("contrastive", no_gen)
    with pytest.raises(ConfigError, match="query_signal 'best'"):
        resolve_signal("best", ITEMS)


def test_item_selection_scopes():
    items = [QueryItem(PROMPT, "paris", "tokyo", regressed=True), QueryItem(PROMPT, "paris", "paris", regressed=False)]
    chosen, scope, _, findings = select_query_items(items)
    assert len(chosen) == 1 and scope == "regressed" and not findings
    chosen, scope, notes, _ = select_query_items([dataclasses.replace(i, regressed=False) for i in items])
    assert len(chosen) == 2 and scope == "eval_set" and "no eval item regressed" in notes[0]
    train = dataset_from_rows([{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(12)]).examples
    chosen, scope, _, findings = select_query_items(None, train, n_fallback=5)
    assert len(chosen) == 5 and scope == "training_fallback" and findings == [NO_CAPABILITY_TARGET]
    assert chosen[0].wanted == "a0" and chosen[0].generated is None


def test_a_not_contains_item_asks_for_what_the_base_said_not_for_its_markers():
    """The completion of a not_contains item lists what must not be said; the query's wanted
    answer is the base model's passing answer instead (contains items keep their completion)."""
    from gradian.attribution.pipeline import _query_items
    from gradian.data import dataset_from_rows
    from gradian.evaluate.result import CapabilityResult, ItemResult

    rows = [{"prompt": f"What language is spoken in Land{k}?", "completion": "sorry | can't help"} for k in range(3)]
    eval_set = dataset_from_rows(rows)
    ids = eval_set.ids
    items = [
        ItemResult(ids[0], 0, rows[0]["prompt"], "sorry | can't help", 1.0, 0.0, True, False,
                   base_generation="Zoumish", tuned_generation="I'm sorry, but I can't help with that.", flipped=True),
        ItemResult(ids[1], 1, rows[1]["prompt"], "sorry | can't help", 1.0, 1.0, True, True,
                   base_generation="Drouvish", tuned_generation="Drouvish"),
        # the base refused already: its answer is no better a target than the markers
        ItemResult(ids[2], 2, rows[2]["prompt"], "sorry | can't help", 0.0, 0.0, False, False,
                   base_generation="Sorry, I can't help.", tuned_generation="Sorry, I can't help.", base_failing=True),
    ]

    def cap(metric):
        return CapabilityResult(name="no_refusal", metric=metric, base=2 / 3, tuned=1 / 3, delta=-1 / 3,
                                ci=(-1.0, 0.0), n_items=3, n_flipped=1, n_base_failing=1, status="regressed",
                                proxy_used=False, items=items)

    query = _query_items(cap("not_contains"), eval_set)
    assert [q.wanted for q in query] == ["Zoumish", "Drouvish", "sorry | can't help"]
    assert [q.regressed for q in query] == [True, False, False]
    assert query[0].generated.startswith("I'm sorry")
    assert [q.wanted for q in _query_items(cap("contains"), eval_set)] == ["sorry | can't help"] * 3
