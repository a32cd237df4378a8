"""A streamed pass killed part way resumes where it stopped and gives the uninterrupted scores.

Ground truth is the same stream run through without interruption in another cache: EK-FAC's
prime pass (norms and Kronecker factors), eigenvalue correction and scoring pass, interrupted in
the prime pass and again in the scoring pass, then run to the end by fresh streams (as a new
process would), give bit-identical factors, eigenvalues and scores, and recompute only the chunks
that had not finished. A damaged partial result is found by its checksum and recomputed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.config import load_config  # noqa: E402

N_ROWS, CHUNK = 24, 4  # six chunks


class Interrupted(Exception):
    pass


def _inputs(tiny_lora_dirs, chat_tokenizer, cache: Path):
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import capture_per_example_grads, collate, load_model_for_gradients

    base, final = tiny_lora_dirs
    cfg = load_config(overrides={"base_model": str(base), "adapter_path": str(final), "cache_dir": str(cache),
                                 "dtype": "float64", "grads.chunk_size": CHUNK, "grads.batch_size": 3,
                                 "engine.store": "stream"})
    dataset = dataset_from_rows([{"prompt": f"what is item {i} ?", "completion": f"item {i} is {i % 5}"}
                                 for i in range(N_ROWS)])
    gm = load_model_for_gradients(str(base), str(final), cfg)
    tokenized = tokenize_examples(dataset.examples, chat_tokenizer, cfg.grads.max_seq_length)
    rows = tokenize_examples(dataset_from_rows([{"prompt": "what is item 3 ?", "completion": "item 3 is 4"},
                                                {"prompt": "say hello", "completion": "hello"}]).examples,
                             chat_tokenizer, 64)
    query = {k: v.detach().numpy() for k, v in capture_per_example_grads(gm, collate(rows, chat_tokenizer.pad_token_id)).items()}
    return cfg, gm, dataset, tokenized, query


def _attribute(cfg, gm, tokenizer, dataset, tokenized, query, stop_after: int | None = None, shard=None):
    """Prime, fit and score EK-FAC over a fresh stream (its passes sharded over ``shard``);
    ``stop_after`` chunks (over every pass) raise ``Interrupted`` right after that chunk's results
    are kept, as a kill would."""
    from gradian.attribution.checkpoints import fit_context
    from gradian.engines import get_engine
    from gradian.grads.collectors import KroneckerCollector
    from gradian.index.stream import GradientStream

    seen = [0]

    def progress(done: int, total: int) -> None:
        seen[0] += 1
        if stop_after is not None and seen[0] >= stop_after:
            raise Interrupted(seen[0])

    stream = GradientStream(gm, tokenizer, dataset, cfg, tokenized=tokenized, progress=progress, shard=shard)
    collector = KroneckerCollector(gm)
    with collector:
        stream.prime(collector)
    engine = get_engine("ekfac")
    state = engine.fit(stream, cfg.engine, fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized,
                                                       collected=collector, store="stream"))
    result = engine.score(state, query, cfg.engine)
    return stream, state, result


def test_an_interrupted_stream_resumes_and_gives_the_uninterrupted_scores(tmp_path, tiny_lora_dirs, chat_tokenizer,
                                                                          monkeypatch):
    from gradian.index.passes import PassProgress

    monkeypatch.setattr(PassProgress, "SUMS_EVERY_S", 0.0)  # keep the running sums after every chunk
    cfg, gm, dataset, tokenized, query = _inputs(tiny_lora_dirs, chat_tokenizer, tmp_path / "whole")
    whole_stream, whole_state, whole = _attribute(cfg, gm, chat_tokenizer, dataset, tokenized, query)
    assert whole_stream.passes == 3 and whole_stream.chunks_resumed == 0
    assert whole_state.meta["factors_from"] == "index build" and whole_state.meta["eigenvalues_from"] == "index"

    cut = load_config(overrides={**{k: v for k, v in _overrides(cfg).items()}, "cache_dir": str(tmp_path / "cut")})
    with pytest.raises(Interrupted):  # killed in the prime pass, after its third chunk
        _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query, stop_after=3)
    with pytest.raises(Interrupted):  # again in the scoring pass: 3 prime chunks left, 6 corrections, 3 scores
        _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query, stop_after=12)
    stream, state, resumed = _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query)
    # only the last three chunks of the scoring pass were computed by the last stream
    assert stream.rows_computed == 3 * CHUNK, stream.rows_computed
    assert stream.chunks_resumed == 6 + 6 + 3 and stream.passes == 1
    for key, value in whole_state.arrays.items():
        assert np.array_equal(state.arrays[key], value), key
    assert np.array_equal(resumed.scores, whole.scores)
    assert np.array_equal(resumed.ranking, whole.ranking)

    # a second run over the same inputs makes no pass at all; a damaged partial is recomputed
    again, _, same = _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query)
    assert again.passes == 0 and again.rows_computed == 0 and np.array_equal(same.scores, whole.scores)
    damaged = sorted((tmp_path / "cut" / "stream").rglob("rows-00002.npz"))
    assert len(damaged) == 2  # the passes with per-row outputs: prime (norms) and scoring
    for path in damaged:
        path.write_bytes(path.read_bytes()[:-7] + b"damaged")
    repaired, repaired_state, fixed = _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query)
    assert any("checksum" in r for r in repaired.repaired), repaired.repaired
    assert np.array_equal(fixed.scores, whole.scores)
    for key, value in whole_state.arrays.items():
        assert np.array_equal(repaired_state.arrays[key], value), key
    # the scoring pass has per-row outputs only: just its damaged chunk is computed again; the
    # prime pass has sums too, so it starts again and adds in the order an uninterrupted pass adds
    # (its factors come out the same, so the eigenvalue correction is read back whole)
    assert repaired.rows_computed == N_ROWS + CHUNK, repaired.rows_computed


def test_an_unwritable_cache_streams_without_keeping_partials_and_says_so(tmp_path, tiny_lora_dirs, chat_tokenizer):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    cfg, gm, dataset, tokenized, query = _inputs(tiny_lora_dirs, chat_tokenizer, blocked)
    stream, _, result = _attribute(cfg, gm, chat_tokenizer, dataset, tokenized, query)
    whole_cfg = load_config(overrides={**_overrides(cfg), "cache_dir": str(tmp_path / "ok")})
    _, _, want = _attribute(whole_cfg, gm, chat_tokenizer, dataset, tokenized, query)
    assert np.array_equal(result.scores, want.scores)
    assert len(stream.notes) == 1 and "cannot be kept" in stream.notes[0] and "cache_dir" in stream.notes[0]


def _overrides(cfg) -> dict[str, object]:
    return {"base_model": cfg.base_model, "adapter_path": cfg.adapter_path, "dtype": cfg.dtype,
            "grads.chunk_size": cfg.grads.chunk_size, "grads.batch_size": cfg.grads.batch_size,
            "engine.store": cfg.engine.store}


def test_the_running_sums_are_kept_at_most_every_few_seconds_from_the_start_of_the_pass(tmp_path, tiny_lora_dirs,
                                                                                       chat_tokenizer):
    """Under the default interval a prime pass of six quick chunks keeps its sums only after its
    last chunk (no large write after the first): killed after chunk 4, it starts again from the
    first chunk, and the scores are the uninterrupted ones."""
    cfg, gm, dataset, tokenized, query = _inputs(tiny_lora_dirs, chat_tokenizer, tmp_path / "whole")
    _, whole_state, whole = _attribute(cfg, gm, chat_tokenizer, dataset, tokenized, query)
    cut = load_config(overrides={**_overrides(cfg), "cache_dir": str(tmp_path / "cut")})
    with pytest.raises(Interrupted):
        _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query, stop_after=4)
    stream, state, resumed = _attribute(cut, gm, chat_tokenizer, dataset, tokenized, query)
    assert stream.rows_computed == 3 * N_ROWS and stream.chunks_resumed == 0, stream.rows_computed
    assert np.array_equal(resumed.scores, whole.scores)
    for key, value in whole_state.arrays.items():
        assert np.array_equal(state.arrays[key], value), key


def test_the_squared_norms_a_pass_kept_are_read_back_by_a_later_stream(tmp_path, tiny_lora_dirs, chat_tokenizer):
    """The eigenvalue correction keeps the squared norms (the first pass made only the factors); a
    later stream over the same inputs, whose fit would be stored and make no pass, reads them back
    for DataInf instead of making a pass; damaged, they are computed again."""
    from gradian.index.stream import GradientStream

    cfg, gm, dataset, tokenized, query = _inputs(tiny_lora_dirs, chat_tokenizer, tmp_path / "cache")
    from gradian.attribution.checkpoints import fit_context
    from gradian.engines import get_engine
    from gradian.grads.collectors import KroneckerCollector

    first = GradientStream(gm, chat_tokenizer, dataset, cfg, tokenized=tokenized)
    with KroneckerCollector(gm) as collector:
        first.prime(collector, norms=False)
    assert first._norms is None
    get_engine("ekfac").fit(first, cfg.engine, fit_context(cfg, gm, chat_tokenizer, dataset, None, tokenized=tokenized,
                                                          collected=collector, store="stream"))
    assert first.passes == 2 and first._norms is not None  # the correction kept them
    later = GradientStream(gm, chat_tokenizer, dataset, cfg, tokenized=tokenized)
    for block, norms in later.sq_norms().items():
        np.testing.assert_array_equal(norms, first.sq_norms()[block])
    assert later.passes == 0 and later.rows_computed == 0
    kept = first.passes_root / "norms.npz"
    kept.write_bytes(kept.read_bytes()[:-7] + b"damaged")
    again = GradientStream(gm, chat_tokenizer, dataset, cfg, tokenized=tokenized)
    for block, norms in again.sq_norms().items():
        np.testing.assert_array_equal(norms, first.sq_norms()[block])
    assert again.passes == 1 and again.rows_computed == N_ROWS
