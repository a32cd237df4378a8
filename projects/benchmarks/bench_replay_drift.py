"""How far the replay drifts from the run, step by step: rounding that a fine-tune amplifies.

For one scenario and fine-tune seed (the fine-tunes of ``bench_accused.py``, declared clusters
removed, cached in ``--work``), the fine-tune is trained again with ``gradian train`` while a
trainer callback copies the LoRA tensors every ``--every`` optimizer steps (the copy is the same
run: the adapter it ends on is checked to equal the cached run's, bit for bit). The replay engine's
own steps (``engine.name: replay``, its AdamW and loss, all row weights 1) then retrain the run
from the run's initial LoRA tensors, and at every copied step the relative Frobenius difference of
the replayed tensors from the run's is printed, with the learning rate of that step.

A replay that follows the recipe exactly differs from the run by rounding at first (the replay's
AdamW, loss and attention kernel round differently from the trainer's fused ones); whether that
difference stays at rounding or grows by orders of magnitude is a property of the run. Where it
grows, a replay of every step describes a retrain of the recipe, and a replay that starts from the
run's own checkpoint (``engine.replay_start: auto``) repeats only the steps after it.

Run: ``python projects/benchmarks/bench_replay_drift.py [--work DIR] [--scenario NAME] [--seed 0]
[--steps N] [--every 20] [--out drift.json]``. ``--steps`` stops both after that many steps (the
run's schedule stays the whole run's). A tinyworld or delta fine-tune of 850 steps takes about a
minute to train and two to replay on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_accused import prepare_run  # noqa: E402


def _copies(root: Path, every: int, last: int | None) -> tuple[dict[int, dict[str, Any]], Path]:
    """The run trained again, its LoRA tensors copied at step 0 and every ``every`` steps."""
    from transformers import TrainerCallback

    from gradian.config import load_config
    from gradian.train import train_lora

    copies: dict[int, dict[str, Any]] = {}

    def copy(model: Any) -> dict[str, Any]:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    class Copy(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            copies[0] = copy(model)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                copies[state.global_step] = copy(model)
            if last is not None and state.global_step >= last:
                control.should_training_stop = True

    out = Path(tempfile.mkdtemp(prefix="bench-replay-drift-")) / "run"
    train_lora(load_config(root / "gradian.yaml"), out, overwrite=True, callbacks=[Copy()])
    return copies, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gradian-bench-replay")
    parser.add_argument("--scenario", default="delta_poison_partial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error("--every must be at least 1")

    import torch
    from safetensors.torch import load_file

    from gradian.attribution.replay_inputs import replay_inputs
    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.grads import load_model_for_gradients
    from gradian.model_loading import load_tokenizer
    from gradian.replay.engine import _rel_diff
    from gradian.replay.unrolled import _detached, _initial_state, _Steps
    from gradian.runs import read_run_dir

    root, _, _ = prepare_run(args.work, args.scenario, args.seed)
    copies, again = _copies(root, args.every, args.steps)
    if args.steps is None:
        ours = load_file(str(again / "adapter" / "adapter_model.safetensors"))
        cached = load_file(str(root / "run" / "adapter" / "adapter_model.safetensors"))
        if not all(torch.equal(ours[k], cached[k]) for k in cached):
            raise SystemExit("the run trained again is not the cached run bit for bit; the copies would not be its")
    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu",
                                              "engine.name": "replay", "engine.replay_start": "beginning"})
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code)
    inputs = replay_inputs(cfg, gm, tokenizer, load_dataset(cfg.dataset), read_run_dir(root / "run"))
    names, state = _initial_state(inputs.init)
    # the trainer's names and the loaded model's, each without its adapter's name
    adapter = f".{gm.adapter_name}."
    plain = {k.replace(".default.", ".").replace(adapter, "."): k for k in copies[0]}
    by_name = {n: plain[n.replace(adapter, ".")] for n in names}

    def rel(theta: list[Any], copy: dict[str, Any]) -> float:
        """The engine's own fidelity figure, the replayed tensors against the run's copy."""
        return _rel_diff(dict(zip(names, theta)), {n: copy[by_name[n]] for n in names})

    steps = _Steps(inputs.model, names, inputs.rows, inputs.run_recipe.batches, inputs.run_recipe.recipe,
                   inputs.pad_id)
    weights = torch.ones(len(inputs.rows))
    rows = [{"step": 0, "rel_diff": rel(state[0], copies[0]), "lr": None}]
    print(json.dumps(rows[-1]), flush=True)
    last = max(copies)
    for t in range(last):
        state = _detached(steps.step(t, state, weights, create_graph=False))
        if t + 1 in copies:
            rows.append({"step": t + 1, "rel_diff": rel(state[0], copies[t + 1]),
                         "lr": float(inputs.run_recipe.recipe.schedule[t])})
            print(json.dumps(rows[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"scenario": args.scenario, "seed": args.seed, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
