"""Engines against ground truth: DataInf vs an explicit solve, the sign on toy cases, the registry."""

from __future__ import annotations

import numpy as np
import pytest

from gradian.config import EngineConfig
from gradian.engines import (
    SIGN_CONVENTION,
    EngineState,
    InMemoryGradients,
    TracInCheckpoint,
    available_engines,
    block_damping,
    checkpoint_learning_rates,
    get_engine,
    rank_correlation,
    score,
)
from gradian.errors import ConfigError, IndexMismatchError


def _random_blocks(rng, n=40, widths=(7, 12, 5)):
    return {f"b{i}": rng.normal(size=(n, w)) * (i + 1) for i, w in enumerate(widths)}


def _explicit_datainf(blocks, query, lam):
    """DataInf's own damped formula, solved with explicit matrices: r = (1/n) sum_i (g g^T + lam I)^-1 q."""
    n = next(iter(blocks.values())).shape[0]
    total = np.zeros(n)
    for b, g in blocks.items():
        d = g.shape[1]
        r = np.mean([np.linalg.solve(np.outer(gi, gi) + lam[b] * np.eye(d), query[b]) for gi in g], axis=0)
        total += g @ r
    return total


@pytest.mark.parametrize("override", [None, 0.7])
def test_datainf_equals_explicit_per_block_solve(override):
    rng = np.random.default_rng(0)
    blocks = _random_blocks(rng)
    query = {b: rng.normal(size=g.shape[1]) for b, g in blocks.items()}
    config = EngineConfig(name="datainf", lambda_scale=0.1, lambda_override=override)
    result = score(InMemoryGradients(blocks, chunk_size=7), query, config)
    lam = block_damping({b: (g ** 2).sum(1) for b, g in blocks.items()}, {b: g.shape[1] for b, g in blocks.items()},
                        0.1, override)
    assert result.damping == pytest.approx(lam)
    if override is None:  # DataInf's published rule: 0.1 x the block's mean |g|^2 over its width
        for b, g in blocks.items():
            assert lam[b] == pytest.approx(0.1 * np.mean((g ** 2).sum(1)) / g.shape[1], rel=1e-12)
    expected = _explicit_datainf(blocks, query, lam)
    np.testing.assert_allclose(result.scores, expected, rtol=1e-10, atol=1e-12 * np.abs(expected).max())


def test_datainf_damping_is_scale_times_mean_squared_norm_over_width():
    g = {"b": np.array([[3.0, 4.0], [0.0, 1.0]])}
    # mean |g|^2 = 13, width 2: the mean eigenvalue of (1/n) sum g g^T is 13 / 2
    assert block_damping({"b": (g["b"] ** 2).sum(1)}, {"b": 2}, 0.1, None) == {"b": pytest.approx(0.1 * 13.0 / 2)}
    with pytest.raises(ConfigError, match="lambda_override"):
        block_damping({"b": np.ones(2)}, {"b": 2}, 0.1, -1.0)


def test_many_queries_at_once_equal_one_at_a_time():
    rng = np.random.default_rng(1)
    blocks = _random_blocks(rng)
    queries = {b: rng.normal(size=(3, g.shape[1])) for b, g in blocks.items()}
    train = InMemoryGradients(blocks, chunk_size=16)
    for name in ("datainf", "graddot", "tracin"):
        batch = score(train, queries, EngineConfig(name=name)).scores
        assert batch.shape == (40, 3)
        for k in range(3):
            one = score(train, {b: q[k] for b, q in queries.items()}, EngineConfig(name=name)).scores
            np.testing.assert_allclose(batch[:, k], one, rtol=1e-12)


class _CountedPasses(InMemoryGradients):
    """Arrays in memory that count the full passes made over them."""

    passes = 0

    def iter_chunks(self):
        self.passes += 1
        yield from super().iter_chunks()


def test_two_engines_scored_jointly_make_one_scoring_pass_and_keep_their_own_scores():
    from gradian.engines.base import score_jointly

    rng = np.random.default_rng(4)
    blocks = _random_blocks(rng)
    queries = {b: rng.normal(size=(2, g.shape[1])) for b, g in blocks.items()}
    train = _CountedPasses(blocks, chunk_size=9)
    configs = {name: EngineConfig(name=name) for name in ("datainf", "graddot")}
    states = {name: get_engine(name).fit(train, configs[name]) for name in configs}
    alone = {name: get_engine(name).score(states[name], queries, configs[name]) for name in configs}
    # DataInf: its preconditioning pass and its scoring pass; graddot: a scoring pass
    assert train.passes == 3
    train.passes = 0
    together = score_jointly([(get_engine(name), states[name], queries, configs[name]) for name in configs])
    assert train.passes == 2  # DataInf's preconditioning pass, then one scoring pass for both
    for name, joint in zip(configs, together):
        assert joint.engine == name and joint.scores.shape == (40, 2)
        np.testing.assert_allclose(joint.scores, alone[name].scores, rtol=1e-12)
        assert joint.damping == alone[name].damping
    with pytest.raises(ValueError, match="same training gradients"):
        score_jointly([(get_engine("graddot"), states["graddot"], queries, configs["graddot"]),
                       (get_engine("graddot"), get_engine("graddot").fit(InMemoryGradients(blocks), configs["graddot"]),
                        queries, configs["graddot"])])


def test_graddot_and_normalized_query():
    rng = np.random.default_rng(2)
    blocks = _random_blocks(rng)
    query = {b: rng.normal(size=g.shape[1]) for b, g in blocks.items()}
    plain = score(InMemoryGradients(blocks), query, EngineConfig(name="graddot")).scores
    np.testing.assert_allclose(plain, sum(g @ query[b] for b, g in blocks.items()), rtol=1e-12)
    normed = score(InMemoryGradients(blocks), query, EngineConfig(name="graddot", normalize_query=True)).scores
    norm = np.sqrt(sum((q ** 2).sum() for q in query.values()))
    np.testing.assert_allclose(normed, plain / norm, rtol=1e-12)


def test_tracin_sums_checkpoints_by_learning_rate_and_says_when_it_falls_back():
    rng = np.random.default_rng(3)
    c1, c2 = _random_blocks(rng), _random_blocks(rng)
    q1 = {b: rng.normal(size=g.shape[1]) for b, g in c1.items()}
    q2 = {b: rng.normal(size=g.shape[1]) for b, g in c2.items()}
    engine = get_engine("tracin")
    ckpts = [TracInCheckpoint(2e-4, InMemoryGradients(c1), q1, "checkpoint-10"),
             TracInCheckpoint(1e-4, InMemoryGradients(c2), q2, "checkpoint-20")]
    result = engine.score(EngineState("tracin", InMemoryGradients(c2)), q2, EngineConfig(name="tracin"), checkpoints=ckpts)
    expected = 2e-4 * sum(g @ q1[b] for b, g in c1.items()) + 1e-4 * sum(g @ q2[b] for b, g in c2.items())
    np.testing.assert_allclose(result.scores, expected, rtol=1e-12)
    fallback = engine.score(engine.fit(InMemoryGradients(c2), EngineConfig(name="tracin")), q2, EngineConfig(name="tracin"))
    assert "fell back" in fallback.notes[0]
    assert rank_correlation(fallback.scores, score(InMemoryGradients(c2), q2, EngineConfig(name="graddot")).scores) == 1.0


def test_checkpoint_learning_rates_from_logs():
    from gradian.runs.record import RunRecord, TrainingLogs

    record = RunRecord.from_dict({})
    record.logs = TrainingLogs.from_log_history(
        [{"step": 5, "learning_rate": 1e-3, "loss": 1.0}, {"step": 10, "learning_rate": 5e-4, "loss": 0.9}]
    )
    assert checkpoint_learning_rates(["run/checkpoint-7", "run/checkpoint-10"], record) == [1e-3, 5e-4]


def test_registry_and_errors():
    assert {"datainf", "graddot", "tracin"} <= set(available_engines())
    assert {"ekfac", "kfac"} <= set(available_engines())
    with pytest.raises(ConfigError, match="engine.name 'nosuch'.*datainf"):
        get_engine("nosuch")
    datainf = EngineConfig(name="datainf")
    with pytest.raises(IndexMismatchError, match="no block 'b1'"):
        score(InMemoryGradients({"b0": np.ones((2, 3)), "b1": np.ones((2, 3))}), {"b0": np.ones(3)}, datainf)
    with pytest.raises(IndexMismatchError, match="wide"):
        score(InMemoryGradients({"b0": np.ones((2, 3))}), {"b0": np.ones(4)}, datainf)


def test_rank_correlation():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(rank_correlation([1, 1, 1], [1, 2, 3]))


def test_sign_convention_is_stated_once():
    assert "reinforced" in SIGN_CONVENTION and "score_j / n" in SIGN_CONVENTION


# -- the sign on a toy case whose answer is known -----------------------------------------------


def _ridge_fit(x, y, reg):
    d = x.shape[1]
    return np.linalg.solve(x.T @ x / len(x) + reg * np.eye(d), x.T @ y / len(x))


@pytest.mark.parametrize("engine", ["datainf", "graddot"])
def test_sign_on_linear_regression_with_one_flipped_label(engine):
    """Removing the flipped example lowers the query loss, so its score must be the most negative,
    and score/n must predict the sign of every example's actual leave-one-out effect on the query."""
    rng = np.random.default_rng(0)
    n, d, reg = 60, 4, 1e-2
    w_true = np.array([1.0, -2.0, 0.5, 1.5])
    x = rng.normal(size=(n, d))
    y = x @ w_true + 0.05 * rng.normal(size=n)
    poisoned = 7
    x[poisoned] = np.array([1.0, 0.2, 0.0, 0.3])
    y[poisoned] = -(x[poisoned] @ w_true) * 4  # the opposite answer, loudly
    w = _ridge_fit(x, y, reg)
    x_q = np.array([1.0, 0.1, 0.1, 0.2])
    y_q = x_q @ w_true

    def query_loss(weights):
        return 0.5 * (weights @ x_q - y_q) ** 2

    grads = {"w": (x @ w - y)[:, None] * x}  # per-example gradient of 0.5 (w.x - y)^2
    g_q = (w @ x_q - y_q) * x_q
    result = score(InMemoryGradients(grads), {"w": g_q}, EngineConfig(name=engine, lambda_scale=0.1))
    assert result.scores[poisoned] < 0
    assert int(np.argmin(result.scores)) == poisoned
    actual = np.array([query_loss(_ridge_fit(np.delete(x, j, 0), np.delete(y, j), reg)) - query_loss(w) for j in range(n)])
    assert actual[poisoned] < 0  # the ground truth: dropping it helps the query
    predicted = result.predicted_loss_delta_if_removed
    assert np.sign(predicted[poisoned]) == np.sign(actual[poisoned])
    assert rank_correlation(predicted, actual) > 0.8


def test_sign_on_a_tiny_lora_one_sgd_step():
    """An SGD step on example j changes the query loss by about -lr * <g_q, g_j>: positive
    graddot score <=> the step lowers the query loss (reinforces)."""
    torch = pytest.importorskip("torch")
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import capture_per_example_grads, collate, per_example_loss, wrap_peft_model
    from tests.plugins.chat_tokenizer import build_chat_tokenizer
    from tests.plugins.tiny_lora import build_tiny_lora

    tok = build_chat_tokenizer()
    rows = [{"prompt": "what is the capital of france ?", "completion": c}
            for c in ("paris", "tokyo", "paris", "hello world", "one two three", "no")]
    tokenized = tokenize_examples(dataset_from_rows(rows).examples, tok, 64)
    query_tok = tokenize_examples(dataset_from_rows([{"prompt": "what is the capital of france ?",
                                                      "completion": "paris"}]).examples, tok, 64)
    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))
    train = capture_per_example_grads(gm, collate(tokenized, tok.pad_token_id))
    qb = collate(query_tok, tok.pad_token_id)
    query = {k: v[0] for k, v in capture_per_example_grads(gm, qb).items()}
    scores = score(InMemoryGradients({k: v.numpy() for k, v in train.items()}),
                   {k: v.numpy() for k, v in query.items()}, EngineConfig(name="graddot")).scores
    params = [p for b in gm.blocks for p in b.parameters]

    def qloss():
        with torch.no_grad():
            return per_example_loss(gm.model(input_ids=qb.input_ids).logits, qb.labels).item()

    base = qloss()
    lr = 1e-3
    for j in range(len(rows)):
        saved = [p.detach().clone() for p in params]
        one = collate([tokenized[j]], tok.pad_token_id)
        loss = per_example_loss(gm.model(input_ids=one.input_ids).logits, one.labels).sum()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= lr * g
        delta = qloss() - base
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        assert np.sign(delta) == -np.sign(scores[j]), (j, delta, scores[j])
        assert delta == pytest.approx(-lr * scores[j], rel=0.05)
    assert scores[0] > 0  # the query itself reinforces itself


def test_tracin_fit_loads_checkpoints_as_adapters_on_one_base(tmp_path, tiny_lora_dirs, chat_tokenizer):
    """Checkpoints loaded beside the final adapter give the scores of models loaded one by one."""
    import dataclasses

    from gradian.config import load_config
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.attribution.checkpoints import fit_context
    from gradian.grads import capture_per_example_grads, collate, load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.runs.record import RunRecord
    from tests.plugins.tiny_lora import hello_query_for, save_tiny_lora

    base, final = tiny_lora_dirs
    _, second = save_tiny_lora(tmp_path / "other", seed=5)  # another adapter over a different base init
    # a checkpoint must share the base: copy the other adapter's weights under the same base
    ckpt = tmp_path / "run" / "checkpoint-10"
    import shutil

    shutil.copytree(second, ckpt)
    cfg = load_config(overrides={"dtype": "float64", "device": "cpu", "attn_implementation": "sdpa",
                                 "cache_dir": str(tmp_path / "cache"), "base_model": str(base)})
    rows = [{"prompt": "say hello", "completion": c} for c in ("hello world", "no", "one two three")]
    dataset = dataset_from_rows(rows)
    gm = load_model_for_gradients(str(base), str(final), cfg)
    index = GradientIndex.build(gm, chat_tokenizer, dataset, cfg)
    record = RunRecord.from_dict({})
    record.checkpoints = [str(ckpt), str(final)]
    context = fit_context(cfg, gm, chat_tokenizer, dataset, record)
    engine = get_engine("tracin")
    state = engine.fit(index, cfg.engine, context)
    assert [c["label"] for c in state.meta["checkpoints"]] == ["checkpoint-10", final.name]
    assert "equivalent_to" not in state.meta
    query_for = hello_query_for(chat_tokenizer)

    result = engine.score(state, query_for(gm), cfg.engine, query_for=query_for)
    train_rows = tokenize_examples(dataset.examples, chat_tokenizer, cfg.grads.max_seq_length)
    expected = np.zeros(len(rows))
    weights = checkpoint_learning_rates([str(ckpt), str(final)], record)
    for path, weight in zip((ckpt, final), weights):
        alone = load_model_for_gradients(str(base), str(path), cfg)
        train = capture_per_example_grads(alone, collate(train_rows, chat_tokenizer.pad_token_id))
        q = query_for(alone)
        expected += weight * sum(train[b].detach().numpy() @ q[b] for b in q)
    np.testing.assert_allclose(result.scores, expected, rtol=1e-6)  # the index stores float32
    # only the final adapter among the checkpoints: TracIn is graddot scaled, and says so
    record.checkpoints = [str(final)]
    one = engine.fit(index, cfg.engine, dataclasses.replace(context, run=record))
    assert one.meta.get("equivalent_to") == "graddot"


def test_each_engine_describes_the_settings_its_run_is_logged_by():
    """What the MLflow child run's parameters and the overflow message name comes from the engine,
    so neither the pipeline nor the sink knows engine-specific keys."""
    import dataclasses

    from gradian.config import EngineConfig
    from gradian.engines import get_engine

    cfg = EngineConfig()
    assert get_engine("graddot").describe(cfg) == {} and get_engine("graddot").damping_setting(cfg) is None
    assert get_engine("datainf").describe(cfg) == {"damping": 0.1, "damping_kind": "scale"}
    absolute = dataclasses.replace(cfg, lambda_override=1e-3)
    assert get_engine("datainf").describe(absolute) == {"damping": 1e-3, "damping_kind": "absolute"}
    assert get_engine("datainf").damping_setting(absolute)[0] == "engine.lambda_override"
    assert get_engine("ekfac").describe(cfg) == {"damping": 0.1, "damping_kind": "scale", "fisher": "empirical",
                                                 "ranking": "relatif"}
    everything = dataclasses.replace(cfg, checkpoints="all", fisher="true", normalize_train="none")
    assert get_engine("kfac").describe(everything) == {"damping": 0.1, "damping_kind": "scale", "fisher": "sampled",
                                                       "ranking": "none", "checkpoints": "all"}
