"""`gradian plan`'s predictions against measurements, at three model sizes, printed as JSON.

For each shape (random-initialized Llama-style configs of about 10M, 100M and 400M parameters,
LoRA r=8 on all seven projections) a fresh child process:

1. builds the model and measures one ``hooks`` capture of a ``rows x width`` batch (half of each
   row supervised). Memory is the kernel's peak resident set size (``VmHWM``, reset through
   ``/proc/self/clear_refs`` just before the pass) minus the resident size before the model was
   built; ``work`` is the same peak minus the resident size just before the pass. glibc's mmap
   threshold is pinned at 128 KiB in the child, so a freed tensor leaves the resident set at once
   (as it leaves a CUDA caching allocator's allocated count) instead of lingering in a heap arena.
   What the kernel counts is everything: weights, activations, allocator slack, the Python objects
   of the model; nothing is subtracted but the imports.
2. builds a gradient index of a handful of tokenized rows (float32, and float16 with a 1024-wide
   countsketch) and compares the bytes of its chunk files with ``index_bytes``.

Run: ``python projects/benchmarks/bench_plan.py [--shapes 10m,100m,400m] [--out results.json]``.
``--eigh 2048,4096`` instead compares the plan's eigendecomposition time (one of side 1,024 timed,
scaled as the cube) with measured eigendecompositions of those sides.
``--child SHAPE`` is the per-shape worker (prints one JSON object). One thread, CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> (config.json values, rows, width, dtype, attention)
SHAPES = {
    "10m": (dict(vocab_size=12000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4), 4, 256, "float32", "eager"),
    "100m": (dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4), 4, 256, "float32", "eager"),
    "100m-bf16-sdpa": (dict(vocab_size=16000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4), 4, 256, "bfloat16", "sdpa"),
    "400m": (dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=8), 4, 256, "float32", "eager"),
}
INDEX_ROWS = 6


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def child(name: str) -> dict:
    """Measure one shape in this (fresh) process."""
    import torch

    torch.set_num_threads(1)
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradian.config import load_config
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import TokenBatch, capture_per_example_grads, wrap_peft_model
    from gradian.index import GradientIndex
    from gradian.plan import AdapterShape, BatchShape, CaptureSettings, DatasetShape, block_widths, estimate_memory
    from gradian.plan import index_bytes, lora_linears, read_model_shape
    from chat_tokenizer import build_chat_tokenizer

    values, rows, width, dtype, attn = SHAPES[name]
    tokenizer = build_chat_tokenizer()
    baseline = _status("VmRSS")
    config = LlamaConfig(**values)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=SITES, init_lora_weights=False, task_type="CAUSAL_LM")
    gm = wrap_peft_model(get_peft_model(model, lora).eval())
    built = _status("VmRSS")

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, values["vocab_size"], (rows, width), generator=gen)
    labels = ids.clone()
    labels[:, : width // 2] = -100
    batch = TokenBatch(ids, torch.ones_like(ids), labels, [str(i) for i in range(rows)])
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    capture_per_example_grads(gm, batch, "hooks")
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")

    shape = read_model_shape({**values, "model_type": "llama"})
    adapter = AdapterShape(8, tuple(SITES))
    linears = lora_linears(shape, adapter)
    settings = CaptureSettings(dtype=dtype, attn_implementation=attn)
    est = estimate_memory(shape, linears, BatchShape(rows, width, rows * (width - width // 2)), settings)
    out = {
        "shape": name, "parameters": shape.n_parameters, "dtype": dtype, "attention": attn, "rows": rows, "width": width,
        "capture_seconds": round(seconds, 3),
        "memory": {
            "predicted_total": est.peak, "measured_total": peak - baseline,
            "predicted_work": est.peak - est.weights - est.adapter_weights, "measured_work": peak - before,
            "predicted_weights": est.weights + est.adapter_weights, "measured_weights": built - baseline,
            "components": est.as_dict(),
        },
    }

    rows_data = [{"prompt": f"what is fact number {i} ?", "completion": "it is " + "so " * (3 + 5 * i)}
                 for i in range(INDEX_ROWS)]
    dataset = dataset_from_rows(rows_data)
    index_out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, overrides in {"float32": {}, "float16_countsketch_1024": {"grads.storage_dtype": "float16",
                                                                               "grads.projection_dim": 1024}}.items():
            cfg = load_config(overrides={"cache_dir": tmp, "grads.chunk_size": 4, "grads.batch_size": 2, **overrides})
            index = GradientIndex.build(gm, tokenizer, dataset, cfg)
            tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)
            widths = [w for _, w in block_widths(linears, "module", cfg.grads.projection_dim)]
            predicted = index_bytes(DatasetShape.from_tokenized(tokenized).n, widths, cfg.grads.storage_dtype,
                                    cfg.grads.chunk_size)
            index_out[variant] = {"predicted_bytes": predicted, "measured_bytes": index.disk_bytes(), "rows": index.n}
    out["index"] = index_out
    return out


def run_shape(name: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "core")]),
           "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", name], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"shape {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(result: dict) -> dict:
    m = result["memory"]
    summary = {
        "shape": result["shape"], "parameters": result["parameters"], "dtype": result["dtype"],
        "attention": result["attention"], "batch": f"{result['rows']} x {result['width']}",
        "memory_predicted_MiB": round(m["predicted_total"] / 2**20, 1),
        "memory_measured_MiB": round(m["measured_total"] / 2**20, 1),
        "memory_error": round(m["predicted_total"] / m["measured_total"] - 1, 4),
        "work_predicted_MiB": round(m["predicted_work"] / 2**20, 1),
        "work_measured_MiB": round(m["measured_work"] / 2**20, 1),
        "work_error": round(m["predicted_work"] / m["measured_work"] - 1, 4),
    }
    for variant, v in result["index"].items():
        summary[f"index_{variant}_predicted"] = v["predicted_bytes"]
        summary[f"index_{variant}_measured"] = v["measured_bytes"]
        summary[f"index_{variant}_error"] = round(v["predicted_bytes"] / v["measured_bytes"] - 1, 6)
    return summary


def eigh_scaling(sides: list[int]) -> list[dict[str, float]]:
    """The plan's eigendecomposition time (``calibrate_eigh`` at its timed side, scaled as the cube)
    against one measured eigendecomposition of each of ``sides``, in this process's thread settings."""
    from gradian.plan.timing import EIGH_TIMED_SIDE, calibrate_eigh, eigh_seconds

    rate = calibrate_eigh(EIGH_TIMED_SIDE)
    out = []
    for side in sides:
        measured = eigh_seconds(side, repeats=1, seed=1)
        out.append({"side": side, "predicted_s": round(rate * side**3, 3), "measured_s": round(measured, 3),
                    "predicted_over_measured": round(rate * side**3 / measured, 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="10m,100m,100m-bf16-sdpa,400m", help="Comma-separated shapes to run")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--eigh", default=None,
                        help="Instead: the plan's eigendecomposition time scaled from its timed side against "
                             "measured ones of these comma-separated sides (e.g. 2048,4096)")
    parser.add_argument("--out", type=Path, default=None, help="Also write the JSON here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    if args.eigh:
        print(json.dumps(eigh_scaling([int(s) for s in args.eigh.split(",") if s]), indent=2))
        return
    results = [run_shape(name) for name in args.shapes.split(",") if name]
    text = json.dumps({"summary": [summarize(r) for r in results], "details": results}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
