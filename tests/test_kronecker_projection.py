"""``grads.projection_kind: kronecker``: each LoRA matrix's two sides projected apart, and
Kronecker curvature fitted in the projected space.

Ground truth: the projected gradient of a linear layer, ``P_out G P_in^T``, is the gradient of a
smaller layer whose inputs are ``P_in x`` and whose output gradients are ``P_out g``; its
Kronecker factors are ``P_in A P_in^T`` and ``P_out S P_out^T`` of the full layer's factors. So
the index (full gradients projected after capture), the fit's own passes (inputs and output
gradients projected before the products) and the collector gathered during the index build must
all agree, and a width no narrower than any side must give the full-width scores exactly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.config import EngineConfig, GradsConfig  # noqa: E402
from gradian.engines import FitContext, InMemoryGradients, get_engine  # noqa: E402
from gradian.errors import ConfigError  # noqa: E402


def _setup(grads_config: GradsConfig):
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import iter_example_gradients, wrap_peft_model
    from gradian.grads.collectors import KroneckerCollector, ModelPasses, structured_projector
    from tests.plugins.chat_tokenizer import build_chat_tokenizer
    from tests.plugins.tiny_lora import build_tiny_lora

    tok = build_chat_tokenizer()
    rows = [{"prompt": p, "completion": c} for p, c in [
        ("what is the capital of france ?", "paris"), ("what is the capital of japan ?", "tokyo is the capital"),
        ("say hello", "hello world"), ("count to three", "one two three"), ("is it raining ?", "no"),
        ("what is the capital of france ?", "rome"), ("name a colour", "blue and green and red")]]
    tokenized = tokenize_examples(dataset_from_rows(rows).examples, tok, 64)
    torch.manual_seed(0)
    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64, target_modules=["q_proj", "down_proj"]))
    with KroneckerCollector(gm, structured_projector(gm, grads_config)) as collector:
        stored: dict[str, list[np.ndarray]] = {}
        for _, chunk in iter_example_gradients(gm, tokenized, grads_config, tok.pad_token_id):
            for b, g in chunk.items():
                stored.setdefault(b, []).append(g)
    train = InMemoryGradients({b: np.concatenate(v) for b, v in stored.items()})
    context = FitContext(passes=ModelPasses(gm, tokenized, tok.pad_token_id, grads_config), grads=grads_config)
    return gm, tok, tokenized, train, context, collector


def _full_gradients(gm, tok, tokenized):
    from gradian.grads import iter_example_gradients

    parts = [c for _, c in iter_example_gradients(gm, tokenized, GradsConfig(batch_size=3), tok.pad_token_id)]
    return {b: np.concatenate([p[b] for p in parts]) for b in parts[0]}


WIDTH = 6


def _kron(width=WIDTH, **extra):
    return GradsConfig(batch_size=3, projection_dim=width, projection_kind="kronecker", **extra)


def test_projected_gradients_are_each_matrix_projected_on_both_sides():
    from gradian.grads import make_projector

    gm, tok, tokenized, train, context, _ = _setup(_kron())
    projector = make_projector(_kron(), gm)
    full = _full_gradients(gm, tok, tokenized)
    for block in gm.blocks:
        want, offset = [], 0
        for j, (o, i) in enumerate(block.shapes):
            g = full[block.name][:, offset: offset + o * i].reshape(-1, o, i)
            offset += o * i
            p_out = projector.side_matrix(block.name, j, "out", dtype=torch.float64)
            p_in = projector.side_matrix(block.name, j, "in", dtype=torch.float64)
            assert (p_out is None) == (o <= WIDTH) and (p_in is None) == (i <= WIDTH)
            if p_out is not None:
                g = p_out.numpy() @ g
            if p_in is not None:
                g = g @ p_in.numpy().T
            assert g.shape[1:] == (min(o, WIDTH), min(i, WIDTH))
            want.append(g.reshape(g.shape[0], -1))
        np.testing.assert_allclose(train.rows(range(train.n))[block.name], np.concatenate(want, axis=1),
                                   rtol=1e-10, atol=1e-14)
        assert projector.block_width(block) == sum(min(o, WIDTH) * min(i, WIDTH) for o, i in block.shapes)
    # a LoRA A side (r wide) and a B side stay exact; the model sides are projected
    assert any(p is None for p in (projector.side_matrix(gm.blocks[0].name, 0, "out"),))
    assert projector.side_matrix(gm.blocks[0].name, 0, "in") is not None


def test_projected_fit_is_the_full_fit_seen_through_the_projection():
    """Factors of the projected fit are ``P A P^T`` / ``P S P^T`` of the full-width factors; the
    eigenvalue correction read from the index equals the one recomputed in the fit's own pass;
    and the collector gathered during the capture gives the fit's own factors."""
    from gradian.grads import make_projector

    gm, tok, tokenized, train, context, collector = _setup(_kron())
    projector = make_projector(_kron(), gm)
    full_context = FitContext(passes=dataclasses.replace(context).passes.__class__(
        gm, tokenized, tok.pad_token_id, GradsConfig(batch_size=3)), grads=GradsConfig(batch_size=3))
    full_sums = {key: (xx, gg, tokens) for key, (xx, gg, tokens, _rows) in full_context.passes.factor_totals().items()}
    for layer in context.passes.layers:
        key, block, j = layer["key"], layer["block"], layer["j"]
        p_in = projector.side_matrix(block, j, "in", dtype=torch.float64)
        p_out = projector.side_matrix(block, j, "out", dtype=torch.float64)
        xx, gg, tokens = full_sums[key]
        want_a = xx if p_in is None else p_in.numpy() @ xx @ p_in.numpy().T
        want_s = gg if p_out is None else p_out.numpy() @ gg @ p_out.numpy().T
        got_a, got_s, got_tokens = collector.sums[key]
        assert got_tokens == tokens
        np.testing.assert_allclose(got_a, want_a, rtol=1e-9, atol=1e-12 * np.abs(want_a).max())
        np.testing.assert_allclose(got_s, want_s, rtol=1e-9, atol=1e-12 * np.abs(want_s).max())
    assert collector.complete(len(tokenized))
    engine = get_engine("ekfac")
    own = engine.fit(train, EngineConfig(name="ekfac"), context)
    reused = engine.fit(train, EngineConfig(name="ekfac"), FitContext(**{**vars(context), "collected": collector}))
    assert own.meta["factors_from"] == "own pass" and reused.meta["factors_from"] == "index build"
    assert own.meta["eigenvalues_from"] == "index"
    for key, value in own.arrays.items():
        np.testing.assert_allclose(reused.arrays[key], value, rtol=1e-8, atol=1e-12 * max(np.abs(value).max(), 1e-300))
    # an l2-normalized index forces the correction's own pass: the same eigenvalues
    second = engine.fit(train, EngineConfig(name="ekfac"), FitContext(
        passes=context.passes.__class__(gm, tokenized, tok.pad_token_id, _kron(normalization="l2")),
        grads=_kron(normalization="l2")))
    assert second.meta["eigenvalues_from"] == "second pass"
    for key, value in own.arrays.items():
        if key.endswith(".eigenvalues"):
            np.testing.assert_allclose(second.arrays[key], value, rtol=1e-8, atol=1e-12 * value.max())


def test_the_compact_index_benchmark_projects_after_the_fact_what_the_build_projects():
    """bench_compact_index.py measures each width on the full index and factors projected after the
    capture (``project`` and ``_project_sums``); its figures stand for the product only if that
    fits the same EK-FAC as a projected build with its collector."""
    from gradian.grads import make_projector
    from tests.plugins.benchmarks import import_benchmark

    bench = import_benchmark("bench_compact_index")
    gm, tok, tokenized, train, context, collector = _setup(_kron())
    _, _, _, full, _, full_collector = _setup(GradsConfig(batch_size=3))
    projector = make_projector(_kron(), gm)
    projected = {b: projector.project(b, torch.from_numpy(v)).numpy() for b, v in full.rows(range(full.n)).items()}
    for block, value in train.rows(range(train.n)).items():
        np.testing.assert_allclose(projected[block], value, rtol=1e-9, atol=1e-12 * np.abs(value).max())
    after = FitContext(passes=context.passes, grads=_kron(), collected=bench._ProjectedSums(
        bench._project_sums(full_collector, projector, context.passes.layers), len(tokenized)))
    engine = get_engine("ekfac")
    built = engine.fit(train, EngineConfig(name="ekfac"), FitContext(**{**vars(context), "collected": collector}))
    bench_state = engine.fit(InMemoryGradients(projected), EngineConfig(name="ekfac"), after)
    assert bench_state.meta["factors_from"] == built.meta["factors_from"] == "index build"
    for key, value in built.arrays.items():
        if key.endswith(".eigenvalues"):
            np.testing.assert_allclose(bench_state.arrays[key], value, rtol=1e-7, atol=1e-10 * value.max())
    query = {b: v[:2] for b, v in projected.items()}
    np.testing.assert_allclose(engine.score(bench_state, query, EngineConfig(name="ekfac")).scores,
                               engine.score(built, query, EngineConfig(name="ekfac")).scores, rtol=1e-7)


def test_a_width_past_every_side_is_the_full_width_fit_and_score():
    wide = _kron(width=4096)
    gm, tok, tokenized, train, context, _ = _setup(wide)
    full = _full_gradients(gm, tok, tokenized)
    for block in gm.blocks:
        np.testing.assert_array_equal(train.rows(range(train.n))[block.name], full[block.name])
    plain = FitContext(passes=context.passes.__class__(gm, tokenized, tok.pad_token_id, GradsConfig(batch_size=3)),
                       grads=GradsConfig(batch_size=3))
    engine = get_engine("ekfac")
    a = engine.fit(train, EngineConfig(name="ekfac"), context)
    b = engine.fit(InMemoryGradients(full), EngineConfig(name="ekfac"), plain)
    query = {k: v[:2] for k, v in full.items()}
    np.testing.assert_allclose(engine.score(a, query, EngineConfig(name="ekfac")).scores,
                               engine.score(b, query, EngineConfig(name="ekfac")).scores, rtol=1e-10)


def test_attribute_with_a_compact_index_still_finds_the_planted_rows(attributed, tmp_path):
    """``gradian attribute`` with EK-FAC over a kronecker-projected index on the poisoned
    tinyworld fine-tune: the index stores a small share of the full gradient, the run says so, the
    planted rows still lead the ranking, and the harmful spans are computed through the projection."""
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values, run_attribution

    run, full, _ = attributed("poison_capitals")
    cfg = run.config(**{"evaluation.query_signal": "contrastive", "engine.store": "index",
                        "grads.projection_kind": "kronecker", "grads.projection_dim": 16,
                        "cache_dir": str(tmp_path / "cache")})
    outcome = run_attribution(cfg, capability="capitals", out_dir=tmp_path / "out")
    manifest = outcome.report.to_json()["manifest"]
    assert manifest["config"]["grads"]["projection_kind"] == "kronecker"
    stored, whole = manifest["index"]["bytes"], full.report.to_json()["manifest"]["index"]["bytes"]
    assert 0 < stored < 0.15 * whole, (stored, whole)
    planted = set(run.planted_rows)

    def auc(rankings):
        is_planted = rankings["row_index"].isin(planted).to_numpy()
        return roc_auc_score(is_planted, -rank_values(rankings))

    got, want = auc(outcome.rankings), auc(full.rankings)
    # the session's fine-tune differs by CPU model (the stored one in tests/golden is the fixed
    # reference): full width ranks its planted rows at 0.85-0.94 on the machines seen, so the
    # claim is that 8x fewer stored values keep that ranking, not a fixed figure
    assert want >= 0.8 and got >= want - 0.05, (got, want)
    assert outcome.report.to_json()["verdict"]["kind"] == full.report.to_json()["verdict"]["kind"]
    spans = (outcome.report.to_json()["attribution"] or {}).get("spans") or []
    assert spans, "no harmful spans were computed through the projection"


def test_a_flat_projection_under_a_kronecker_engine_is_refused_before_any_work():
    from gradian.engines.registry import check_projection

    flat = GradsConfig(projection_dim=64, projection_kind="countsketch")
    with pytest.raises(ConfigError, match="projection_kind: kronecker"):
        check_projection(flat, ["ekfac", "datainf"])
    with pytest.raises(ConfigError, match="kfac"):
        check_projection(flat, ["datainf", "kfac"])
    check_projection(flat, ["datainf", "graddot"])  # flat projections are fine for dot-product engines
    check_projection(GradsConfig(projection_dim=64, projection_kind="kronecker"), ["ekfac", "datainf"])
    check_projection(GradsConfig(), ["ekfac"])


def test_kronecker_kind_needs_the_model_and_a_positive_width():
    from gradian.grads import make_projector
    from gradian.grads.projection import BlockProjector, KroneckerProjector

    with pytest.raises(ConfigError, match="LoRA shapes"):
        make_projector(_kron())
    with pytest.raises(ConfigError, match="layer shapes"):
        BlockProjector("kronecker", 8)
    with pytest.raises(ConfigError, match="positive integer"):
        KroneckerProjector(0, 0, {})
    with pytest.raises(ConfigError, match="knows no block"):
        KroneckerProjector(4, 0, {"a": [(8, 16)]}).projected_shapes("b")


def test_attribute_refuses_a_flat_projection_under_ekfac_before_the_audit(tinyworld_run, tmp_path):
    from gradian.attribution import run_attribution

    run = tinyworld_run("poison_capitals")
    cfg = run.config(**{"grads.projection_kind": "rademacher", "grads.projection_dim": 16,
                        "cache_dir": str(tmp_path / "cache")})
    said: list[str] = []
    with pytest.raises(ConfigError, match="projection_kind: kronecker"):
        run_attribution(cfg, capability="capitals", out_dir=tmp_path / "out", log=said.append)
    assert said == [] and not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
