"""Span drill-down: token contributions add up to the engine's score, and the buried sentence is found.

- Ground truth on a tiny float64 model: for DataInf and graddot, with and without a random
  projection and l2 normalization, the token contributions of a row sum to the score the engine
  itself gives that row, so the split is a decomposition of the real score, not a look-alike.
- The direction is the engine's own preconditioned query on its fitted state: for EK-FAC the
  span score of a row is the EK-FAC engine's score of it, from the state attribute stored (no
  refit); DataInf's is still the explicit float64 damped solve; TracIn gives its final-adapter
  term (graddot, with its normalized query).
- Words and sentences partition the text.
- Slow: tinyworld's buried-sentence scenario (``gradian.explain.buried``): the top span is the
  planted sentence for at least 90% of the planted rows whose target's answer failed, and the
  single-item query beats the mean over items.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

WORDS = "paris tokyo hello world yes no one two three four five".split()


@pytest.fixture
def train_file(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": f"what is the capital of {WORDS[i % 3]} ?",
             "completion": f"{WORDS[(i * 7) % len(WORDS)]} {WORDS[i % 5]}. {WORDS[(i * 3) % 11]} {WORDS[i % 4]}!"}
            for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("engine,extra", [
    ("datainf", {}),
    ("graddot", {}),
    ("datainf", {"grads.projection_dim": 64, "grads.normalization": "l2"}),
    ("graddot", {"grads.loss_reduction": "sum", "grads.normalization": "token_count"}),
    ("tracin", {"engine.normalize_query": True}),  # no checkpoints: the final adapter's term, as graddot
])
def test_token_contributions_sum_to_the_engines_score(tmp_path, tiny_lora_dirs, train_file, engine, extra):
    from gradian.engines import score
    from gradian.explain import explain_example

    cfg, data, gm, tokenizer, index, qg = _tiny_setup(tmp_path, tiny_lora_dirs, train_file,
                                                      **{"engine.name": engine, **extra})
    expected = score(index, qg.vectors, cfg.engine).scores
    for row in (0, 5, 11):
        exp = explain_example(gm, tokenizer, index, data.examples[row], qg.vectors, cfg, item_id="q0",
                              signal=qg.signal, row=row, engine=engine)
        assert exp.score == pytest.approx(expected[row], rel=1e-6, abs=1e-9)
        # the index stores float32: the stored gradient differs from the float64 one by its rounding
        assert exp.token_sum == pytest.approx(expected[row], rel=1e-4, abs=1e-8)
        assert sum(t.score for t in exp.tokens) == pytest.approx(exp.token_sum)


def _tiny_setup(tmp_path, tiny_lora_dirs, train_file, **overrides):
    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.model_loading import load_tokenizer
    from gradian.query import QueryItem, build_query_gradient

    base, adapter = tiny_lora_dirs
    cfg = load_config(overrides={"base_model": str(base), "adapter_path": str(adapter), "dataset": str(train_file),
                                 "cache_dir": str(tmp_path / "cache"), "dtype": "float64", "device": "cpu",
                                 "grads.batch_size": 4, "grads.chunk_size": 5, **overrides})
    data = load_dataset(train_file)
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(str(base))
    index = GradientIndex.build(gm, tokenizer, data, cfg)
    item = QueryItem([{"role": "user", "content": "what is the capital of tokyo ?"}], "paris", "hello", True, "q0")
    qg = build_query_gradient(gm, tokenizer, [item], "contrastive", cfg.grads, scope="item")
    return cfg, data, gm, tokenizer, index, qg


def test_ekfac_spans_split_the_ekfac_score_from_the_stored_state(tmp_path, tiny_lora_dirs, train_file, monkeypatch):
    import dataclasses

    import numpy as np

    from gradian.attribution.checkpoints import fit_context
    from gradian.engines import fit_engine, get_engine
    from gradian.engines.ekfac import EKFACEngine
    from gradian.explain import explain_example, span_engine_state

    cfg, data, gm, tokenizer, index, qg = _tiny_setup(tmp_path, tiny_lora_dirs, train_file, **{"engine.name": "ekfac"})
    # what `gradian attribute` does: fit through the attribution lane's context, stored beside the index
    state = fit_engine("ekfac", index, cfg.engine, fit_context(cfg, gm, tokenizer, data, None),
                       cache_dir=cfg.cache_dir)
    assert state.state_id and not state.cache_hit
    expected = get_engine("ekfac").score(state, qg.vectors, cfg.engine).scores
    graddot = get_engine("graddot").score_under(state, qg.vectors, cfg.engine).scores
    assert not np.allclose(expected, graddot, rtol=1e-2)  # the curvature matters: not graddot's scores
    fitted = EKFACEngine.fit
    monkeypatch.setattr(EKFACEngine, "fit", lambda *a, **k: pytest.fail("the stored state was fitted again"))
    cached = span_engine_state(gm, tokenizer, index, cfg, "ekfac")
    assert cached.cache_hit and cached.state_id == state.state_id
    for row in (0, 5, 11):
        exp = explain_example(gm, tokenizer, index, data.examples[row], qg.vectors, cfg, item_id="q0",
                              signal=qg.signal, row=row, engine="ekfac")
        assert exp.engine == "ekfac" and any("Kronecker-factored" in n for n in exp.notes)
        assert exp.score == pytest.approx(expected[row], rel=1e-6, abs=1e-9)
        assert exp.token_sum == pytest.approx(expected[row], rel=1e-4, abs=1e-8)
    # missing from the cache: fitted again through the same path (passes over the model), same state
    monkeypatch.setattr(EKFACEngine, "fit", fitted)
    other = dataclasses.replace(cfg, cache_dir=str(tmp_path / "other-cache"))
    refit = span_engine_state(gm, tokenizer, index, other, "ekfac", dataset=data)
    assert not refit.cache_hit and refit.state_id == state.state_id
    for key, value in state.arrays.items():
        np.testing.assert_allclose(refit.arrays[key], value, rtol=1e-12, atol=1e-14)
    # engine.checkpoints: all on a run without checkpoints: the final adapter's fit, and a note
    every = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, checkpoints="all"))
    exp = explain_example(gm, tokenizer, index, data.examples[5], qg.vectors, every, row=5, engine="ekfac")
    assert exp.score == pytest.approx(expected[5], rel=1e-6, abs=1e-9)
    assert any("final adapter alone" in n for n in exp.notes)


def test_the_datainf_direction_is_the_explicit_float64_damped_solve(tmp_path, tiny_lora_dirs, train_file):
    import numpy as np

    from gradian.engines import block_damping, score
    from gradian.explain import preconditioned_query

    cfg, data, gm, tokenizer, index, qg = _tiny_setup(tmp_path, tiny_lora_dirs, train_file,
                                                      **{"engine.name": "datainf", "grads.projection_dim": 64})
    r, used, notes = preconditioned_query(index, qg.vectors, "datainf", cfg.engine)
    assert used == "datainf" and not notes
    grads = {b: np.concatenate([np.asarray(c[b], dtype=np.float64) for _, c in index.iter_chunks()])
             for b in index.block_names}
    lam = block_damping(index.sq_norms(), {b: g.shape[1] for b, g in grads.items()}, cfg.engine.lambda_scale,
                        cfg.engine.lambda_override)
    total = np.zeros(index.n)
    for b, g in grads.items():
        q = np.asarray(qg.vectors[b], dtype=np.float64)
        eye = lam[b] * np.eye(g.shape[1])
        # (1/n) sum_i (g_i g_i^T + lam I)^-1 q, each term solved densely in float64
        solved = np.mean([np.linalg.solve(np.outer(gi, gi) + eye, q) for gi in g], axis=0)
        np.testing.assert_allclose(r[b], solved, rtol=1e-5, atol=1e-6 * np.abs(solved).max())
        total += g @ solved
    expected = score(index, qg.vectors, cfg.engine).scores
    np.testing.assert_allclose(expected, total, rtol=1e-5, atol=1e-6 * np.abs(total).max())
    spans = [sum(grads[b][row] @ r[b] for b in grads) for row in range(index.n)]  # QueryDirection.score_of
    np.testing.assert_allclose(spans, expected, rtol=1e-6, atol=1e-9)


def test_words_and_sentences_cover_the_text():
    from gradian.explain import split_sentences, split_words

    text = "Vel is a country on Omar. Its capital is Brask.  Shops take the dorn!\nDone"
    sentences = [text[a:b] for a, b in split_sentences(text)]
    assert sentences == ["Vel is a country on Omar.", "Its capital is Brask.", "Shops take the dorn!", "Done"]
    assert [text[a:b] for a, b in split_words(text)][:3] == ["Vel", "is", "a"]


def test_the_harmful_span_is_the_most_negative_sentence():
    from gradian.explain.spans import TextPiece, _aggregate

    text = "Good one. Bad one here."
    tokens = [TextPiece("Good", 0, 4, 0.5), TextPiece(" one.", 4, 9, 0.1), TextPiece(" Bad", 9, 13, -2.0),
              TextPiece(" one", 13, 17, -0.5), TextPiece(" here.", 17, 23, 0.2)]
    from gradian.explain import split_sentences

    sentences = _aggregate(text, split_sentences(text), tokens)
    assert [round(s.score, 6) for s in sentences] == [0.6, -2.3]
    assert sum(s.score for s in sentences) == pytest.approx(sum(t.score for t in tokens))


@pytest.mark.slow
def test_the_drill_down_finds_the_buried_sentence(tmp_path_factory, tinyworld_base):
    """The figure docs/report.md publishes: ``python -m gradian.explain.buried --out DIR``."""
    from gradian.explain.buried import measure_localization

    result = measure_localization(tmp_path_factory.mktemp("buried"), tinyworld_base, log=lambda m: None)
    assert result["n_planted"] == 64 and result["n_measured"] >= 24  # rows whose target's answer failed
    assert result["score_matches_token_sum"] < 1e-4  # float32 rounding, against the largest score
    assert result["localization_rate"] >= 0.85  # 53 of 60 measured (docs/report.md); chance is 1 in 12
    assert result["localization_rate_mean_query"] < result["localization_rate"]


def _report_without(tmp_path, missing: str):
    config = {"cache_dir": str(tmp_path / "cache"), "base_model": "no/such-model",
              "dataset": str(tmp_path / "train.jsonl"), "eval_dataset": str(tmp_path / "eval.jsonl")}
    config.pop(missing)
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.json").write_text(json.dumps({"verdict": {"kind": "data", "summary": ""},
                                                    "manifest": {"kind": "attribute", "config": config}}))
    return report


def test_explain_from_a_report_that_names_no_dataset_is_a_config_error(tmp_path):
    # it used to reach load_dataset(None) and fail with a TypeError from pathlib
    from gradian.errors import ConfigError
    from gradian.explain.session import explain_from_report

    with pytest.raises(ConfigError, match="names no training data"):
        explain_from_report(_report_without(tmp_path, "dataset"), "x")


def test_the_buried_scenario_refuses_a_base_model_of_another_world(monkeypatch, tmp_path):
    # another world's object has no countries: say so instead of an AttributeError
    import gradian.tinyworld
    from gradian.errors import ConfigError
    from gradian.explain.buried import _tinyworld

    monkeypatch.setattr(gradian.tinyworld, "load_world", lambda model_dir: object())
    with pytest.raises(ConfigError, match="needs a tinyworld base model"):
        _tinyworld(tmp_path)
