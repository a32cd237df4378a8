"""Many small fine-tunes in parallel, each measured on the query: the retrains behind ``fidelity``.

A ``RetrainTask`` keeps some rows of the training file (a random half, everything but one
cluster, or everything under another seed), fine-tunes with the reference recipe, and measures
the capability's losses on the result (``measure_losses``). Tasks run in ``workers`` spawned
processes; each fine-tune of a model this small uses one thread, so two workers use two cores.
Every task writes ``result.json`` beside its run with a fingerprint of its inputs, so an
interrupted fidelity run resumes where it stopped.

The losses, in nats per supervised token (the mean reduction the query gradient uses):

- ``query_loss``: over the query items, ``l(wanted) - l(generated)`` for a contrastive query (the
  generated answer is the reference fine-tune's), ``l(wanted)`` for a target query. This is the
  quantity the engines' scores are first-order predictions of.
- ``wanted_loss``: ``l(wanted)`` averaged over every eval item: the capability's loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["QueryItems", "RetrainTask", "default_workers", "measure_losses", "run_tasks"]


@dataclass
class QueryItems:
    """Plain data (picklable): the query items and every eval item."""

    prompts: list[list[dict[str, str]]]
    wanted: list[str]
    generated: list[str] | None
    all_prompts: list[list[dict[str, str]]]
    all_wanted: list[str]


@dataclass
class RetrainTask:
    name: str
    #: row indices of the training file to keep
    keep: list[int]
    seed: int


def measure_losses(cfg: Any, adapter_dir: str | Path, query: QueryItems) -> dict[str, float]:
    """``query_loss`` and ``wanted_loss`` (see the module docstring) of one adapter."""
    import numpy as np

    from gradian.evaluate import completion_logprobs, load_tuned_model

    model, tokenizer = load_tuned_model(cfg, adapter_dir)

    def losses(prompts: Sequence[Any], answers: Sequence[str]) -> np.ndarray:
        return -np.array([lp.mean for lp in completion_logprobs(model, tokenizer, prompts, answers, batch_size=16)])

    wanted = losses(query.prompts, query.wanted)
    query_loss = wanted - losses(query.prompts, query.generated) if query.generated is not None else wanted
    return {"query_loss": float(query_loss.mean()),
            "wanted_loss": float(losses(query.all_prompts, query.all_wanted).mean())}


def _fingerprint(task: RetrainTask, config_key: str, data_sha: str) -> str:
    payload = json.dumps({"keep": task.keep, "seed": task.seed, "config": config_key, "data": data_sha})
    return hashlib.sha256(payload.encode()).hexdigest()


def _run_one(config_path: str, overrides: dict[str, Any], data_path: str, task: RetrainTask, root: str,
             query: QueryItems, fingerprint: str, single_thread: bool) -> dict[str, Any]:
    """One retrain and its measurement (runs in a worker process)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    if single_thread:
        torch.set_num_threads(1)
    from gradian.config import load_config
    from gradian.counterfactual import write_kept_rows
    from gradian.data import load_dataset
    from gradian.train import train_lora

    out = Path(root) / task.name
    cfg = load_config(config_path, overrides={**overrides, "seed": task.seed, "train.output_dir": str(out / "run"),
                                              "train.save_checkpoints": False})
    t0 = time.time()
    kept = write_kept_rows(load_dataset(data_path), task.keep, out / "train.jsonl")
    record = train_lora(cfg, out / "run", dataset=kept, overwrite=True)
    train_seconds = time.time() - t0
    t0 = time.time()
    result = {"name": task.name, "seed": task.seed, "n_kept": len(task.keep), "fingerprint": fingerprint,
              **measure_losses(cfg, record.adapter_dir, query),
              "train_seconds": round(train_seconds, 2), "measure_seconds": round(time.time() - t0, 2)}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "train.jsonl").unlink()  # the row list is in the task; the copy of the data is not needed
    return result


def run_tasks(tasks: Sequence[RetrainTask], *, config_path: str | Path, overrides: Mapping[str, Any],
              data_path: str | Path, root: str | Path, query: QueryItems, workers: int = 1,
              log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Run (or reuse) every task; returns ``{task name: result}``."""
    from gradian.config import config_hash, load_config
    from gradian.data import load_dataset

    root = Path(root)
    config_key = config_hash(load_config(config_path, overrides=dict(overrides)))
    data_sha = load_dataset(data_path).sha256
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for task in tasks:
        fingerprint = _fingerprint(task, config_key, data_sha)
        done = root / task.name / "result.json"
        if done.is_file():
            previous = json.loads(done.read_text())
            if previous.get("fingerprint") == fingerprint:
                results[task.name] = previous
                continue
        todo.append((task, fingerprint))
    if len(results):
        log(f"reusing {len(results)} finished retrain(s) in {root}")
    args = [(str(config_path), dict(overrides), str(data_path), task, str(root), query, fp, workers > 1) for task, fp in todo]
    started = time.time()
    if workers <= 1:
        for i, a in enumerate(args, 1):
            results[a[3].name] = _run_one(*a)
            log(f"retrain {i}/{len(args)} done ({a[3].name}, {time.time() - started:.0f} s)")
    elif args:
        import multiprocessing

        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, *a): a[3].name for a in args}
            for i, future in enumerate(as_completed(futures), 1):
                results[futures[future]] = future.result()
                log(f"retrain {i}/{len(args)} done ({futures[future]}, {time.time() - started:.0f} s)")
    return {t.name: results[t.name] for t in tasks}


def default_workers() -> int:
    """Two when the machine has two cores or more: each small fine-tune uses one thread."""
    return max(1, min(2, os.cpu_count() or 1))

