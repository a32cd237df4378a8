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
