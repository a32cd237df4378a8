"""EK-FAC and K-FAC against ground truth: explicit Fisher matrices, loop gradients, an SGD step."""

from __future__ import annotations

import numpy as np
import pytest

from gradian.config import EngineConfig, GradsConfig
from gradian.engines import EngineState, FitContext, InMemoryGradients, fit_engine, get_engine, score
from gradian.engines.kronecker import KroneckerFactors, corrected_eigenvalues, damped_inverse, eigendecompose
from gradian.errors import ConfigError


def _explicit_fisher(per_example):
    """``F = (1/N) sum_b vec(G_b) vec(G_b)^T`` with ``vec`` row-major over ``[out, in]``."""
    flat = per_example.reshape(per_example.shape[0], -1)
    return flat.T @ flat / flat.shape[0]


def _kron_basis(eigen):
    # row-major vec(Q_S^T G Q_A) = (Q_S^T kron Q_A^T) vec(G)
    return np.kron(eigen.q_s, eigen.q_a)


def test_kfac_with_one_example_of_one_token_is_the_exact_damped_solve():
    rng = np.random.default_rng(0)
    out_dim, in_dim = 3, 5
    x, g = rng.normal(size=(1, in_dim)), rng.normal(size=(1, out_dim))
    factors = KroneckerFactors.zeros(out_dim, in_dim)
    factors.add(x, g, examples=1)
    eigen = eigendecompose(*factors.finish())
    fisher = _explicit_fisher((g.T @ x)[None])  # G = g x^T: F = (x x^T) kron (g g^T) exactly
    lam = 0.1 * np.trace(fisher) / fisher.shape[0]  # 0.1 x the mean eigenvalue
    assert lam == pytest.approx(0.1 * eigen.eigenvalues.mean(), rel=1e-10)
    v = rng.normal(size=(2, out_dim, in_dim))
    got = damped_inverse(eigen, v, lam).reshape(2, -1)
    want = np.linalg.solve(fisher + lam * np.eye(fisher.shape[0]), v.reshape(2, -1).T).T
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # one example of one token: the eigenvalue correction changes nothing
    ek = corrected_eigenvalues(eigen, (g.T @ x)[None])
    np.testing.assert_allclose(ek, eigen.eigenvalues, rtol=1e-9, atol=1e-12 * ek.max())


def test_ekfac_eigenvalues_are_the_fisher_diagonal_in_the_kronecker_basis():
    rng = np.random.default_rng(1)
    n, tokens, out_dim, in_dim = 12, 6, 4, 3
    x = rng.normal(size=(n, tokens, in_dim))
    g = rng.normal(size=(n, tokens, out_dim)) * np.linspace(0.5, 2.0, out_dim)
    factors = KroneckerFactors.zeros(out_dim, in_dim)
    for b in range(n):
        factors.add(x[b], g[b], examples=1)
    a, s = factors.finish()
    np.testing.assert_allclose(a, np.einsum("bti,btj->ij", x, x) / (n * tokens))
    np.testing.assert_allclose(s, np.einsum("bto,btp->op", g, g) / n)
    eigen = eigendecompose(a, s)
    per_example = np.einsum("bto,bti->boi", g, x)
    fisher = _explicit_fisher(per_example)
    basis = _kron_basis(eigen)
    lam_ek = corrected_eigenvalues(eigen, per_example) / n
    np.testing.assert_allclose(lam_ek.ravel(), np.diag(basis.T @ fisher @ basis), rtol=1e-9)
    # the EK-FAC inverse is the exact inverse of the Fisher's diagonal part in that basis
    damping = 0.1 * lam_ek.mean()
    eigen.eigenvalues = lam_ek
    v = rng.normal(size=(1, out_dim, in_dim))
    approx = basis @ np.diag(lam_ek.ravel()) @ basis.T
    want = np.linalg.solve(approx + damping * np.eye(approx.shape[0]), v.reshape(-1))
    np.testing.assert_allclose(damped_inverse(eigen, v, damping).reshape(-1), want, rtol=1e-9)


# -- on a tiny LoRA model -------------------------------------------------------------------------


def _setup(batch_size=3, normalization="none"):
    import torch

    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import capture_per_example_grads, collate, wrap_peft_model
    from tests.plugins.chat_tokenizer import build_chat_tokenizer
    from tests.plugins.tiny_lora import build_tiny_lora

    tok = build_chat_tokenizer()
    rows = [{"prompt": p, "completion": c} for p, c in [
        ("what is the capital of france ?", "paris"), ("what is the capital of japan ?", "tokyo is the capital"),
        ("say hello", "hello world"), ("count to three", "one two three"), ("is it raining ?", "no"),
        ("what is the capital of france ?", "rome"), ("name a colour", "blue and green and red")]]
    tokenized = tokenize_examples(dataset_from_rows(rows).examples, tok, 64)
    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64, target_modules=["q_proj", "down_proj"]))
    grads = {k: v.numpy() for k, v in capture_per_example_grads(gm, collate(tokenized, tok.pad_token_id)).items()}
    context = _context(gm, tokenized, tok.pad_token_id, GradsConfig(batch_size=batch_size, normalization=normalization))
    return gm, tok, tokenized, grads, context


def _context(gm, tokenized, pad_id, grads_config, **extra):
    """The ``FitContext`` the attribution lane would hand a fit: passes over ``gm`` under ``grads_config``."""
    from gradian.grads.collectors import ModelPasses

    return FitContext(passes=ModelPasses(gm, tokenized, pad_id, grads_config), grads=grads_config, **extra)


def _loop_per_example(gm, tok, tokenized):
    """Ground truth: one backward per example, weight gradients read off autograd."""
    import torch

    from gradian.grads import collate, per_example_loss

    out = {}
    for t in tokenized:
        one = collate([t], tok.pad_token_id)
        loss = per_example_loss(gm.model(input_ids=one.input_ids).logits, one.labels).sum()
        for block in gm.blocks:
            gs = torch.autograd.grad(loss, block.parameters, retain_graph=True)
            for j, g in enumerate(gs):
                out.setdefault(f"{block.name}#{j}", []).append(g.numpy())
    return {k: np.stack(v) for k, v in out.items()}


def test_ekfac_fit_on_a_model_matches_loop_gradients_and_ignores_padding():
    gm, tok, tokenized, grads, context = _setup(batch_size=3)
    state = get_engine("ekfac").fit(InMemoryGradients(grads), EngineConfig(name="ekfac"), context)
    assert state.meta["eigenvalues_from"] == "index"
    loop = _loop_per_example(gm, tok, tokenized)
    for layer in state.meta["layers"]:
        key = layer["key"]
        from gradian.engines.kronecker import KroneckerEigen

        eigen = KroneckerEigen(state.arrays[f"{key}.q_a"], state.arrays[f"{key}.q_s"], state.arrays[f"{key}.eigenvalues"])
        want = np.diag(_kron_basis(eigen).T @ _explicit_fisher(loop[key]) @ _kron_basis(eigen)).reshape(eigen.eigenvalues.shape)
        np.testing.assert_allclose(eigen.eigenvalues, want, rtol=1e-8, atol=1e-14 * want.max())
    # batch 1 (no padding at all) gives the same factors as padded batches of 3
    one = _context(gm, tokenized, tok.pad_token_id, GradsConfig(batch_size=1))
    unpadded = get_engine("kfac").fit(InMemoryGradients(grads), EngineConfig(name="kfac"), one)
    padded = get_engine("kfac").fit(InMemoryGradients(grads), EngineConfig(name="kfac"), context)
    for key, value in padded.arrays.items():
        if key.endswith(".eigenvalues"):
            np.testing.assert_allclose(value, unpadded.arrays[key], rtol=1e-9, atol=1e-15)


def test_second_pass_corrections_equal_the_index_ones():
    gm, tok, tokenized, grads, context = _setup()
    engine = get_engine("ekfac")
    from_index = engine.fit(InMemoryGradients(grads), EngineConfig(name="ekfac"), context)
    # an l2-normalized index does not hold the Fisher's gradients: the fit recomputes them
    normalized = _context(gm, tokenized, tok.pad_token_id, GradsConfig(batch_size=3, normalization="l2"))
    recomputed = engine.fit(InMemoryGradients(grads), EngineConfig(name="ekfac"), normalized)
    assert recomputed.meta["eigenvalues_from"] == "second pass"
    for key, value in from_index.arrays.items():
        np.testing.assert_allclose(recomputed.arrays[key], value, rtol=1e-9, atol=1e-15)


def test_ekfac_sign_with_a_real_preconditioned_sgd_step():
    """A step -lr H^-1 g_j changes the query loss by about -lr <q, H^-1 g_j> = -lr score_j."""
    import torch

    from gradian.grads import capture_per_example_grads, collate, per_example_loss

    gm, tok, tokenized, grads, context = _setup()
    query_rows = tokenized[:1]
    qb = collate(query_rows, tok.pad_token_id)
    query = {k: v[0].numpy() for k, v in capture_per_example_grads(gm, qb).items()}
    config = EngineConfig(name="ekfac")
    engine = get_engine("ekfac")
    state = engine.fit(InMemoryGradients(grads), config, context)
    scores = engine.score(state, query, config).scores
    # the preconditioned training gradient H^-1 g_j, by the engine's own inverse (H is symmetric)
    params = [p for b in gm.blocks for p in b.parameters]

    def qloss():
        with torch.no_grad():
            return per_example_loss(gm.model(input_ids=qb.input_ids).logits, qb.labels).item()

    base = qloss()
    lr = 1e-7  # H^-1 amplifies the step by up to 1/damping: keep it in the linear regime
    for j in range(len(tokenized)):
        step = engine.score(state, {b: g[j] for b, g in grads.items()}, config)  # unused scores; damping per layer
        pre = _precondition(state, {b: g[j] for b, g in grads.items()}, step.damping)
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            k = 0
            for block in gm.blocks:
                offset = 0
                for p in block.parameters:
                    size = p.numel()
                    p -= lr * torch.from_numpy(pre[block.name][offset: offset + size].reshape(p.shape))
                    offset += size
                    k += 1
        delta = qloss() - base
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        assert np.sign(delta) == -np.sign(scores[j]), (j, delta, scores[j])
        assert delta == pytest.approx(-lr * scores[j], rel=0.05)


def _precondition(state, vector, damping):
    from gradian.engines.kronecker import KroneckerEigen

    out = {b: np.zeros_like(v, dtype=np.float64) for b, v in vector.items()}
    for layer in state.meta["layers"]:
        key, b, o, i, off = layer["key"], layer["block"], layer["out"], layer["in"], layer["offset"]
        eigen = KroneckerEigen(state.arrays[f"{key}.q_a"], state.arrays[f"{key}.q_s"], state.arrays[f"{key}.eigenvalues"])
        part = vector[b][off: off + o * i].reshape(1, o, i)
        out[b][off: off + o * i] = damped_inverse(eigen, part, damping[key]).reshape(-1)
    return out


class _StoredGradients(InMemoryGradients):
    index_id = "0123456789abcdef0123"


def test_fit_is_deterministic_and_cached_beside_the_index(tmp_path):
    gm, tok, tokenized, grads, context = _setup()
    config = EngineConfig(name="ekfac")
    first = fit_engine("ekfac", _StoredGradients(grads), config, context, cache_dir=tmp_path)
    assert not first.cache_hit and first.state_id
    again = fit_engine("ekfac", _StoredGradients(grads), config, context)  # no cache: fitted anew
    for key, value in first.arrays.items():
        assert np.array_equal(value, again.arrays[key]), key  # bit-identical on CPU
    hit = fit_engine("ekfac", _StoredGradients(grads), config, None, cache_dir=tmp_path)
    assert hit.cache_hit and hit.state_id == first.state_id
    q = {b: g[0] for b, g in grads.items()}
    engine = get_engine("ekfac")
    assert np.array_equal(engine.score(hit, q, config).scores, engine.score(first, q, config).scores)
    # damping is applied when scoring: it does not change the state id; the Fisher kind does
    damped = fit_engine("ekfac", _StoredGradients(grads), EngineConfig(name="ekfac", lambda_scale=0.5), None,
                        cache_dir=tmp_path)
    assert damped.cache_hit
    true = fit_engine("ekfac", _StoredGradients(grads), EngineConfig(name="ekfac", fisher="true"), context,
                      cache_dir=tmp_path)
    assert not true.cache_hit and true.state_id != first.state_id
    assert true.meta["eigenvalues_from"] == "second pass"


def test_true_fisher_is_seeded():
    gm, tok, tokenized, grads, context = _setup()
    engine = get_engine("kfac")
    a = engine.fit(InMemoryGradients(grads), EngineConfig(name="kfac", fisher="true", fisher_seed=3), context)
    b = engine.fit(InMemoryGradients(grads), EngineConfig(name="kfac", fisher="true", fisher_seed=3), context)
    c = engine.fit(InMemoryGradients(grads), EngineConfig(name="kfac", fisher="true", fisher_seed=4), context)
    key = next(k for k in a.arrays if k.endswith(".eigenvalues"))
    assert np.array_equal(a.arrays[key], b.arrays[key])
    assert not np.array_equal(a.arrays[key], c.arrays[key])


def test_ekfac_refuses_projected_gradients_and_a_missing_model():
    gm, tok, tokenized, grads, context = _setup()
    with pytest.raises(ConfigError, match="needs the model"):
        score(InMemoryGradients(grads), {b: g[0] for b, g in grads.items()}, EngineConfig(name="ekfac"))
    narrow = {b: g[:, :4] for b, g in grads.items()}
    with pytest.raises(ConfigError, match="projection_dim"):
        get_engine("ekfac").fit(InMemoryGradients(narrow), EngineConfig(name="ekfac"), context)
    with pytest.raises(ConfigError, match="fisher_samples"):
        get_engine("ekfac").settings(EngineConfig(name="ekfac", fisher="true", fisher_samples=0))


def test_equivalent_engines_are_recognised():
    from gradian.engines import equivalent_engines

    train = InMemoryGradients({"b": np.ones((3, 2))})
    tracin = get_engine("tracin").fit(train, EngineConfig(name="tracin"))  # no checkpoints
    graddot = get_engine("graddot").fit(train, EngineConfig(name="graddot"))
    datainf = get_engine("datainf").fit(train, EngineConfig(name="datainf"))
    assert "graddot scaled" in equivalent_engines(tracin, graddot)
    assert equivalent_engines(datainf, graddot) is None
    assert equivalent_engines(EngineState("ekfac", train), EngineState("ekfac", train)) == "both are ekfac"


def test_factors_collected_during_the_index_pass_equal_the_fits_own_pass():
    from gradian.grads import iter_example_gradients
    from gradian.grads.collectors import KroneckerCollector

    gm, tok, tokenized, grads, context = _setup(batch_size=3)
    with KroneckerCollector(gm) as collector:
        stored = {}
        for _, chunk in iter_example_gradients(gm, tokenized, context.grads, tok.pad_token_id):
            for b, g in chunk.items():
                stored.setdefault(b, []).append(g)
    assert collector.complete(len(tokenized))
    train = InMemoryGradients({b: np.concatenate(v) for b, v in stored.items()})
    own = get_engine("ekfac").fit(train, EngineConfig(name="ekfac"), context)
    reused = get_engine("ekfac").fit(train, EngineConfig(name="ekfac"),
                                     FitContext(**{**vars(context), "collected": collector}))
    assert own.meta["factors_from"] == "own pass" and reused.meta["factors_from"] == "index build"
    for key, value in own.arrays.items():
        assert np.array_equal(value, reused.arrays[key]), key
    # an incomplete collection (a resumed build, a layer the hooks did not see) is not used
    partial = KroneckerCollector(gm)
    partial.examples, partial.real_tokens, partial._sums = collector.examples - 1, collector.real_tokens, collector._sums
    assert not partial.complete(len(tokenized))
    missing = KroneckerCollector(gm)
    missing.examples, missing.real_tokens = collector.examples, collector.real_tokens
    missing._sums = dict(list(collector._sums.items())[1:])
    assert not missing.complete(len(tokenized))
    again = get_engine("ekfac").fit(train, EngineConfig(name="ekfac"), FitContext(**{**vars(context), "collected": partial}))
    assert again.meta["factors_from"] == "own pass"


def test_factors_are_the_same_from_a_capture_a_plain_pass_and_the_fits_own_pass(monkeypatch):
    """The factor sums a ``KroneckerCollector`` gathers during a per-example capture, during the
    plain forward and backward of ``output_gradient_pass`` (a stream's factors-only first pass),
    and those the fit's own pass computes are bit for bit the same, on sites that read one input
    (q/k/v, gate/up), whose input sum the collector and the own pass compute once per batch."""
    import torch

    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import capture_per_example_grads, collate, wrap_peft_model
    from gradian.grads import collectors
    from gradian.grads.capture import output_gradient_pass
    from gradian.grads.collectors import KroneckerCollector, ModelPasses
    from tests.plugins.chat_tokenizer import build_chat_tokenizer
    from tests.plugins.tiny_lora import build_tiny_lora

    tok = build_chat_tokenizer()
    rows = [{"prompt": "what is the capital of france ?", "completion": "paris"},
            {"prompt": "say hello", "completion": "hello world and more words"},
            {"prompt": "count to three", "completion": "one two three"}]
    tokenized = tokenize_examples(dataset_from_rows(rows).examples, tok, 64)
    sites = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64, target_modules=sites))
    batch = collate(tokenized, tok.pad_token_id)
    calls = [0]
    counted = collectors.gram_upper

    def counting(m):
        calls[0] += 1
        return counted(m)

    monkeypatch.setattr(collectors, "gram_upper", counting)
    got, n_calls = {}, {}
    for name, run in (("capture", lambda: capture_per_example_grads(gm, batch, "hooks", "mean")),
                      ("plain", lambda: output_gradient_pass(gm, batch, "mean"))):
        calls[0] = 0
        with KroneckerCollector(gm) as collector:
            run()
        assert collector.complete(len(tokenized))
        got[name], n_calls[name] = collector.sums, calls[0]
    calls[0] = 0
    own = ModelPasses(gm, tokenized, tok.pad_token_id, GradsConfig(batch_size=len(tokenized))).factor_totals()
    n_calls["own pass"] = calls[0]
    assert set(got["capture"]) == set(got["plain"]) == set(own)
    for key, (xx, gg, tokens, rows) in own.items():
        for name in ("capture", "plain"):
            assert np.array_equal(got[name][key][0], xx) and np.array_equal(got[name][key][1], gg), (name, key)
            assert got[name][key][2] == tokens
        assert np.array_equal(xx, xx.T) and np.array_equal(gg, gg.T)
        assert rows == len(tokenized)
    # two sums per LoRA matrix, less the input sums reused: k and v read q's input, up reads gate's
    layers = len(got["plain"])
    n_blocks = layers // (2 * len(sites))
    assert n_calls["plain"] == n_calls["capture"] == n_calls["own pass"] == 2 * layers - 3 * n_blocks


def test_ekfac_over_checkpoints_is_the_weighted_sum_of_fits_under_each(tmp_path, tiny_lora_dirs, chat_tokenizer):
    """``engine.checkpoints: all``: each saved checkpoint gets its own index, curvature fit and query;
    the scores are the learning-rate-weighted sum of what each checkpoint alone gives."""
    import dataclasses
    import shutil

    from gradian.config import load_config
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.attribution.checkpoints import fit_context
    from gradian.engines import get_engine
    from gradian.engines.state import fit_engine
    from gradian.engines.tracin import checkpoint_learning_rates
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.runs.record import RunRecord
    from tests.plugins.tiny_lora import hello_query_for, save_tiny_lora

    base, final = tiny_lora_dirs
    _, second = save_tiny_lora(tmp_path / "other", seed=5)
    ckpt = tmp_path / "run" / "checkpoint-10"
    shutil.copytree(second, ckpt)
    cfg = load_config(overrides={"dtype": "float64", "device": "cpu", "attn_implementation": "sdpa",
                                 "cache_dir": str(tmp_path / "cache"), "base_model": str(base),
                                 "engine.checkpoints": "all"})
    rows = [{"prompt": "say hello", "completion": c} for c in ("hello world", "no", "one two three", "hi there")]
    dataset = dataset_from_rows(rows)
    tokenized = tokenize_examples(dataset.examples, chat_tokenizer, cfg.grads.max_seq_length)
    gm = load_model_for_gradients(str(base), str(final), cfg)
    index = GradientIndex.build(gm, chat_tokenizer, dataset, cfg)
    record = RunRecord.from_dict({})
    record.checkpoints = [str(ckpt), str(final)]
    context = fit_context(cfg, gm, chat_tokenizer, dataset, record, tokenized=tokenized)
    state = fit_engine("ekfac", index, cfg.engine, context, cache_dir=cfg.cache_dir)
    assert [c["label"] for c in state.meta["checkpoints"]] == ["checkpoint-10", final.name]
    assert state.state_id is None  # per-checkpoint indexes and adapters live in memory: not stored
    first, last = state.meta["checkpoints"]
    # the checkpoint with the final adapter's weights reuses the final index; the other's factors
    # came from its own index build, and each fit is stored beside its index like a final-adapter fit
    assert last["final_adapter"] and last["index_id"] == index.index_id
    assert not first["final_adapter"] and first["index_id"] != index.index_id
    assert state.extra["checkpoints"][0]["state"].meta["factors_from"] == "index build"
    assert first["state_id"] and last["state_id"] and not first["cached"]
    again = fit_engine("ekfac", index, cfg.engine, context, cache_dir=cfg.cache_dir)
    assert all(c["cached"] for c in again.meta["checkpoints"])
    assert [c["state_id"] for c in again.meta["checkpoints"]] == [first["state_id"], last["state_id"]]
    tracin = get_engine("tracin").fit(index, cfg.engine, context)
    assert [c["index_id"] for c in tracin.meta["checkpoints"]] == [first["index_id"], index.index_id]
    query_for = hello_query_for(chat_tokenizer)

    engine = get_engine("ekfac")
    result = engine.score(state, query_for(gm), cfg.engine, query_for=query_for)
    assert "summed over 2 checkpoints" in result.notes[0]
    final_only = dataclasses.replace(cfg.engine, checkpoints="final")
    expected = np.zeros(len(rows))
    expected_rank = np.zeros(len(rows))
    for path, weight in zip((ckpt, final), checkpoint_learning_rates([str(ckpt), str(final)], record)):
        alone = load_model_for_gradients(str(base), str(path), cfg)
        alone_index = GradientIndex.build(alone, chat_tokenizer, dataset, cfg)
        alone_state = engine.fit(alone_index, final_only, fit_context(cfg, alone, chat_tokenizer, dataset, None,
                                                                      tokenized=tokenized))
        alone_result = engine.score(alone_state, query_for(alone), final_only)
        expected += weight * alone_result.scores
        expected_rank += weight * alone_result.ranking  # the RelatIF values, under each checkpoint's curvature
    np.testing.assert_allclose(result.scores, expected, rtol=1e-6)
    np.testing.assert_allclose(result.ranking, expected_rank, rtol=1e-6)
    np.testing.assert_allclose(engine.score(again, query_for(gm), cfg.engine, query_for=query_for).scores,
                               result.scores, rtol=1e-12)
    gm.model.set_adapter(gm.adapter_name)  # the query under each checkpoint left the last one active
    assert not np.allclose(result.scores, engine.score(engine.fit(index, final_only, context), query_for(gm),
                                                       final_only).scores)
    # the final adapter alone on a run that saved checkpoints: the notes point at the checkpoint mode
    final_state = engine.fit(index, final_only, context)
    assert any("saved 2 checkpoints" in n and "engine.checkpoints: all" in n
               for n in engine.score(final_state, query_for(gm), final_only).notes)
    # a run without checkpoints: the final adapter alone, and the report says so
    bare = engine.fit(index, cfg.engine, dataclasses.replace(context, run=RunRecord.from_dict({})))
    assert any("saved no checkpoint" in n for n in engine.score(bare, query_for(gm), cfg.engine).notes)


def test_relatif_ranks_by_each_score_over_the_root_of_the_rows_explicit_self_influence():
    """``engine.normalize_train: relatif`` (the default): the ranking is score_j / sqrt(g_j^T (F +
    lambda)^-1 g_j), with F the EK-FAC curvature formed explicitly per LoRA matrix, while the scores
    stay the raw influence; scaling a row's gradient leaves its ranking value."""
    from gradian.engines.kronecker import KroneckerEigen

    gm, tok, tokenized, grads, context = _setup()
    engine = get_engine("ekfac")
    plain = EngineConfig(name="ekfac", normalize_train="none")
    relatif = EngineConfig(name="ekfac")
    assert relatif.normalize_train == "relatif"
    state = engine.fit(InMemoryGradients(grads), plain, context)
    query = {b: g[0] + 0.5 * g[3] for b, g in grads.items()}
    raw = engine.score(state, query, plain)
    got = engine.score(state, query, relatif)
    assert "RelatIF" in got.notes[0]
    own = np.zeros(len(tokenized))
    for layer in state.meta["layers"]:
        key, b, o, i, off = layer["key"], layer["block"], layer["out"], layer["in"], layer["offset"]
        eigen = KroneckerEigen(state.arrays[f"{key}.q_a"], state.arrays[f"{key}.q_s"], state.arrays[f"{key}.eigenvalues"])
        basis = _kron_basis(eigen)
        curvature = basis @ np.diag(eigen.eigenvalues.ravel()) @ basis.T + raw.damping[key] * np.eye(o * i)
        g = grads[b][:, off: off + o * i]
        own += np.einsum("bi,bi->b", g, np.linalg.solve(curvature, g.T).T)
    assert raw.ranking is None and got.ranking is not None
    np.testing.assert_array_equal(got.scores, raw.scores)  # influence, in loss units, either way
    np.testing.assert_allclose(got.ranking, raw.scores / np.sqrt(own), rtol=1e-8)
    np.testing.assert_array_equal(got.rank_scores, got.ranking)
    np.testing.assert_array_equal(raw.rank_scores, raw.scores)
    # the normalization removes the row's gradient scale (same curvature, one row scaled by 7)
    scaled = {b: g.copy() for b, g in grads.items()}
    for g in scaled.values():
        g[2] *= 7.0
    moved = engine.score(EngineState("ekfac", InMemoryGradients(scaled), arrays=state.arrays, meta=state.meta),
                         query, relatif)
    np.testing.assert_allclose(moved.ranking, got.ranking, rtol=1e-9)
    assert not np.allclose(moved.scores[2], got.scores[2])
    with pytest.raises(ConfigError, match="normalize_train"):
        engine.score(state, query, EngineConfig(name="ekfac", normalize_train="l1"))


@pytest.mark.parametrize("damage", ["flipped_byte", "rewritten_numbers", "edited_meta", "truncated", "unchecksummed"])
def test_a_damaged_fitted_state_is_detected_fitted_again_and_said(tmp_path, damage):
    """A stored EK-FAC state whose bytes no longer match what was recorded is never used: the fit is
    redone (the same arrays as a clean fit, bit for bit), stored over it, and the log says so."""
    import io
    import json

    gm, tok, tokenized, grads, context = _setup()
    config = EngineConfig(name="ekfac")
    clean = fit_engine("ekfac", _StoredGradients(grads), config, context, cache_dir=tmp_path)
    root = tmp_path / "engines" / clean.state_id
    arrays, meta = root / "arrays.npz", root / "state.json"
    if damage == "flipped_byte":
        data = bytearray(arrays.read_bytes())
        data[len(data) // 2] ^= 0x01
        arrays.write_bytes(bytes(data))
    elif damage == "rewritten_numbers":  # a valid npz with other numbers: only the checksum tells
        with np.load(arrays) as handle:
            other = {k: handle[k] * 2 for k in handle.files}
        buffer = io.BytesIO()
        np.savez(buffer, **other)
        arrays.write_bytes(buffer.getvalue())
    elif damage == "edited_meta":
        record = json.loads(meta.read_text())
        record["meta"]["eigenvalues_from"] = "somewhere else"
        meta.write_text(json.dumps(record))
    elif damage == "truncated":
        arrays.write_bytes(arrays.read_bytes()[:100])
    else:
        record = json.loads(meta.read_text())
        del record["checksum"], record["arrays_sha256"]
        meta.write_text(json.dumps(record))
    lines: list[str] = []
    logged = FitContext(**{**vars(context), "log": lines.append})
    again = fit_engine("ekfac", _StoredGradients(grads), config, logged, cache_dir=tmp_path)
    assert not again.cache_hit and again.repaired, again.repaired
    assert len(lines) == 1 and clean.state_id in lines[0] and "fitting it again" in lines[0], lines
    for key, value in clean.arrays.items():
        assert np.array_equal(value, again.arrays[key]), key
    # the replacement is stored whole: the next run loads it, with nothing to repair
    hit = fit_engine("ekfac", _StoredGradients(grads), config, logged, cache_dir=tmp_path)
    assert hit.cache_hit and hit.repaired is None and len(lines) == 1
    q = {b: g[0] for b, g in grads.items()}
    engine = get_engine("ekfac")
    assert np.array_equal(engine.score(hit, q, config).scores, engine.score(clean, q, config).scores)


def test_factor_rows_are_chosen_by_each_rows_tokens():
    from gradian.grads.collectors import factor_share, in_factor_rows

    assert factor_share(100, None) == 1.0 and factor_share(100, 100) == 1.0 and factor_share(100, 500) == 1.0
    assert factor_share(100, 25) == 0.25 and factor_share(0, 5) == 1.0
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 5000, size=int(rng.integers(3, 40))).tolist() for _ in range(4000)]
    chosen = [in_factor_rows(r, 0.25) for r in rows]
    # a binomial(4000, 0.25) count: 1000 expected, sd 27; eight sd either side
    assert 780 < sum(chosen) < 1220
    # the choice is the row's own: the same ids (list, array, another dtype) give the same answer,
    # every row is chosen at share 1, and a smaller share chooses a subset of a larger one's
    assert chosen == [in_factor_rows(np.asarray(r, dtype=np.int32), 0.25) for r in rows]
    assert all(in_factor_rows(r, 1.0) for r in rows[:50])
    tenth = [in_factor_rows(r, 0.1) for r in rows]
    assert all(c for c, t in zip(chosen, tenth) if t) and 0 < sum(tenth) < sum(chosen)


def test_factors_over_a_share_of_the_rows_are_those_rows_sums_in_every_path():
    """With ``engine.factor_rows`` below the row count, the fit's own pass and a collector under
    plain passes over only the chosen rows (a stream's first pass) sum the same numbers, those of
    the chosen rows alone; a collector shown another row refuses it; the eigenvalue correction
    still reads every row."""
    from gradian.grads import collate, iter_example_gradients
    from gradian.grads.capture import output_gradient_pass
    from gradian.grads.collectors import KroneckerCollector, ModelPasses, in_factor_rows

    gm, tok, tokenized, grads, context = _setup(batch_size=3)
    passes = context.passes
    share = passes.factor_share(3)
    assert share == pytest.approx(3 / 7)
    chosen = [t for t in tokenized if in_factor_rows(t.input_ids, share)]
    assert 0 < len(chosen) < len(tokenized)
    with KroneckerCollector(gm, share=share) as collector:
        for first in range(0, len(chosen), 3):
            output_gradient_pass(gm, collate(chosen[first: first + 3], tok.pad_token_id), "mean")
        collector.skip(len(tokenized) - len(chosen))
    assert collector.complete(len(tokenized)) and collector.summed_examples == len(chosen)
    own = passes.factor_totals(share=share)
    alone = ModelPasses(gm, chosen, tok.pad_token_id, context.grads).factor_totals()
    for key, (xx, gg, tokens, rows) in alone.items():
        assert rows == len(chosen) and own[key][2:] == (tokens, rows) and collector.sums[key][2] == tokens
        for got in (own[key], collector.sums[key]):
            assert np.array_equal(got[0], xx) and np.array_equal(got[1], gg), key
    with pytest.raises(ValueError, match="outside it"):
        with KroneckerCollector(gm, share=share):
            output_gradient_pass(gm, collate(tokenized, tok.pad_token_id), "mean")
    stored = {}
    for _, chunk in iter_example_gradients(gm, tokenized, context.grads, tok.pad_token_id):
        for b, g in chunk.items():
            stored.setdefault(b, []).append(g)
    train = InMemoryGradients({b: np.concatenate(v) for b, v in stored.items()})
    config = EngineConfig(name="ekfac", factor_rows=3)
    fitted = get_engine("ekfac").fit(train, config, context)
    reused = get_engine("ekfac").fit(train, config, FitContext(**{**vars(context), "collected": collector}))
    assert fitted.meta["factors_from"] == "own pass" and reused.meta["factors_from"] == "index build"
    assert fitted.meta["factor_rows"] == reused.meta["factor_rows"] == len(chosen)
    for key, value in fitted.arrays.items():
        assert np.array_equal(reused.arrays[key], value), key
    # a collector over every row is not reused for a fit over a share, and a share that reaches
    # every row is no share: the fit is the uncapped one, state id included
    with KroneckerCollector(gm) as everything:
        output_gradient_pass(gm, collate(tokenized, tok.pad_token_id), "mean")
    assert get_engine("ekfac").fit(train, config, FitContext(**{**vars(context), "collected": everything})
                                   ).meta["factors_from"] == "own pass"
    plain = get_engine("ekfac").fit(train, EngineConfig(name="ekfac"), context)
    wide = get_engine("ekfac").fit(train, EngineConfig(name="ekfac", factor_rows=len(tokenized)), context)
    assert wide.meta["factor_rows"] == plain.meta["factor_rows"] == len(tokenized)
    for key, value in plain.arrays.items():
        assert np.array_equal(wide.arrays[key], value), key
    # the covariances differ from the whole set's, the corrected eigenvalues read every row
    assert not np.allclose(fitted.arrays[next(k for k in plain.arrays if k.endswith(".q_a"))],
                           plain.arrays[next(k for k in plain.arrays if k.endswith(".q_a"))])
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="factor_rows"):
            get_engine("ekfac").settings(EngineConfig(name="ekfac", factor_rows=bad))


def _rotated_squares(arrays, layer, per_row):
    """``[rows, out, in]``: each row's gradient of one LoRA matrix rotated into the fit's eigenbases, squared."""
    q_a, q_s = arrays[f"{layer['key']}.q_a"], arrays[f"{layer['key']}.q_s"]
    return np.einsum("so,roi,ia->rsa", q_s.T, per_row, q_a) ** 2


def test_the_eigenvalue_correction_over_a_share_of_the_rows_averages_those_rows_alone():
    """``engine.correction_rows``: the eigenbases stay those of every row's factors, and the
    corrected eigenvalues are the mean, over the rows the factors' hash chooses, of each row's
    squared gradient in those bases: over the stored gradients, and under a sampled Fisher over the
    fit's own pass (the chosen rows' labels drawn as a pass over them alone draws them). K-FAC,
    which corrects nothing, refuses the setting, and so does a bad count."""
    from gradian.grads import iter_example_gradients
    from gradian.grads.collectors import ModelPasses, in_factor_rows

    gm, tok, tokenized, grads, context = _setup(batch_size=3)
    stored = {}
    for _, chunk in iter_example_gradients(gm, tokenized, context.grads, tok.pad_token_id):
        for b, g in chunk.items():
            stored.setdefault(b, []).append(g)
    blocks = {b: np.concatenate(v) for b, v in stored.items()}
    train = InMemoryGradients(blocks, chunk_size=3)  # chunks of 3 rows: the choice is read across chunk starts
    share = context.passes.factor_share(3)
    mask = context.passes.chosen_rows(share)
    assert mask.tolist() == [in_factor_rows(t.input_ids, share) for t in tokenized] and 0 < mask.sum() < len(tokenized)
    plain = get_engine("ekfac").fit(train, EngineConfig(name="ekfac"), context)
    part = get_engine("ekfac").fit(train, EngineConfig(name="ekfac", correction_rows=3), context)
    assert part.meta["correction_rows"] == mask.sum() and "correction_rows" not in plain.meta
    assert get_engine("ekfac").settings(EngineConfig(name="ekfac", correction_rows=3))["correction_rows"] == 3
    assert "correction_rows" not in get_engine("ekfac").settings(EngineConfig(name="ekfac"))
    differs = False
    for layer in plain.meta["layers"]:
        key = layer["key"]
        for side in ("q_a", "q_s"):
            assert np.array_equal(part.arrays[f"{key}.{side}"], plain.arrays[f"{key}.{side}"]), (key, side)
        per_row = blocks[layer["block"]][:, layer["offset"]: layer["offset"] + layer["out"] * layer["in"]].astype(np.float64)
        squares = _rotated_squares(plain.arrays, layer, per_row.reshape(-1, layer["out"], layer["in"]))
        # directions with no curvature hold rounding (1e-37 here): compared at 1e-12 of the largest
        floor = 1e-12 * squares.mean(axis=0).max()
        np.testing.assert_allclose(part.arrays[f"{key}.eigenvalues"], squares[mask].mean(axis=0), rtol=1e-10, atol=floor)
        np.testing.assert_allclose(plain.arrays[f"{key}.eigenvalues"], squares.mean(axis=0), rtol=1e-10, atol=floor)
        differs |= not np.allclose(part.arrays[f"{key}.eigenvalues"], plain.arrays[f"{key}.eigenvalues"])
    assert differs
    # under a sampled Fisher the correction is the fit's own pass: over the chosen rows alone
    sampled = EngineConfig(name="ekfac", fisher="sampled", fisher_seed=4, correction_rows=3)
    fitted = get_engine("ekfac").fit(train, sampled, context)
    alone = ModelPasses(gm, [t for t, keep in zip(tokenized, mask) if keep], tok.pad_token_id, context.grads)
    sums, rows = {}, 0
    for count, per_layer in alone.layer_gradients(4, 0):
        rows += count
        for layer in fitted.meta["layers"]:
            sums[layer["key"]] = sums.get(layer["key"], 0.0) + _rotated_squares(fitted.arrays, layer,
                                                                              per_layer[layer["key"]]).sum(axis=0)
    assert rows == mask.sum() == fitted.meta["correction_rows"]
    for key, total in sums.items():
        np.testing.assert_allclose(fitted.arrays[f"{key}.eigenvalues"], total / rows, rtol=1e-10,
                                   atol=1e-12 * (total / rows).max())
    with pytest.raises(ConfigError, match="correction_rows.*kfac makes no eigenvalue correction"):
        get_engine("kfac").settings(EngineConfig(name="kfac", correction_rows=3))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="correction_rows"):
            get_engine("ekfac").settings(EngineConfig(name="ekfac", correction_rows=bad))
