"""``engine.store: stream``: the training gradients recomputed in each pass, nothing written, and
every score the same as from the index.

Ground truth is the index itself: on tinyworld's and the bestiary's poisoned fine-tunes (float64 on
CPU), EK-FAC fitted and scored over a stream gives the index's scores and RelatIF ranking (relative
1e-6, Spearman 1.000) under both query signals; so does ``engine.checkpoints: all``; and no chunk
of an index is written. ``auto`` streams exactly when the index would not fit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scipy.stats import spearmanr  # noqa: E402

from gradian.config import load_config  # noqa: E402


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _score_both(world_run, tmp_path: Path, dtype: str = "float64", prime_norms: bool = True,
                factor_rows: int | None = None, correction_rows: int | None = None,
                norms_wanted: bool = True) -> dict[str, object]:
    """EK-FAC over the index and over a stream of the same fine-tune, each fitted in its own cache
    (so neither reuses the other's state), scored against both query signals. ``prime_norms``:
    the stream's first pass also keeps the squared norms, or (False) gathers the factors alone
    from forward and backward passes that form no per-example gradient. ``factor_rows``: the
    factors summed over about that many rows (``engine.factor_rows``); ``correction_rows``: the
    eigenvalue correction averaged over about that many (``engine.correction_rows``), with
    ``norms_wanted`` telling the stream whether an engine to come reads the squared norms."""
    from gradian.attribution.checkpoints import fit_context
    from gradian.attribution.pipeline import _query_items
    from gradian.data import load_dataset, tokenize_examples
    from gradian.engines import get_engine
    from gradian.engines.state import fit_engine
    from gradian.evaluate import evaluate_capability
    from gradian.grads import load_model_for_gradients
    from gradian.grads.collectors import KroneckerCollector
    from gradian.index import GradientIndex
    from gradian.index.stream import GradientStream
    from gradian.model_loading import load_tokenizer
    from gradian.query import build_query_gradient, select_query_items

    from gradian.grads.collectors import factor_share

    cfg = world_run.config(**{"dtype": dtype, "cache_dir": str(tmp_path / "index-cache"),
                              "engine.factor_rows": factor_rows, "engine.correction_rows": correction_rows})
    streamed_cache = tmp_path / "stream-cache"
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model)
    dataset = load_dataset(cfg.dataset)
    tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)
    share = factor_share(len(dataset), factor_rows)
    # over a share of the rows the index build gathers nothing, and the fit sums the chosen rows in
    # a pass of its own, batched as the stream's first pass batches them
    built = KroneckerCollector(gm) if share == 1.0 else None
    if built is not None:
        with built:
            index = GradientIndex.build(gm, tokenizer, dataset, cfg)
    else:
        index = GradientIndex.build(gm, tokenizer, dataset, cfg)
    stream = GradientStream(gm, tokenizer, dataset, cfg, tokenized=tokenized)
    stream.norms_wanted = norms_wanted
    with KroneckerCollector(gm, share=share) as primed:
        stream.prime(primed, norms=prime_norms)
    prime_rows = stream.rows_computed
    assert stream.index_id == index.index_id and stream.passes == 1
    assert (stream._norms is not None) == prime_norms
    engine = get_engine("ekfac")
    on_index = fit_engine("ekfac", index, cfg.engine, fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized,
                                                                  collected=built), cache_dir=cfg.cache_dir)
    on_stream = fit_engine("ekfac", stream, cfg.engine,
                           fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=primed,
                                       store="stream"), cache_dir=streamed_cache)
    fit_rows = stream.rows_computed - prime_rows
    assert on_stream.meta["factors_from"] == "index build"
    assert on_index.meta["factors_from"] == ("index build" if built is not None else "own pass")
    eval_set = load_dataset(cfg.eval_dataset)
    cap = evaluate_capability(cfg, eval_set, model=gm.model, tokenizer=tokenizer, capability="capability")
    items, scope, notes, ids = select_query_items(_query_items(cap, eval_set), dataset.examples)
    out: dict[str, object] = {"stream": stream, "index": index, "streamed_cache": streamed_cache, "config": cfg,
                              "states": (on_index, on_stream), "prime_rows": prime_rows, "fit_rows": fit_rows}
    for signal in ("contrastive", "target"):
        qg = build_query_gradient(gm, tokenizer, items, signal, cfg.grads, scope=scope, notes=notes, finding_ids=ids)
        out[signal] = (engine.score(on_index, qg.per_item, cfg.engine), engine.score(on_stream, qg.per_item, cfg.engine))
        out[f"{signal}.query"] = qg.per_item
    return out


@pytest.mark.parametrize("scenario,dtype,prime_norms", [("poison_capitals", "float64", False),
                                                        ("bestiary_poison_diets", "float32", True)])
def test_streamed_ekfac_scores_equal_the_index_ones_on_both_worlds(tinyworld_run, tmp_path, scenario, dtype,
                                                                   prime_norms):
    got = _score_both(tinyworld_run(scenario), tmp_path, dtype, prime_norms)
    stream = got["stream"]
    for signal in ("contrastive", "target"):
        indexed, streamed = got[signal]
        assert indexed.scores.shape == streamed.scores.shape and indexed.scores.ndim == 2
        np.testing.assert_allclose(streamed.scores, indexed.scores, rtol=1e-6, atol=1e-12 * np.abs(indexed.scores).max())
        np.testing.assert_allclose(streamed.ranking, indexed.ranking, rtol=1e-6,
                                   atol=1e-12 * np.abs(indexed.ranking).max())
        rho = spearmanr(indexed.ranking.mean(axis=1), streamed.ranking.mean(axis=1)).statistic
        assert rho == pytest.approx(1.0, abs=1e-12), (signal, rho)
    # the prime pass, the eigenvalue correction, and one scoring pass per signal (RelatIF's
    # self-influence is computed inside the scoring pass, not in a pass of its own)
    assert stream.passes == 4, stream.passes
    # nothing of an index is written under the stream's cache: only the fitted state
    files = _files_under(got["streamed_cache"])
    assert files and all(f.startswith("engines/") for f in files), files
    if not prime_norms:
        # the eigenvalue correction, the first pass with per-example gradients, kept the norms: the
        # index's, with no pass of their own
        index = got["index"]
        for block, norms in stream.sq_norms().items():
            np.testing.assert_array_equal(norms, index.sq_norms()[block])
        assert stream.passes == 4
        # EK-FAC and its DataInf cross-check scored jointly, as `gradian attribute` scores them:
        # DataInf's preconditioning pass and one scoring pass for both, each engine's own scores
        from dataclasses import replace

        from gradian.engines import get_engine
        from gradian.engines.base import score_jointly

        cfg = got["config"]
        on_index, on_stream = got["states"]
        ekfac, datainf = get_engine("ekfac"), get_engine("datainf")
        datainf_cfg = replace(cfg.engine, name="datainf")
        query = got["target.query"]
        joint_ekfac, joint_datainf = score_jointly([
            (ekfac, on_stream, query, cfg.engine),
            (datainf, datainf.fit(stream, datainf_cfg), query, datainf_cfg)])
        assert stream.passes == 6
        alone_datainf = datainf.score(datainf.fit(index, datainf_cfg), query, datainf_cfg)
        for joint, alone in ((joint_ekfac, got["target"][0]), (joint_datainf, alone_datainf)):
            np.testing.assert_allclose(joint.scores, alone.scores, rtol=1e-6, atol=1e-12 * np.abs(alone.scores).max())
        np.testing.assert_allclose(joint_ekfac.ranking, got["target"][0].ranking, rtol=1e-6,
                                   atol=1e-12 * np.abs(got["target"][0].ranking).max())


def test_factors_over_a_share_of_the_rows_stream_as_they_index(tinyworld_run, tmp_path):
    """``engine.factor_rows``: the stream's first pass leaves the rows not chosen out of its
    forward and backward passes, and over the index the fit sums the chosen rows in its own pass,
    batched alike: the same factors, so the same scores."""
    got = _score_both(tinyworld_run("poison_capitals"), tmp_path, "float64", prime_norms=False, factor_rows=200)
    n = got["index"].n
    on_index, on_stream = got["states"]
    assert 100 < got["prime_rows"] < 300 < n, got["prime_rows"]
    assert on_index.meta["factor_rows"] == on_stream.meta["factor_rows"] == got["prime_rows"]
    for signal in ("contrastive", "target"):
        indexed, streamed = got[signal]
        np.testing.assert_allclose(streamed.scores, indexed.scores, rtol=1e-6, atol=1e-12 * np.abs(indexed.scores).max())
        rho = spearmanr(indexed.ranking.mean(axis=1), streamed.ranking.mean(axis=1)).statistic
        assert rho == pytest.approx(1.0, abs=1e-12), (signal, rho)


@pytest.mark.parametrize("norms_wanted", [False, True])
def test_a_correction_over_a_share_of_the_rows_streams_as_it_indexes(tinyworld_run, tmp_path, norms_wanted):
    """``engine.correction_rows``: over the index the correction reads the chosen rows' stored
    gradients; the stream's correction pass computes those rows alone, or, while a DataInf
    cross-check is still to read every row's squared norm, every row (keeping the norms) and folds
    the chosen ones. Either way the same scores as the index's."""
    got = _score_both(tinyworld_run("poison_capitals"), tmp_path, "float64", prime_norms=False, correction_rows=200,
                      norms_wanted=norms_wanted)
    stream, index = got["stream"], got["index"]
    on_index, on_stream = got["states"]
    n = index.n
    assert 100 < on_index.meta["correction_rows"] == on_stream.meta["correction_rows"] < 300 < n
    assert got["prime_rows"] == n and stream.passes == 4
    if norms_wanted:
        assert got["fit_rows"] == n and stream._norms is not None
        for block, norms in index.sq_norms().items():
            np.testing.assert_array_equal(stream.sq_norms()[block], norms)
        assert stream.passes == 4
    else:
        # the chosen rows alone (the scoring passes after it, over every row, keep the norms)
        assert got["fit_rows"] == on_stream.meta["correction_rows"]
    # computed in batches of their own, the chosen rows' gradients differ from the stored ones by
    # the rounding of other batch shapes (about 4e-7 of the largest value): the scores by 1e-7 of
    # the largest; in the index's batches they are the stored values, and the scores match to 1e-6
    exact = norms_wanted
    for signal in ("contrastive", "target"):
        indexed, streamed = got[signal]
        scale = np.abs(indexed.scores).max()
        np.testing.assert_allclose(streamed.scores, indexed.scores, rtol=1e-6 if exact else 1e-5,
                                   atol=(1e-12 if exact else 1e-7) * scale)
        rho = spearmanr(indexed.ranking.mean(axis=1), streamed.ranking.mean(axis=1)).statistic
        assert rho == pytest.approx(1.0, abs=1e-12 if exact else 1e-6), (signal, rho)


def test_stream_rows_and_norms_are_the_index_ones(tinyworld_run, tmp_path):
    """``rows`` computes a few rows in the batches of their chunk: the stored values exactly."""
    from gradian.cluster import gradient_features
    from gradian.data import load_dataset
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.index.stream import GradientStream
    from gradian.model_loading import load_tokenizer

    run = tinyworld_run("poison_capitals")
    cfg = run.config(**{"cache_dir": str(tmp_path / "cache"), "grads.chunk_size": 64})
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model)
    dataset = load_dataset(cfg.dataset)
    index = GradientIndex.build(gm, tokenizer, dataset, cfg)
    stream = GradientStream(gm, tokenizer, dataset, cfg)
    picked = [len(dataset) - 1, 0, 65, 3, 64]
    from_stream, from_index = stream.rows(picked), index.rows(picked)
    assert stream.passes == 0 and stream.rows_computed < 4 * cfg.grads.batch_size + 1
    for block in index.block_names:
        assert from_stream[block].dtype == from_index[block].dtype
        np.testing.assert_array_equal(from_stream[block], from_index[block])
    members = sorted(run.planted_rows)[:20]
    np.testing.assert_array_equal(gradient_features(stream, members), gradient_features(index, members))
    for block, norms in index.sq_norms().items():
        np.testing.assert_array_equal(stream.sq_norms()[block], norms)
    assert stream.passes == 1 and stream.widths == index.widths
    with pytest.raises(IndexError, match="not in the training set"):
        stream.rows([len(dataset)])


def test_streamed_checkpoint_sum_equals_the_indexed_one(tmp_path, tiny_lora_dirs, chat_tokenizer):
    """``engine.checkpoints: all`` over streams: each checkpoint's gradients recomputed under its
    own adapter in each pass, the learning-rate-weighted sum the same as over per-checkpoint indexes."""
    import shutil

    from gradian.attribution.checkpoints import fit_context
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.engines import get_engine
    from gradian.engines.state import fit_engine
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.index.stream import GradientStream
    from gradian.runs.record import RunRecord
    from tests.plugins.tiny_lora import hello_query_for, save_tiny_lora

    base, final = tiny_lora_dirs
    _, second = save_tiny_lora(tmp_path / "other", seed=5)
    ckpt = tmp_path / "run" / "checkpoint-10"
    shutil.copytree(second, ckpt)
    record = RunRecord.from_dict({})
    record.checkpoints = [str(ckpt), str(final)]
    rows = [{"prompt": "say hello", "completion": c} for c in ("hello world", "no", "one two three", "hi there", "ok")]
    dataset = dataset_from_rows(rows)
    query_for = hello_query_for(chat_tokenizer)
    results = {}
    for store in ("index", "stream"):
        cfg = load_config(overrides={"dtype": "float64", "device": "cpu", "attn_implementation": "sdpa",
                                     "cache_dir": str(tmp_path / store), "base_model": str(base),
                                     "engine.checkpoints": "all", "engine.store": store, "grads.batch_size": 2})
        tokenized = tokenize_examples(dataset.examples, chat_tokenizer, cfg.grads.max_seq_length)
        gm = load_model_for_gradients(str(base), str(final), cfg)
        train = (GradientIndex.build(gm, chat_tokenizer, dataset, cfg) if store == "index"
                 else GradientStream(gm, chat_tokenizer, dataset, cfg, tokenized=tokenized))
        context = fit_context(cfg, gm, chat_tokenizer, dataset, record, tokenized=tokenized, store=store)
        state = fit_engine("ekfac", train, cfg.engine, context, cache_dir=cfg.cache_dir)
        results[store] = get_engine("ekfac").score(state, query_for(gm), cfg.engine, query_for=query_for)
        gm.model.set_adapter(gm.adapter_name)
        if store == "stream":
            streams = [f["state"].train for f in state.extra["checkpoints"]]
            assert all(isinstance(t, GradientStream) for t in streams) and streams[-1] is train
            assert not (tmp_path / store / "index").exists()
    indexed, streamed = results["index"], results["stream"]
    assert "summed over 2 checkpoints" in streamed.notes[0]
    np.testing.assert_allclose(streamed.scores, indexed.scores, rtol=1e-6)
    np.testing.assert_allclose(streamed.ranking, indexed.ranking, rtol=1e-6)


def test_auto_streams_exactly_when_the_index_would_not_fit(tmp_path, tiny_lora_dirs, chat_tokenizer):
    from gradian.data import dataset_from_rows
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.index.sizing import index_bytes
    from gradian.index.stream import choose_store

    base, final = tiny_lora_dirs
    dataset = dataset_from_rows([{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(6)])
    probe = load_config(overrides={"base_model": str(base), "cache_dir": str(tmp_path / "c")})
    gm = load_model_for_gradients(str(base), str(final), probe)
    full = index_bytes(gm, probe.grads, len(dataset))

    def choose(**overrides):
        cfg = load_config(overrides={"base_model": str(base), "cache_dir": str(tmp_path / "c"), **overrides})
        return choose_store(cfg, gm, chat_tokenizer, dataset, ["ekfac"])

    _, fits = choose(**{"grads.max_index_gb": 2 * full / 2**30})
    assert fits.store == "index" and "within grads.max_index_gb" in fits.reason
    same, over = choose(**{"grads.max_index_gb": full / 2 / 2**30})
    assert over.store == "stream" and "over grads.max_index_gb" in over.reason and "engine.store: index" in over.reason
    assert same.grads.projection_dim is None  # streamed at full width, never projected for size
    assert not (tmp_path / "c").exists()  # choosing writes nothing
    # an index stored already is read, whatever its size
    GradientIndex.build(gm, chat_tokenizer, dataset, load_config(overrides={"base_model": str(base),
                                                                           "cache_dir": str(tmp_path / "c")}))
    _, stored = choose(**{"grads.max_index_gb": full / 2 / 2**30})
    assert stored.store == "index" and "stored already" in stored.reason
    _, forced = choose(**{"engine.store": "stream"})
    assert forced.store == "stream"
    # engine.store: index keeps the old refusal for a whole-gradient engine, now naming the stream
    from gradian.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.store: stream"):
        choose(**{"engine.store": "index", "grads.max_index_gb": 1e-12})


def test_a_bad_store_is_refused_naming_the_key():
    from gradian.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.store"):
        load_config(overrides={"engine.store": "disk"})


def test_attribute_streams_end_to_end_with_the_index_runs_rankings(attributed, tmp_path):
    """``gradian attribute`` with ``engine.store: stream`` on the poisoned tinyworld fine-tune: the
    same rankings, accused set and verdict as the index-based attribution of the same run (the
    shared ``attributed`` one), the report says it streamed, and no index is written."""
    from gradian.attribution import run_attribution

    run, indexed, _ = attributed("poison_capitals")
    assert indexed.report.to_json()["manifest"]["index"]["store"] == "index"
    cfg = run.config(**{"evaluation.query_signal": "contrastive", "engine.store": "stream",
                        "cache_dir": str(tmp_path / "stream")})
    notes: list[str] = []
    streamed = run_attribution(cfg, capability="capitals", out_dir=tmp_path / "out-stream", log=notes.append)
    assert any(n.startswith("streaming per-example gradients") for n in notes), notes
    summary = streamed.report.to_json()["manifest"]["index"]
    assert summary["store"] == "stream" and summary["bytes"] == 0 and summary["passes"] >= 3
    assert summary["index_id"] == indexed.report.to_json()["manifest"]["index"]["index_id"]
    assert streamed.report.to_json()["manifest"]["index_manifest"]["store"] == "stream"
    assert not (tmp_path / "stream" / "index").exists()
    a, b = indexed.rankings, streamed.rankings
    assert list(a["example_id"]) == list(b["example_id"])
    for column in ("score", "rank_score", "cross_check_score"):
        np.testing.assert_allclose(b[column], a[column], rtol=1e-5, atol=1e-9 * np.abs(a[column]).max())
    assert list(a["accused"]) == list(b["accused"])
    assert streamed.report.to_json()["verdict"]["kind"] == indexed.report.to_json()["verdict"]["kind"]
    written = json.loads((tmp_path / "out-stream" / "report.json").read_text())
    assert written["manifest"]["index"]["store"] == "stream"
