"""Benchmark: `gradian diagnose` over a 10,000-row chat dataset with a real fast tokenizer.

Self-contained: it writes a synthetic dataset (varied rows, a few planted duplicates and
conflicts), trains a small byte-level BPE tokenizer with a chat template, writes an HF-style run
directory, then times the full command in-process (loading, tokenizing, 41 checks, writing the
report) and each check alone. Prints rows/second. Target: under 10 s for 10,000 rows.

    python projects/benchmarks/bench_diagnose.py [--rows 10000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|' ~ m['role'] ~ '|>' ~ m['content'] ~ '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def write_dataset(path: Path, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "zu", "ve")
             for b in ("ran", "tel", "mos", "dil", "vek", "nor", "pha", "gli", "sto", "wum")]
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))
        rows.append({"messages": [{"role": "system", "content": "You answer briefly."},
                                  {"role": "user", "content": f"Item {i}: {prompt}?"},
                                  {"role": "assistant", "content": answer + "."}]})
    for i in range(0, n, 500):  # a few planted defects so the checks have work to report
        rows[i + 1] = json.loads(json.dumps(rows[i]))
        rows[i + 2]["messages"][1]["content"] = rows[i + 3]["messages"][1]["content"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return words


def write_tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(words)] * 20 + ["Item 0123456789 ? . You answer briefly"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>",
                                   additional_special_tokens=specials[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def write_run(path: Path, n_steps: int = 300) -> None:
    path.mkdir(parents=True, exist_ok=True)
    args = {"learning_rate": 2e-4, "num_train_epochs": 1, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 4, "warmup_steps": 0.03, "lr_scheduler_type": "cosine",
            "max_grad_norm": 1.0, "seed": 0, "max_length": 256, "bf16": True, "eval_strategy": "steps"}
    (path / "training_args.json").write_text(json.dumps(args))
    (path / "adapter_config.json").write_text(json.dumps({
        "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "peft_type": "LORA",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "base_model_name_or_path": "tok"}))
    history = [{"step": s, "loss": 2.0 / (1 + s / 50), "grad_norm": 0.4, "learning_rate": 2e-4 * (1 - s / n_steps),
                "epoch": s / n_steps} for s in range(1, n_steps + 1)]
    history += [{"step": s, "eval_loss": 2.2 / (1 + s / 60)} for s in range(50, n_steps + 1, 50)]
    (path / "trainer_state.json").write_text(json.dumps({"log_history": history}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args()

    from gradian.audit import all_checks, run_audit
    from gradian.cli import app
    from gradian.model_loading import load_tokenizer
    from gradian.data import load_dataset
    from gradian.runs import read_run_dir

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        words = write_dataset(root / "train.jsonl", args.rows)
        write_dataset(root / "eval.jsonl", 200, seed=1)
        write_tokenizer(root / "tok", words)
        write_run(root / "run")

        start = time.perf_counter()
        try:
            app(["diagnose", "-d", str(root / "train.jsonl"), "--eval-dataset", str(root / "eval.jsonl"),
                 "-r", str(root / "run"), "-m", str(root / "tok"), "-o", str(root / "out")],
                standalone_mode=False)
        except SystemExit:
            pass
        total = time.perf_counter() - start

        # per-stage and per-check timings, for finding the slow one
        t0 = time.perf_counter()
        dataset = load_dataset(root / "train.jsonl")
        t_load = time.perf_counter() - t0
        tokenizer = load_tokenizer(str(root / "tok"))
        run = read_run_dir(root / "run")
        t0 = time.perf_counter()
        from gradian.data import tokenize_examples

        tokenize_examples(dataset.examples, tokenizer, 256)
        t_tok = time.perf_counter() - t0
        timings = []
        for check in all_checks():
            t0 = time.perf_counter()
            run_audit(dataset=dataset, tokenizer=None if "tokenizer" not in check.needs else tokenizer,
                      run=run, eval_dataset=None, checks=[check.id])
            timings.append((time.perf_counter() - t0, check.id))

    print(f"rows: {args.rows}")
    print(f"load dataset: {t_load:.2f} s, tokenize: {t_tok:.2f} s")
    print("slowest checks (each timed alone, tokenization included where needed):")
    for seconds, check_id in sorted(timings, reverse=True)[:5]:
        print(f"  {check_id:40s} {seconds:.2f} s")
    print(f"diagnose total: {total:.2f} s  ->  {args.rows / total:,.0f} rows/second")


if __name__ == "__main__":
    main()
