"""Streamed EK-FAC against the floor of one plain forward+backward pass, with the index beside it.

On one random-init LoRA model and one set of rows, in one process, each repeat times:

- ``floor``: one plain forward and backward of the summed loss (``gradian.grads.per_example_loss``
  over ``collate``d rows, in the batches and chunks the capture uses), LoRA weights requiring
  grad, no hooks, no per-example gradient: the least any method that looks at every row's
  gradient once could cost;
- ``stream``: EK-FAC over ``engine.store: stream`` for one query, end to end: the prime pass
  (the Kronecker factors, from forward and backward passes that form no per-example gradient;
  with ``--prime-norms`` per-example gradients and their squared norms too, as when a DataInf
  cross-check will read them), the fit (eigendecompositions, then the eigenvalue
  correction pass) and the scoring pass (scores and RelatIF's self-influence in the same pass),
  in a fresh ``cache_dir`` (a stream keeps each pass's partial results there, and a second run
  over the same inputs would make no pass at all);
- ``index``: EK-FAC over the on-disk index, end to end: the build (capture, with the Kronecker
  factors gathered on the way), the fit (eigendecompositions and a read for the correction) and
  the score (a read), in a fresh ``cache_dir``;
- ``datainf_stream`` (unless ``--no-datainf``): DataInf over a stream, for reference;
- ``pair_separate`` and ``pair_joint`` (with ``--pair``): EK-FAC and its DataInf cross-check over
  one stream, one engine after the other (a first pass that keeps the squared norms, a scoring
  pass each: 5 passes) and as ``gradian attribute`` runs them (the first pass for the factors
  alone, the norms kept by the eigenvalue correction, DataInf's preconditioner, one scoring pass
  for both: 4 passes), checked to give the same scores.

Reported: each stage's median over ``--repeats`` with its range, the stream's per-pass seconds
(``GradientStream.pass_seconds``), and ``stream / floor`` and ``index / floor`` both as the ratio
of the medians and as the median of each repeat's ratio (the stages of a repeat run back to
back, so load from other processes on the host hits them alike). The goal of the streamed
store is ``stream / floor <= 3.5``. The stream's and the index's scores and rankings are checked
to agree (relative 1e-5 in float32, 1e-9 in float64), so both timings are of the same work.

Run: ``python projects/benchmarks/bench_stream.py [--model tinyworld|small|medium] [--rows N]
[--tokens T] [--batch-size B] [--repeats 3] [--dtype float32|float64] [--factor-rows N] [--correction-rows N]
[--out results.json]``.
``--factor-rows`` sets ``engine.factor_rows``: the stream's first pass then runs over about that
many rows, and over the index the fit sums them in a pass of its own.
``--correction-rows`` sets ``engine.correction_rows``: the stream's eigenvalue correction then
computes about that many rows (in batches of their own, so in float64 the two stores' scores are
checked to 1e-6), and over the index it reads those rows' stored gradients.
Random weights are fine: timing does not depend on what the model knows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SITES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> (LlamaConfig values, default rows, default tokens per row)
PRESETS: dict[str, tuple[dict[str, Any], int, int]] = {
    # the shape of tinyworld's base model (gradian.tinyworld.base.BaseModelRecipe)
    "tinyworld": (dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True), 256, 64),
    "small": (dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                   num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True), 128, 128),
    "medium": (dict(vocab_size=16000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True), 64, 256),
}

_WORDS = ("what is the capital of france paris japan tokyo answer question hello world you are a helpful "
          "assistant say translate to spanish hola yes no one two three four five and or").split()


def build_model(preset: str, rank: int, dtype: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(PRESETS[preset][0])
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, **values)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=SITES, init_lora_weights=False,
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora).eval(), values


def make_rows(n: int, tokens: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompt/completion rows of about ``tokens`` tokens each (0.75x to 1.25x, so a batch
    pads as real data does), a quarter of them prompt."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = max(8, int(tokens * rng.uniform(0.75, 1.25)) - 12)  # the template adds about 12 tokens
        words = [_WORDS[j] for j in rng.integers(0, len(_WORDS), size=length)]
        cut = max(1, length // 4)
        rows.append({"prompt": " ".join(words[:cut]), "completion": " ".join(words[cut:])})
    return rows


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def _blas_threads() -> int | None:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    counts = [int(p["num_threads"]) for p in threadpool_info() if p.get("user_api") == "blas"]
    return max(counts) if counts else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from gradian.attribution.checkpoints import fit_context
    from gradian.config import load_config
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.engines import get_engine
    from gradian.grads import capture_per_example_grads, collate, per_example_loss, wrap_peft_model
    from gradian.grads.collectors import KroneckerCollector, factor_share
    from gradian.index import GradientIndex
    from gradian.index.stream import GradientStream

    from chat_tokenizer import build_chat_tokenizer

    load_before = os.getloadavg()
    tokenizer = build_chat_tokenizer()
    peft_model, values = build_model(args.model, args.rank, args.dtype)
    base = {"device": "cpu", "dtype": args.dtype, "grads.batch_size": args.batch_size,
            "grads.chunk_size": args.chunk_size, "grads.max_seq_length": int(args.tokens * 1.5) + 16,
            "grads.max_index_gb": None, "engine.factor_rows": args.factor_rows,
            "engine.correction_rows": args.correction_rows}
    probe = load_config(overrides={**base, "cache_dir": tempfile.gettempdir()})
    gm = wrap_peft_model(peft_model, probe)
    dataset = dataset_from_rows(make_rows(args.rows, args.tokens))
    started = time.perf_counter()
    tokenized = tokenize_examples(dataset.examples, tokenizer, probe.grads.max_seq_length)
    tokenize_seconds = time.perf_counter() - started
    lengths = [len(t.input_ids) for t in tokenized]
    pad = tokenizer.pad_token_id
    query_rows = tokenize_examples(dataset_from_rows(make_rows(1, args.tokens, seed=1)).examples, tokenizer,
                                   probe.grads.max_seq_length)
    query = {k: v.detach().cpu().numpy() for k, v in capture_per_example_grads(gm, collate(query_rows, pad)).items()}

    # the batches the capture makes: each chunk in batches that start at its first row
    batches = []
    for first in range(0, len(tokenized), args.chunk_size):
        last = min(first + args.chunk_size, len(tokenized))
        batches += [collate(tokenized[s: min(s + args.batch_size, last)], pad)
                    for s in range(first, last, args.batch_size)]
    lora = [p for block in gm.blocks for p in block.parameters]
    # engine.factor_rows: the stream's first pass runs over the chosen rows; over the index the fit
    # sums them in a pass of its own (the build gathers no factors)
    def share(rows: Any) -> float:
        return factor_share(len(rows), args.factor_rows)
    reduction = probe.grads.loss_reduction

    def floor() -> float:
        for p in lora:
            p.requires_grad_(True)
        started = time.perf_counter()
        with torch.enable_grad():
            for batch in batches:
                logits = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
                per_example_loss(logits, batch.labels, reduction).sum().backward()
        seconds = time.perf_counter() - started
        for p in lora:
            p.grad = None
        return seconds

    ekfac = get_engine("ekfac")

    def stream_ekfac(cache: str, dataset: Any = dataset, tokenized: list[Any] = tokenized) -> dict[str, Any]:
        cfg = load_config(overrides={**base, "cache_dir": cache, "engine.store": "stream"})
        t0 = time.perf_counter()
        stream = GradientStream(gm, tokenizer, dataset, cfg, tokenized=tokenized)
        stream.norms_wanted = False  # EK-FAC alone reads no squared norm: a correction over a share computes only it
        with KroneckerCollector(gm, share=share(dataset)) as collector:
            stream.prime(collector, norms=args.prime_norms)
        t1 = time.perf_counter()
        context = fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=collector,
                              store="stream")
        state = ekfac.fit(stream, cfg.engine, context)
        t2 = time.perf_counter()
        result = ekfac.score(state, query, cfg.engine)
        t3 = time.perf_counter()
        assert stream.passes == 3 and stream.chunks_resumed == 0, (stream.passes, stream.chunks_resumed)
        assert state.meta["factors_from"] == "index build" and state.meta["eigenvalues_from"] == "index"
        prime, correction, scoring = stream.pass_seconds
        return {"total": t3 - t0, "prime": t1 - t0, "fit": t2 - t1, "score": t3 - t2,
                "pass.prime": prime, "pass.eigenvalue_correction": correction, "pass.scoring": scoring,
                "eigendecompositions": (t2 - t1) - correction, "result": result}

    def index_ekfac(cache: str, dataset: Any = dataset, tokenized: list[Any] = tokenized) -> dict[str, Any]:
        cfg = load_config(overrides={**base, "cache_dir": cache, "engine.store": "index"})
        t0 = time.perf_counter()
        collector = KroneckerCollector(gm) if share(dataset) == 1.0 else None
        if collector is not None:
            with collector:
                index = GradientIndex.build(gm, tokenizer, dataset, cfg)
        else:
            index = GradientIndex.build(gm, tokenizer, dataset, cfg)
        t1 = time.perf_counter()
        context = fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=collector)
        state = ekfac.fit(index, cfg.engine, context)
        t2 = time.perf_counter()
        result = ekfac.score(state, query, cfg.engine)
        t3 = time.perf_counter()
        assert not index.cache_hit and state.meta["factors_from"] == ("index build" if collector is not None else "own pass")
        return {"total": t3 - t0, "build": t1 - t0, "fit": t2 - t1, "score": t3 - t2,
                "index_bytes": index.disk_bytes(), "result": result}

    def stream_datainf(cache: str, dataset: Any = dataset, tokenized: list[Any] = tokenized) -> dict[str, Any]:
        cfg = load_config(overrides={**base, "cache_dir": cache, "engine.store": "stream", "engine.name": "datainf"})
        engine = get_engine("datainf")
        t0 = time.perf_counter()
        stream = GradientStream(gm, tokenizer, dataset, cfg, tokenized=tokenized)
        context = fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized, store="stream")
        state = engine.fit(stream, cfg.engine, context)
        t1 = time.perf_counter()
        engine.score(state, query, cfg.engine)
        t2 = time.perf_counter()
        return {"total": t2 - t0, "fit": t1 - t0, "score": t2 - t1, "passes": stream.passes,
                "pass_seconds": [round(s, 3) for s in stream.pass_seconds]}

    datainf_engine = get_engine("datainf")

    def pair(cache: str, joint: bool, dataset: Any = dataset, tokenized: list[Any] = tokenized) -> dict[str, Any]:
        """EK-FAC with its DataInf cross-check over one stream, as ``gradian attribute`` runs the pair
        (``joint``: a first pass for the factors alone, the squared norms kept by the eigenvalue
        correction, one scoring pass for both engines) or one engine after the other (a first pass
        that also keeps the norms, a scoring pass per engine)."""
        from dataclasses import replace

        from gradian.engines.base import score_jointly

        cfg = load_config(overrides={**base, "cache_dir": cache, "engine.store": "stream"})
        datainf_cfg = replace(cfg.engine, name="datainf")
        t0 = time.perf_counter()
        stream = GradientStream(gm, tokenizer, dataset, cfg, tokenized=tokenized)
        with KroneckerCollector(gm) as collector:
            stream.prime(collector, norms=not joint)
        context = fit_context(cfg, gm, tokenizer, dataset, None, tokenized=tokenized, collected=collector,
                              store="stream")
        state = ekfac.fit(stream, cfg.engine, context)
        cross = datainf_engine.fit(stream, datainf_cfg)
        if joint:
            results = score_jointly([(ekfac, state, query, cfg.engine), (datainf_engine, cross, query, datainf_cfg)])
        else:
            results = [ekfac.score(state, query, cfg.engine), datainf_engine.score(cross, query, datainf_cfg)]
        return {"total": time.perf_counter() - t0, "passes": stream.passes, "results": results}

    # warm-up, untimed: the floor once, and each stage on the first two batches' rows (the first
    # call of each code path pays for lazy imports, allocations and kernel set-up)
    floor()
    few = min(len(tokenized), 2 * args.batch_size)
    small = dataset_from_rows(make_rows(args.rows, args.tokens)[:few])
    for stage in (stream_ekfac, index_ekfac, *((stream_datainf,) if args.datainf else ())):
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as cache:
            stage(cache, small, tokenized[:few])
    for joint in (False, True) if args.pair else ():
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as cache:
            pair(cache, joint, small, tokenized[:few])
    times: dict[str, list[float]] = {}
    extra: dict[str, Any] = {}
    agreement: list[dict[str, float]] = []
    ratios: dict[str, list[float]] = {"stream_over_floor": [], "index_over_floor": [], "stream_over_index": []}

    def keep(prefix: str, got: dict[str, Any]) -> None:
        for key, value in got.items():
            if isinstance(value, float):
                times.setdefault(f"{prefix}.{key}", []).append(value)

    for repeat in range(args.repeats):
        times.setdefault("floor", []).append(floor())
        with tempfile.TemporaryDirectory(prefix="bench-stream-") as cache:
            streamed = stream_ekfac(cache)
        with tempfile.TemporaryDirectory(prefix="bench-index-") as cache:
            indexed = index_ekfac(cache)
        keep("stream", streamed)
        keep("index", indexed)
        extra["index_bytes"] = indexed["index_bytes"]
        if args.datainf:
            with tempfile.TemporaryDirectory(prefix="bench-datainf-") as cache:
                datainf = stream_datainf(cache)
            keep("datainf_stream", datainf)
            extra["datainf_stream_passes"] = datainf["passes"]
        if args.pair:
            got = {}
            for name, joint in (("pair_separate", False), ("pair_joint", True)):
                with tempfile.TemporaryDirectory(prefix="bench-pair-") as cache:
                    got[name] = pair(cache, joint)
                keep(name, got[name])
                extra[f"{name}_passes"] = got[name]["passes"]
                ratios.setdefault(f"{name}_over_floor", []).append(got[name]["total"] / times["floor"][-1])
            for one, other in zip(got["pair_joint"]["results"], got["pair_separate"]["results"]):
                np.testing.assert_allclose(one.scores, other.scores, rtol=1e-5,
                                           atol=1e-5 * float(np.abs(other.scores).max()))
            print(f"repeat {repeat + 1}: EK-FAC + DataInf over a stream: one after the other "
                  f"{got['pair_separate']['total']:.2f} s ({got['pair_separate']['passes']} passes), "
                  f"jointly {got['pair_joint']['total']:.2f} s ({got['pair_joint']['passes']} passes)", flush=True)
        a, b = streamed["result"], indexed["result"]
        scale = float(np.abs(b.scores).max()) or 1.0
        agreement.append({"scores_max_rel_diff": float(np.abs(a.scores - b.scores).max() / scale),
                          "ranking_max_rel_diff": float(np.abs(a.ranking - b.ranking).max()
                                                        / (float(np.abs(b.ranking).max()) or 1.0))})
        # engine.correction_rows: the stream computes the chosen rows in batches of their own, whose
        # other shapes round their gradients otherwise than the index's full batches (about 1e-7 of
        # the largest score in float64)
        rtol = (1e-6 if args.correction_rows else 1e-9) if args.dtype == "float64" else 1e-5
        np.testing.assert_allclose(a.scores, b.scores, rtol=rtol, atol=rtol * scale)
        np.testing.assert_allclose(a.ranking, b.ranking, rtol=rtol, atol=rtol * float(np.abs(b.ranking).max()))
        base_s = times["floor"][-1]
        ratios["stream_over_floor"].append(streamed["total"] / base_s)
        ratios["index_over_floor"].append(indexed["total"] / base_s)
        ratios["stream_over_index"].append(streamed["total"] / indexed["total"])
        print(f"repeat {repeat + 1}: floor {base_s:.2f} s, stream {streamed['total']:.2f} s "
              f"(prime {streamed['pass.prime']:.2f}, correction {streamed['pass.eigenvalue_correction']:.2f}, "
              f"scoring {streamed['pass.scoring']:.2f}, eigh {streamed['eigendecompositions']:.2f}), "
              f"index {indexed['total']:.2f} s (build {indexed['build']:.2f}, fit {indexed['fit']:.2f}, "
              f"score {indexed['score']:.2f})", flush=True)
        if args.floor_second:
            # the floor once more after the heavy stages: a drift in host load shows as a spread
            times.setdefault("floor_after", []).append(floor())

    median = {k: statistics.median(v) for k, v in times.items()}
    floor_s = median["floor"]
    summary: dict[str, Any] = {
        "model": f"random-init llama '{args.model}' ({values['num_hidden_layers']} layers x {values['hidden_size']} "
                 f"hidden, {values['intermediate_size']} MLP, vocab {values['vocab_size']}), LoRA r={args.rank} on 7 sites",
        "lora_values_per_example": int(gm.dim), "dtype": args.dtype, "threads": torch.get_num_threads(),
        "blas_threads": _blas_threads(),
        "rows": args.rows, "tokens_per_row_mean": round(float(np.mean(lengths)), 1),
        "tokens_per_row_range": [int(min(lengths)), int(max(lengths))],
        "supervised_tokens": int(sum(sum(1 for x in t.labels if x != -100) for t in tokenized)),
        "batch_size": args.batch_size, "chunk_size": args.chunk_size, "repeats": args.repeats,
        "prime_norms": args.prime_norms, "factor_rows": args.factor_rows, "correction_rows": args.correction_rows,
        "tokenize_seconds": round(tokenize_seconds, 4),
        "seconds": {k: _stats(v) for k, v in times.items()},
        "ratio_of_medians": {
            "stream_over_floor": round(median["stream.total"] / floor_s, 3),
            "index_over_floor": round(median["index.total"] / floor_s, 3),
            "stream_over_index": round(median["stream.total"] / median["index.total"], 3),
            "stream_prime_pass_over_floor": round(median["stream.pass.prime"] / floor_s, 3),
            "stream_correction_pass_over_floor": round(median["stream.pass.eigenvalue_correction"] / floor_s, 3),
            "stream_scoring_pass_over_floor": round(median["stream.pass.scoring"] / floor_s, 3),
            **({"datainf_stream_over_floor": round(median["datainf_stream.total"] / floor_s, 3)}
               if args.datainf else {}),
            **({f"{name}_over_floor": round(median[f"{name}.total"] / floor_s, 3)
                for name in ("pair_separate", "pair_joint")} if args.pair else {}),
        },
        "median_of_ratios": {k: _stats(v) for k, v in ratios.items()},
        "goal_stream_over_floor": 3.5,
        "goal_met": bool(median["stream.total"] / floor_s <= 3.5),
        "stream_share_of_time": {k: round(median[f"stream.{k}"] / median["stream.total"], 3)
                                 for k in ("pass.prime", "pass.eigenvalue_correction", "pass.scoring",
                                           "eigendecompositions")},
        "stream_vs_index_agreement": {k: max(a[k] for a in agreement) for k in agreement[0]},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        **extra,
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="tinyworld", help="Model size preset")
    parser.add_argument("--rows", type=int, default=None, help="Training rows (default: the preset's)")
    parser.add_argument("--tokens", type=int, default=None, help="Mean tokens per row (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=8, help="grads.batch_size")
    parser.add_argument("--chunk-size", type=int, default=64, help="grads.chunk_size")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op and BLAS threads")
    parser.add_argument("--no-datainf", dest="datainf", action="store_false", help="Skip DataInf over the stream")
    parser.add_argument("--pair", action="store_true",
                        help="also time EK-FAC with its DataInf cross-check over a stream, scored jointly as "
                             "gradian attribute scores them and one engine after the other")
    parser.add_argument("--prime-norms", action="store_true",
                        help="The stream's first pass also keeps the squared norms, as it does when a DataInf "
                             "cross-check will read them (default: the factors alone, EK-FAC with no such cross-check)")
    parser.add_argument("--floor-second", action="store_true", help="Also time the floor after each repeat")
    parser.add_argument("--factor-rows", type=int, default=None,
                        help="engine.factor_rows: the Kronecker factors from about this many rows (default: every row)")
    parser.add_argument("--correction-rows", type=int, default=None,
                        help="engine.correction_rows: the eigenvalue correction from about this many rows (default: every row)")
    parser.add_argument("--quick", action="store_true", help="A smoke run: tinyworld, 32 rows of 32 tokens, once")
    parser.add_argument("--out", type=Path, default=None, help="Also write the JSON here")
    args = parser.parse_args()
    if args.quick:
        args.model, args.rows, args.tokens, args.repeats = "tinyworld", args.rows or 32, args.tokens or 32, 1
    _, rows, tokens = PRESETS[args.model]
    args.rows, args.tokens = args.rows or rows, args.tokens or tokens
    # numpy's and scipy's BLAS (the eigenbasis rotations, the eigendecompositions) at the thread
    # count torch gets: on a busy host their default spinning threads slow the numpy side of a
    # pass several-fold. The libraries are loaded first, so the limit reaches each of them.
    import torch  # noqa: F401
    import scipy.linalg  # noqa: F401
    import gradian.engines  # noqa: F401
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        summary = measure(args)
    else:
        with threadpool_limits(limits=args.threads):
            summary = measure(args)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
