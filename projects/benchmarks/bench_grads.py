"""Benchmark of the attribution engine's hot paths, printed as one JSON document.

1. Per-example gradient capture on a random 4-layer, 256-hidden Llama with LoRA r=8 on all seven
   sites: seconds per example of ``hooks``, ``loop`` and ``vmap``, each divided by a plain
   forward+backward of the same batch (the floor: no per-example gradients at all). ``hooks`` and
   the floor alternate within one run, and the ratio is the median over repeats of each repeat's
   ratio, so load from other processes on the host hits both sides alike.
2. DataInf scoring: milliseconds per training example per query at n = 2,000 and 20,000, one
   query at a time and eight at once.
3. Index size: bytes per example on disk for float32, float16, a countsketch projection and a
   ``down_proj``-only filter.
4. Index read throughput: every chunk read through ``GradientIndex.iter_chunks`` into float32
   blocks (the first pass also checks each file's sha256, as scoring's first read does; the
   second is served from the page cache), against ``np.copyto`` of the same bytes in memory.

Run: ``python projects/benchmarks/bench_grads.py [--quick] [--out results.json]``. Random weights
are fine here: timing and sizes do not depend on what the model knows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SITES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(layers: int, hidden: int, r: int, vocab: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=SITES, init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, lora).eval()


def make_batch(batch: int, seq: int, prompt_share: float, vocab: int):
    from gradian.data import IGNORE_INDEX
    from gradian.grads import TokenBatch

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[:, : int(seq * prompt_share)] = IGNORE_INDEX
    return TokenBatch(ids, torch.ones_like(ids), labels, [str(i) for i in range(batch)])


def timed(fn, repeats: int) -> float:
    """Fastest of ``repeats`` runs after a warm-up: the least disturbed by other load on the host."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return min(runs)


def bench_capture(args) -> dict:
    from gradian.grads import capture_per_example_grads, per_example_loss, wrap_peft_model

    gm = wrap_peft_model(build_model(args.layers, args.hidden, args.r, args.vocab))
    batch = make_batch(args.batch, args.seq, 0.2, args.vocab)
    params = [p for b in gm.blocks for p in b.parameters]

    def plain():
        logits = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        per_example_loss(logits, batch.labels).sum().backward()
        for p in params:
            p.grad = None

    out = {"model": f"llama {args.layers} layers x {args.hidden} hidden, LoRA r={args.r} on 7 sites",
           "lora_values_per_example": gm.dim, "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads()}
    plain()  # warm-up
    capture_per_example_grads(gm, batch, "hooks")
    floor, hooked = [], []
    for _ in range(args.repeats * 2 + 1):
        start = time.perf_counter()
        plain()
        floor.append(time.perf_counter() - start)
        start = time.perf_counter()
        capture_per_example_grads(gm, batch, "hooks")
        hooked.append(time.perf_counter() - start)
    base = float(np.median(floor))
    out["plain_forward_backward_s_per_example"] = base / args.batch
    out["hooks_over_plain_median_of_ratios"] = float(np.median(np.array(hooked) / np.array(floor)))
    out["hooks_over_plain_ratio_of_medians"] = float(np.median(hooked)) / base
    out["repeats"] = len(floor)
    hooks = capture_per_example_grads(gm, batch, "hooks")
    loop = capture_per_example_grads(gm, batch, "loop")
    out["hooks_vs_loop_max_abs_diff_fp32"] = max(float((hooks[k] - loop[k]).abs().max()) for k in hooks)
    for strategy in ("hooks", "loop", "vmap"):
        try:
            t = timed(lambda: capture_per_example_grads(gm, batch, strategy), args.repeats)
            out[f"{strategy}_s_per_example"] = t / args.batch
            out[f"{strategy}_over_plain"] = t / base
        except Exception as err:  # vmap is opt-in because it can fail on some forwards
            out[f"{strategy}_error"] = f"{type(err).__name__}: {err}"[:200]
    return out


def bench_datainf(args) -> dict:
    from gradian.config import EngineConfig
    from gradian.engines import InMemoryGradients, score

    rng = np.random.default_rng(0)
    out = {"values_per_example": args.score_width, "blocks": 28}
    width = args.score_width // 28
    for n in args.score_n:
        blocks = {f"b{i}": rng.standard_normal((n, width), dtype=np.float32) for i in range(28)}
        train = InMemoryGradients(blocks, chunk_size=2048)
        q1 = {b: rng.standard_normal(width) for b in blocks}
        q8 = {b: rng.standard_normal((8, width)) for b in blocks}
        config = EngineConfig(name="datainf")
        t1 = timed(lambda: score(train, q1, config), 2)
        t8 = timed(lambda: score(train, q8, config), 2)
        out[f"n={n}"] = {"ms_per_example_per_query_1": 1e3 * t1 / n,
                         "ms_per_example_per_query_8_batched": 1e3 * t8 / n / 8,
                         "seconds_1_query": t1}
        del blocks
        train = None  # frees the blocks before the next size is drawn
    return out


def bench_index_size(args) -> dict:
    from gradian.config import load_config
    from gradian.data import dataset_from_rows
    from gradian.grads import wrap_peft_model
    from gradian.index import GradientIndex

    from chat_tokenizer import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    model = build_model(args.layers, args.hidden, args.r, max(args.vocab, 64))
    rows = [{"prompt": "what is the capital of france ?", "completion": "paris " * (1 + i % 4)} for i in range(args.index_n)]
    dataset = dataset_from_rows(rows)
    variants = {
        "float32": {},
        "float16": {"grads.storage_dtype": "float16"},
        "countsketch_1024_float16": {"grads.storage_dtype": "float16", "grads.projection_dim": 1024},
        "down_proj_only_float32": {"grads.module_filter": "down_proj"},
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants.items():
            config = load_config(overrides={"cache_dir": tmp, "grads.chunk_size": 64, "grads.batch_size": 8, **overrides})
            gm = wrap_peft_model(model, config)
            index = GradientIndex.build(gm, tokenizer, dataset, config)
            data = sum(p.stat().st_size for p in (index.root / "chunks").glob("*.npy"))
            out[name] = {"bytes_per_example": data / index.n, "values_per_example": index.manifest["total_width"]}
    full = out["float32"]["bytes_per_example"]
    for v in out.values():
        v["shrink_vs_float32"] = full / v["bytes_per_example"]
    return out


def bench_index_read(args) -> dict:
    from gradian.config import load_config
    from gradian.data import dataset_from_rows
    from gradian.grads import wrap_peft_model
    from gradian.index import GradientIndex

    from chat_tokenizer import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()
    model = build_model(args.layers, args.hidden, args.r, max(args.vocab, 64))
    rows = [{"prompt": f"what is fact {i} ?", "completion": "it is " + "so " * (1 + i % 7)} for i in range(args.read_n)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(overrides={"cache_dir": tmp, "grads.chunk_size": 64, "grads.batch_size": 16})
        built = GradientIndex.build(wrap_peft_model(model, config), tokenizer, dataset_from_rows(rows), config)
        size = built.disk_bytes()

        def read(index) -> float:
            start = time.perf_counter()
            for _, chunk in index.iter_chunks():
                for view in chunk.values():
                    np.asarray(view, dtype=np.float32).copy()
            return time.perf_counter() - start

        first = read(GradientIndex.open(built.root))  # sha256 of every file, then the reads
        again = GradientIndex.open(built.root)
        again._verify_data()  # hash outside the timing: the warm read alone
        warm = min(read(again) for _ in range(3))
        src = np.concatenate([np.load(p) for p in sorted((built.root / "chunks").glob("?????.npy"))], axis=0)
        dst = np.empty_like(src)
        copy = timed(lambda: np.copyto(dst, src), 3)
        gb = src.nbytes / 1e9
        out = {"examples": built.n, "data_bytes": int(src.nbytes), "files_bytes": int(size),
               "first_read_with_sha256_GBps": gb / first, "warm_read_GBps": gb / warm, "memory_copy_GBps": gb / copy,
               "warm_read_over_memory_copy": copy / warm}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smaller sizes, for a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="Also write the JSON here")
    args = parser.parse_args()
    args.layers, args.hidden, args.r, args.vocab = 4, 256, 8, 2048
    args.batch, args.seq, args.repeats = (8, 128, 3) if not args.quick else (4, 32, 1)
    args.score_n = [2000, 20000] if not args.quick else [200, 2000]
    args.score_width = 28 * 1024
    args.index_n = 128 if not args.quick else 16
    args.read_n = 512 if not args.quick else 64
    torch.set_num_threads(1)
    results = {"capture": bench_capture(args), "datainf": bench_datainf(args), "index_size": bench_index_size(args),
               "index_read": bench_index_read(args)}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
