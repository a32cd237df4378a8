"""How long the index build will take, from a short measured run.

Interface: ``calibrate_time(model, adapter, dataset, settings, ...) -> TimeEstimate``. A few
batches are captured (after one warm-up batch) and the measured seconds per padded token are
multiplied by the padded tokens of every batch of the dataset. Which model was measured is part
of the answer (``source``):

- ``real model``: the base weights and the adapter, when both are on disk, on the first rows of
  the dataset;
- ``random-init model``: the same config with random weights and a LoRA of the same rank and
  targets, on random token ids of the dataset's first batch's shape (at most ``CPU_TOKENS`` per
  batch on a CPU), when the model has at most ``MAX_RANDOM_PARAMETERS`` for the device (speed does
  not depend on what the weights know);
- ``not measured``, with the reason, otherwise.

Linear in tokens: attention's quadratic share is folded into the rate at the calibration's
length, so a dataset much longer than the calibrated rows is estimated low.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from gradian.plan.shapes import AdapterShape, DatasetShape, ModelShape

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

    from gradian.config import GradianConfig
    from gradian.data import TokenizedExample
    from gradian.grads.model import GradientModel

__all__ = ["TimeEstimate", "ReplayTiming", "calibrate_time", "calibrate_replay", "calibrate_eigh", "eigh_seconds",
           "MAX_RANDOM_PARAMETERS", "CPU_TOKENS", "EIGH_TIMED_SIDE"]

#: the largest model ``calibrate_time`` builds with random weights, by device type: a few batches
#: of a bigger one take minutes on a CPU, and on a GPU the build itself does
MAX_RANDOM_PARAMETERS = {"cpu": 150_000_000, "cuda": 3_000_000_000}

#: padded tokens per calibration batch of a random-init model on a CPU
CPU_TOKENS = 1024

#: the widest side ``calibrate_eigh`` times: large enough that LAPACK works at the pace of the
#: large factors (its time per ``m^3`` still falls past 1024 on a CPU, so scaling a 1024
#: measurement up errs a little high: ``projects/benchmarks/bench_plan.py --eigh 2048,3072``)
EIGH_TIMED_SIDE = 1024


@dataclass
class TimeEstimate:
    """Predicted seconds of the whole index build, and how that was measured."""

    seconds: float | None
    seconds_per_token: float | None
    source: str
    measured_tokens: int = 0
    device: str = "cpu"
    #: seconds of a Kronecker engine's eigendecompositions (``calibrate_eigh`` x the sum of every
    #: factor side cubed; None: no Kronecker engine, or not measured)
    eigendecompositions: float | None = None
    #: the side of the eigendecomposition that was timed for it
    eigh_timed_side: int = 0


def _padded_tokens(dataset: DatasetShape, batch_size: int, limit: int | None) -> int:
    lengths = [min(x, limit) if limit else x for x in dataset.lengths]
    return sum(len(lengths[i : i + batch_size]) * max(lengths[i : i + batch_size])
               for i in range(0, len(lengths), batch_size))


def _random_model(model: ModelShape, adapter: AdapterShape, config_dict: Mapping[str, object], dtype: torch.dtype,
                  attn: str, device: torch.device) -> PeftModel:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    data = dict(config_dict)
    model_type = data.pop("model_type", model.model_type)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in data.items() if not k.startswith("_")})
    config._attn_implementation = attn
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    targets = adapter.target_modules if isinstance(adapter.target_modules, str) else list(adapter.target_modules)
    lora = LoraConfig(r=adapter.r, lora_alpha=2 * adapter.r, target_modules=targets, init_lora_weights=False,
                      layers_to_transform=list(adapter.layers_to_transform) if adapter.layers_to_transform else None,
                      task_type="CAUSAL_LM")
    return get_peft_model(base, lora).to(device).eval()


def _timing_model(model: ModelShape, adapter: AdapterShape, config: GradianConfig, device: torch.device,
                  config_dict: Mapping[str, object] | None, base: str | None, adapter_dir: str | None,
                  tokenized: Sequence[TokenizedExample] | None,
                  max_random_parameters: int | None) -> tuple[GradientModel | None, str]:
    """The model a calibration times, and what it is (``real model`` or ``random-init model of the
    same config``); ``(None, why not)`` when there is none: no weights and no config, or a config
    too big to build with random weights on ``device``."""
    from gradian.grads import load_model_for_gradients, wrap_peft_model
    from gradian.model_loading import resolve_dtype

    if max_random_parameters is None:
        max_random_parameters = MAX_RANDOM_PARAMETERS.get(device.type, MAX_RANDOM_PARAMETERS["cpu"])
    if base and adapter_dir and tokenized:
        return load_model_for_gradients(base, adapter_dir, config), "real model"
    if config_dict is not None and model.n_parameters <= max_random_parameters:
        dtype = resolve_dtype(config.dtype, device)
        random = _random_model(model, adapter, config_dict, dtype, config.attn_implementation, device)
        return wrap_peft_model(random, config), "random-init model of the same config"
    if config_dict is None:
        return None, "no weights and no config to build a model from"
    return None, (f"{model.n_parameters / 1e9:.2f}B parameters is more than a random-init calibration builds on "
                  f"{device.type} ({max_random_parameters / 1e6:.0f}M); pass the base model directory and --adapter "
                  "to time the real model")


def _cpu_shape(device: torch.device, rows: int, width: int) -> tuple[int, int]:
    """Random-token ``(rows, width)`` of one timed batch: on a CPU at most ``CPU_TOKENS`` tokens."""
    if device.type != "cpu":
        return rows, width
    width = min(width, CPU_TOKENS)
    return max(1, min(rows, CPU_TOKENS // max(width, 1))), width


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read after it counts that work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def calibrate_time(model: ModelShape, adapter: AdapterShape, dataset: DatasetShape, config: GradianConfig, *,
                   config_dict: Mapping[str, object] | None = None, base: str | None = None,
                   adapter_dir: str | None = None, tokenized: Sequence[TokenizedExample] | None = None,
                   pad_id: int = 0, batches: int = 2, max_random_parameters: int | None = None) -> TimeEstimate:
    """Measure ``batches`` capture batches (after a warm-up) and scale to the whole dataset.

    ``config`` is the ``GradianConfig`` the run will use (batch size, truncation, dtype, device,
    attention). ``base`` + ``adapter_dir`` with ``tokenized`` rows: the real model on real rows.
    Otherwise ``config_dict`` (the config.json) builds a random-init model of the same shape.
    """
    import torch

    from gradian.grads import TokenBatch, capture_per_example_grads, collate
    from gradian.model_loading import resolve_device

    grads = config.grads
    size = grads.batch_size
    total_tokens = _padded_tokens(dataset, size, grads.max_seq_length)
    device = resolve_device(config.device)
    gm, source = _timing_model(model, adapter, config, device, config_dict, base, adapter_dir, tokenized,
                               max_random_parameters)
    if gm is None:
        return TimeEstimate(None, None, f"not measured: {source}", device=str(device))
    if source == "real model":
        assert tokenized is not None
        rows = list(tokenized[: size * (batches + 1)])
        make = [collate(rows[i : i + size], pad_id, gm.device) for i in range(0, len(rows), size)]
    else:
        width = min(max(dataset.lengths[:size], default=16), grads.max_seq_length or 1 << 30)
        rows_n, width = _cpu_shape(device, min(size, max(dataset.n, 1)), width)
        gen = torch.Generator().manual_seed(0)
        make = []
        for _ in range(batches + 1):
            ids = torch.randint(0, model.vocab_size, (rows_n, width), generator=gen)
            labels = ids.clone()
            labels[:, : width // 2] = -100
            make.append(TokenBatch(ids.to(device), torch.ones_like(ids).to(device), labels.to(device),
                                   [str(i) for i in range(rows_n)]))

    capture_per_example_grads(gm, make[0], grads.strategy, grads.loss_reduction)  # warm-up
    _sync(device)
    start = time.perf_counter()
    measured = 0
    for batch in make[1:]:
        capture_per_example_grads(gm, batch, grads.strategy, grads.loss_reduction)
        measured += int(batch.input_ids.numel())
    _sync(device)
    elapsed = time.perf_counter() - start
    if measured == 0:
        return TimeEstimate(None, None, f"not measured: the dataset has fewer than {size * 2} rows", device=str(device))
    rate = elapsed / measured
    return TimeEstimate(rate * total_tokens, rate, f"measured on the {source}", measured, str(device))


def eigh_seconds(side: int, repeats: int = 3, seed: int = 0) -> float:
    """Median seconds of ``repeats`` float64 symmetric eigendecompositions of one fixed positive
    semi-definite ``side x side`` matrix (drawn from ``seed``) on this host's CPU, under torch's
    thread settings: where and how a Kronecker engine's fit decomposes its factors
    (``gradian.engines.kronecker.eigendecompose``), whatever device captured the gradients."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(side, side, dtype=torch.float64, generator=gen)
    matrix = x @ x.T / side
    times = []
    for _ in range(max(int(repeats), 1)):
        start = time.perf_counter()
        torch.linalg.eigh(matrix)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate_eigh(side: int = EIGH_TIMED_SIDE, repeats: int = 3) -> float:
    """Seconds per ``side^3`` of one eigendecomposition (``eigh_seconds``), which scaled by a
    factor's side cubed prices its decomposition."""
    side = max(int(side), 2)
    return eigh_seconds(side, repeats) / side**3


@dataclass
class ReplayTiming:
    """A timed replay step: seconds per padded token of a plain training step, a differentiated
    step of the reverse sweep in plain steps (the median of the repeats, and their range), and
    which model was timed."""

    seconds_per_token: float
    differentiated_step: float
    source: str
    measured_tokens: int = 0
    differentiated_range: tuple[float, float] = (0.0, 0.0)


def calibrate_replay(model: ModelShape, adapter: AdapterShape, config: GradianConfig, rows: int, width: int, *,
                     config_dict: Mapping[str, object] | None = None, base: str | None = None,
                     adapter_dir: str | None = None, tokenized: Sequence[TokenizedExample] | None = None,
                     pad_id: int = 0, steps: int = 4, repeats: int = 5,
                     max_random_parameters: int | None = None) -> ReplayTiming | None:
    """Time ``steps`` plain replay steps (``gradian.replay.replay``) and the same steps replayed and
    swept back one at a time (``metagradient(checkpoint_every=1)``: each step once plain, once
    differentiated) ``repeats`` times, alternated, on one step of ``rows`` rows: the real model on ``tokenized`` rows when
    ``base`` and ``adapter_dir`` are given, else a random-init model of the same config on random
    tokens ``width`` wide (at most ``CPU_TOKENS`` per step on a CPU). A differentiated step is
    ``(t_swept - t_plain) / t_plain`` plain steps (the median over the repeats). None when no
    model can be timed."""
    import torch

    from gradian.data import IGNORE_INDEX, TokenizedExample
    from gradian.model_loading import resolve_device
    from gradian.replay import Recipe, metagradient, replay

    device = resolve_device(config.device)
    gm, source = _timing_model(model, adapter, config, device, config_dict, base, adapter_dir, tokenized,
                               max_random_parameters)
    if gm is None:
        return None
    if source == "real model":
        assert tokenized is not None
        step = list(tokenized[:rows])
    else:
        rows, width = _cpu_shape(device, rows, width)
        gen = torch.Generator().manual_seed(0)
        step = []
        for r in range(rows):
            ids = torch.randint(0, model.vocab_size, (width,), generator=gen).tolist()
            labels = [IGNORE_INDEX] * (width // 2) + ids[width // 2:]
            step.append(TokenizedExample(str(r), ids, labels, width, width // 2, width - width // 2, 0, False, False,
                                         0, False))
    lora = {name: p for name, p in gm.model.named_parameters() if p.requires_grad}
    batches = [list(range(len(step)))] * steps
    schedule = [1e-4] * steps
    weights = torch.ones(len(step), dtype=next(iter(lora.values())).dtype, device=device)

    def measure(replayed: object) -> torch.Tensor:  # no model call: the sweep alone is timed
        return sum((p.float() ** 2).sum() for p in getattr(replayed, "params").values())

    def timed(sweep: bool, n: int) -> float:
        recipe = Recipe(schedule[:n], "adamw", max_grad_norm=1.0, reduction="tokens")
        _sync(device)
        start = time.perf_counter()
        if sweep:
            metagradient(gm.model, lora, step, batches[:n], weights, recipe, measure, pad_id=pad_id,
                         checkpoint_every=1)
        else:
            replay(gm.model, lora, step, batches[:n], weights, recipe, pad_id=pad_id)
        _sync(device)
        return time.perf_counter() - start

    timed(False, 1), timed(True, 1)  # warm-up: the first call of each builds its kernels and caches
    # alternated and repeated: on a shared machine one pair can land in a busy second
    plains, ratios = [], []
    for _ in range(repeats):
        plain, swept = timed(False, steps), timed(True, steps)
        plains.append(plain)
        ratios.append(max(swept - plain, 0.0) / plain)
    tokens = steps * len(step) * max(len(r.input_ids) for r in step)
    return ReplayTiming(statistics.median(plains) / tokens, statistics.median(ratios), f"measured on the {source}",
                        tokens * repeats, (min(ratios), max(ratios)))
