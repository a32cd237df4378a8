"""``gradian plan``: predicted memory, disk and time of the training gradients (the index, or a
stream of them) and of the engine's curvature, before anything is built."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import typer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import TokenizedExample
    from gradian.plan import AdapterShape, DatasetShape, ModelShape
    from gradian.plan.planner import Plan, PlanSettings
    from gradian.plan.replay import ReplayCost

__all__ = ["register"]


def plan_command(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    base_model: Optional[str] = typer.Option(None, "--base-model", "-m", help="Base model directory (its config.json is read, no weights loaded)"),
    model_config: Optional[str] = typer.Option(None, "--model-config", help="A config.json, or a preset name (qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b, ...), instead of --base-model"),
    adapter: Optional[str] = typer.Option(None, "--adapter", "-a", help="LoRA adapter directory (rank and target modules from adapter_config.json)"),
    r: Optional[int] = typer.Option(None, "--r", help="LoRA rank, when there is no adapter directory"),
    target_modules: Optional[str] = typer.Option(None, "--target-modules", help="Comma-separated LoRA targets (q_proj,v_proj) or all-linear, when there is no adapter directory"),
    dataset: Optional[str] = typer.Option(None, "--dataset", "-d", help="Training dataset, tokenized to get its lengths"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer directory when it is not the base model's"),
    n_examples: Optional[int] = typer.Option(None, "--n-examples", help="Without a dataset: this many examples of --tokens tokens"),
    tokens: int = typer.Option(1024, "--tokens", help="Without a dataset: tokens per example (half of them supervised)"),
    device: Optional[str] = typer.Option(None, "--device", help="Plan for cpu or cuda (default: the config's device, auto meaning CUDA when visible)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Model dtype (overrides the config; auto is bfloat16 on CUDA, float32 on CPU)"),
    quantization: Optional[str] = typer.Option(None, "--quantization", help="Base weights at attribution: none, 4bit or 8bit (bitsandbytes; overrides the config)"),
    attn: Optional[str] = typer.Option(None, "--attn-implementation", help="eager, sdpa or flash_attention_2 (overrides the config)"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="grads.batch_size to plan for"),
    max_seq_length: Optional[int] = typer.Option(None, "--max-seq-length", help="grads.max_seq_length to plan for"),
    projection_dim: Optional[int] = typer.Option(None, "--projection-dim", help="grads.projection_dim to plan for"),
    projection_kind: Optional[str] = typer.Option(None, "--projection-kind", help="grads.projection_kind to plan for: countsketch, rademacher, or kronecker (each LoRA matrix's sides projected apart; ekfac and kfac accept it)"),
    storage_dtype: Optional[str] = typer.Option(None, "--storage-dtype", help="grads.storage_dtype to plan for (float32 or float16)"),
    module_filter: Optional[str] = typer.Option(None, "--module-filter", help="grads.module_filter to plan for"),
    engine: Optional[str] = typer.Option(None, "--engine", help="engine.name to plan for (its passes and curvature; default: the config's)"),
    store: Optional[str] = typer.Option(None, "--store", help="engine.store to plan for: auto, index or stream (default: the config's)"),
    factor_rows: Optional[int] = typer.Option(None, "--factor-rows", help="engine.factor_rows to plan for: the Kronecker factors summed over about this many rows (default: the config's; every row)"),
    correction_rows: Optional[int] = typer.Option(None, "--correction-rows", help="engine.correction_rows to plan for: ekfac's eigenvalue correction averaged over about this many rows (default: the config's; every row)"),
    cross_check: str = typer.Option("auto", "--cross-check", help="The cross-check gradian attribute will run beside the engine (as its --cross-check: auto, none or an engine name): its passes, and whether a stream's eigenvalue correction keeps every row's squared norm for it"),
    run: Optional[str] = typer.Option(None, "--run", "-r", help="The training run (an output directory or runs:/<mlflow run id>): engine.name replay prices the replay of its recipe"),
    mlflow_run: Optional[str] = typer.Option(None, "--mlflow-run", help="MLflow run id of the training run (same as --run runs:/<id>)"),
    memory: Optional[str] = typer.Option(None, "--memory", help="Memory per device, e.g. 24GiB or 80GB: propose settings that fit"),
    host_memory: Optional[str] = typer.Option(None, "--host-memory", help="Host memory of a GPU run (chunk buffers, a Kronecker fit), e.g. 64GiB (default: --memory; on a CPU run --memory holds everything)"),
    disk: Optional[str] = typer.Option(None, "--disk", help="Disk for the index and the fitted engine state, e.g. 100GB: propose settings that fit"),
    fail_if_over: bool = typer.Option(False, "--fail-if-over", help="Exit 1 when the planned run does not fit --memory or --disk"),
    no_calibrate: bool = typer.Option(False, "--no-calibrate", help="Skip the short measured run behind the time estimate"),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
) -> None:
    """Predict memory, disk and time of the training gradients under both stores (index, stream) and of the engine's curvature; propose settings for budgets."""
    import dataclasses

    from gradian.cli.output import print_json, print_line, print_table
    from gradian.config import load_config
    from gradian.errors import ConfigError
    from gradian.plan import DatasetShape, adapter_shape, read_model_shape
    from gradian.plan.planner import Budgets, PlanSettings, make_plan
    from gradian.sizes import format_size, parse_size

    from gradian.engines.registry import available_engines
    from gradian.plan.planner import STORES

    if store is not None and store not in STORES:
        raise ConfigError(f"--store '{store}' is not one of {', '.join(STORES)}")
    from gradian.config.schema import CHOICES

    kinds = CHOICES["grads.projection_kind"]
    if projection_kind is not None and projection_kind not in kinds:
        raise ConfigError(f"--projection-kind '{projection_kind}' is not one of {', '.join(kinds)}")
    if engine is not None and engine not in available_engines():
        raise ConfigError(f"--engine '{engine}' is not a known engine; choose one of {', '.join(available_engines())}")
    from gradian.cli.run_flags import run_reference

    cfg = load_config(config, {
        "run": run_reference(run, mlflow_run),
        "base_model": base_model, "adapter_path": adapter, "dataset": dataset, "dtype": dtype,
        "quantization": quantization,
        "attn_implementation": attn, "grads.batch_size": batch_size, "grads.max_seq_length": max_seq_length,
        "grads.projection_dim": projection_dim, "grads.projection_kind": projection_kind,
        "grads.storage_dtype": storage_dtype,
        "grads.module_filter": module_filter, "engine.name": engine, "engine.store": store,
        "engine.factor_rows": factor_rows,
        "engine.correction_rows": correction_rows,
    })
    budgets = Budgets(parse_size(memory, "--memory") if memory else None, parse_size(disk, "--disk") if disk else None,
                      parse_size(host_memory, "--host-memory") if host_memory else None)
    source = model_config or cfg.base_model
    if not source:
        raise ConfigError("no model to plan for: pass --base-model DIR, --model-config config.json or a preset name")
    if not model_config and not Path(source).is_dir():
        raise ConfigError(f"--base-model {source} is not a local directory; pass its config.json with --model-config")
    model = read_model_shape(source)
    lora = adapter_shape(cfg.adapter_path if r is None or target_modules is None else None, r, target_modules)
    device = _device(device or cfg.device)
    from gradian.cli.run_flags import check_cross_check

    settings = dataclasses.replace(PlanSettings.from_config(cfg, device), cross_check=check_cross_check(cross_check))
    tokenized, pad_id, tok = None, 0, None
    if cfg.dataset:
        from gradian.data import load_dataset, tokenize_examples
        from gradian.model_loading import load_tokenizer

        tok_source = tokenizer or cfg.tokenizer or (cfg.base_model if cfg.base_model and Path(cfg.base_model).is_dir() else None)
        if not tok_source:
            raise ConfigError("--dataset needs a tokenizer: pass --tokenizer DIR or --base-model DIR")
        tok = load_tokenizer(tok_source, cfg.trust_remote_code, flag="--tokenizer" if tokenizer else "--base-model")
        tokenized = tokenize_examples(load_dataset(cfg.dataset).examples, tok, cfg.grads.max_seq_length)
        pad_id = tok.pad_token_id or 0
        shape = DatasetShape.from_tokenized(tokenized, str(cfg.dataset))
    elif n_examples is not None:
        if n_examples < 1:
            raise ConfigError(f"--n-examples is {n_examples}; it must be a positive number of training rows")
        if tokens < 1:
            raise ConfigError(f"--tokens is {tokens}; it must be a positive number of tokens per row")
        from gradian.sizes import check_fits_memory

        # the plan keeps two lengths per row (Python list slots of 8 bytes, plus a copy when truncated)
        check_fits_memory(32 * n_examples, f"--n-examples {n_examples:,} needs",
                          "plan for fewer rows: the figures scale linearly, so plan a tenth and multiply")
        shape = DatasetShape.uniform(n_examples, tokens)
    else:
        raise ConfigError("no dataset to plan for: pass --dataset FILE, or --n-examples N (with --tokens T)")
    replay = None
    if settings.needs_replay:
        replay = _replay_cost(cfg, model, lora, settings, shape, tok)
    plan = make_plan(model, lora, shape, settings, budgets, replay=replay)

    estimate = None
    if not no_calibrate:
        from gradian.plan.timing import TimeEstimate, calibrate_time

        if device == "cuda" and _device("auto") != "cuda":
            estimate = TimeEstimate(None, None, "not measured: planning for cuda on a host with no visible CUDA device",
                                    device="cpu")
        else:
            has_weights = bool(cfg.base_model and cfg.adapter_path and Path(cfg.base_model).is_dir()
                               and any(Path(cfg.base_model).glob("*.safetensors")))
            estimate = calibrate_time(model, lora, shape, dataclasses.replace(cfg, device=device),
                                      config_dict=_config_dict(source),
                                      base=cfg.base_model if has_weights else None,
                                      adapter_dir=cfg.adapter_path if has_weights else None,
                                      tokenized=tokenized if has_weights else None, pad_id=pad_id)

    curvature = plan.priced.curvature
    if estimate is not None and curvature.eigh_cubes:  # on the CPU, whatever the capture's device
        from gradian.plan.timing import EIGH_TIMED_SIDE, calibrate_eigh

        side = min(curvature.eigh_widest, EIGH_TIMED_SIDE)
        estimate = dataclasses.replace(estimate, eigendecompositions=calibrate_eigh(side) * curvature.eigh_cubes,
                                       eigh_timed_side=side)
    if plan.replay is not None and estimate is not None and estimate.seconds_per_token is not None:
        plan.replay = _timed_replay(plan.replay, cfg, model, lora, device, source, tokenized, pad_id)
    if as_json:
        data = plan.to_json()
        data["time"] = dataclasses.asdict(estimate) if estimate else None
        print_json(data)
    else:
        _print_plan(plan, estimate, print_line, print_table, format_size)
    if not plan.fits:
        # on stderr under --json, so stdout stays one JSON document
        print_line(_over_budget_line(plan, format_size), "yellow", err=as_json)
        if fail_if_over:
            raise typer.Exit(1)


def _replay_cost(cfg: GradianConfig, model: ModelShape, lora: AdapterShape, settings: PlanSettings,
                 shape: DatasetShape, tok: PreTrainedTokenizerBase | None) -> ReplayCost:
    """The replay of the run ``cfg.run`` names, priced over the rows it trained on: the dataset
    tokenized at the run's ``max_seq_length`` (else ``grads.max_seq_length``, as the replay does),
    those with a supervised token; without a dataset, the planned lengths cut at that limit."""
    from gradian.cli.run_flags import read_run
    from gradian.plan.replay import replay_cost
    from gradian.replay.recipe import recipe_from_run, replay_max_seq_length, run_trainer_config, trained_positions

    record = read_run(cfg) if cfg.run else None
    config = run_trainer_config(record.config if record is not None else None)
    limit = replay_max_seq_length(config, cfg.grads.max_seq_length)
    if tok is not None and cfg.dataset:
        from gradian.data import load_dataset, tokenize_examples

        rows = tokenize_examples(load_dataset(cfg.dataset).examples, tok, limit)
        lengths, supervised = [len(r.input_ids) for r in rows], [r.n_supervised for r in rows]
    else:
        lengths = [min(x, limit) if limit else x for x in shape.lengths]
        supervised = [min(x, limit) if limit else x for x in shape.supervised]
    kept = trained_positions(supervised, limit)
    run_recipe = recipe_from_run(config, len(kept))
    start, folder = 0, ""
    if cfg.engine.replay_start == "auto" and record is not None:
        from gradian.replay.engine import window_start
        from gradian.replay.trainer_checkpoint import planned_start

        planned = planned_start(record.checkpoints, window_start(run_recipe, cfg.engine.replay_horizon))
        if planned is not None:
            start, folder = planned[0], str(planned[1])
    return replay_cost(run_recipe, model, lora, [lengths[j] for j in kept], [supervised[j] for j in kept],
                       settings.capture, cfg.engine.replay_horizon,
                       checkpoint_every=cfg.engine.replay_checkpoint_every, start_step=start, start_checkpoint=folder)


def _timed_replay(cost: ReplayCost, cfg: GradianConfig, model: ModelShape, lora: AdapterShape, device: str,
                  source: str, tokenized: Sequence[TokenizedExample] | None, pad_id: int) -> ReplayCost:
    """``cost`` with a timed plain step and differentiated step (``calibrate_replay``), on one step
    as wide as the run's widest."""
    import dataclasses

    from gradian.plan.timing import calibrate_replay

    has_weights = bool(cfg.base_model and cfg.adapter_path and Path(cfg.base_model).is_dir()
                       and any(Path(cfg.base_model).glob("*.safetensors")) and tokenized)
    widest = cost.widest_step
    timed = calibrate_replay(model, lora, dataclasses.replace(cfg, device=device), widest.rows, widest.width,
                             config_dict=_config_dict(source), base=cfg.base_model if has_weights else None,
                             adapter_dir=cfg.adapter_path if has_weights else None,
                             tokenized=tokenized if has_weights else None, pad_id=pad_id)
    if timed is None:
        return cost
    return dataclasses.replace(cost, seconds_per_token=timed.seconds_per_token,
                               differentiated_step=timed.differentiated_step,
                               differentiated_source=(f"{timed.source}, {timed.measured_tokens} tokens, range "
                                                      f"{timed.differentiated_range[0]:.2f} to "
                                                      f"{timed.differentiated_range[1]:.2f}"))


def _device(name: str) -> str:
    if name == "auto":
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cpu"
    return "cuda" if name.startswith("cuda") else name


def _config_dict(source: str) -> dict | None:
    import json

    from gradian.plan.shapes import PRESET_DIR

    path = Path(source)
    if not path.exists() and (PRESET_DIR / f"{source}.json").is_file():
        path = PRESET_DIR / f"{source}.json"
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


# estimate: a TimeEstimate or None; its seconds_per_token is set whenever its seconds is, which its type does not say
def _print_plan(plan: Plan, estimate: Any, print_line: Callable[[str], None],
                print_table: Callable[[str, Sequence[str], Iterable[Sequence[object]]], None],
                fmt: Callable[[float], str]) -> None:
    p = plan.priced
    m, s, mem, curv = plan.model, plan.settings, p.memory, p.curvature
    cpu = s.device == "cpu"
    targets = plan.adapter.target_modules if isinstance(plan.adapter.target_modules, str) else ",".join(plan.adapter.target_modules)
    print_line(f"model: {m.name or m.model_type} ({m.n_parameters / 1e9:.2f}B parameters, {m.model_type}), "
               f"{s.capture.dtype} on {s.device}"
               + (f" (base quantized {s.quantization})" if s.quantization != "none" else "")
               + f", {s.capture.attn_implementation} attention")
    print_line(f"adapter: LoRA r={plan.adapter.r} on {targets}; {plan.n_blocks} blocks, "
               f"{plan.values_per_example:,} values per example"
               + (f", stored {plan.stored_per_example:,} ({s.projection_kind} projection {s.projection_dim})"
                  if s.projection_dim else ""))
    print_line(f"dataset: {plan.n_examples:,} examples, {plan.total_tokens:,} tokens, longest {plan.max_tokens}")
    w = p.worst
    rows = [
        ("weights", fmt(mem.weights), f"{m.n_parameters:,} parameters x {s.capture.model_bytes} B"
         if s.quantization == "none" else f"{m.n_parameters:,} parameters, the layers' projections "
         f"{s.quantization} (bitsandbytes), the rest x {s.capture.model_bytes} B"),
        ("adapter", fmt(mem.adapter_weights), "LoRA A and B"),
        ("activations", fmt(mem.activations), "kept by autograd for the backward"),
        ("hook inputs", fmt(mem.hook_inputs), "LoRA inputs the capture keeps"),
        ("logits", fmt(mem.logits), f"{w.tokens} tokens x {m.vocab_size} vocab"),
        ("loss backward", fmt(mem.loss_backward), "logits' gradient and one upcast chunk"),
        ("per-example grads", fmt(mem.per_example_grads), f"{w.rows} rows x {plan.values_per_example:,} float32"),
        ("capture peak", fmt(mem.peak), f"batch of {w.rows} x {w.width} tokens ({w.supervised} supervised)"),
    ]
    if mem.projection_cache:
        rows.insert(7, ("projection", fmt(mem.projection_cache), "rademacher matrices"))
    if curv.device:
        rows.append(("Kronecker factors", fmt(curv.device), f"{s.engine}'s float64 sums of x x^T and g g^T, on the "
                                                             "device from the first pass on"))
    if cpu:
        rows.append(("device total", fmt(p.device_peak), "capture peak" + (" + factors" if curv.device else "")
                     + " + host memory below"))
    elif curv.device:
        rows.append(("device total", fmt(p.device_peak), "capture peak + factors"))
    print_table(f"memory per device (batch_size {s.batch_size})", ("component", "bytes", "what"), rows)
    chosen = {"index": " (planned)" if p.store == "index" else "", "stream": " (planned)" if p.store == "stream" else ""}
    host_rows = [
        ("index writer", fmt(p.index.host_buffer), f"chunks of {s.chunk_size} rows{chosen['index']}"),
        ("stream chunk", fmt(p.stream.host_buffer), f"one chunk of {s.chunk_size} rows in flight{chosen['stream']}"),
    ]
    if curv.host:
        host_rows.append((f"{s.engine} fit", fmt(curv.host), "Kronecker factors and their eigenbases"))
    host_rows.append(("host total", fmt(p.host_peak), f"{p.store} buffer" + (f" + {s.engine} fit" if curv.host else "")))
    print_table("host memory" + (" (the same memory on a CPU run)" if cpu else ""), ("component", "bytes", "what"),
                host_rows)
    seconds = estimate.seconds if estimate is not None else None

    def about(passes: float) -> str:
        return f", about {_duration(passes * seconds)}" if seconds is not None else ""

    passes, index = p.passes, p.index
    print_line(f"stores ({s.engine}, one fit and one scoring: {passes.what()}):")
    print_line(f"  index: {fmt(index.disk_bytes)} on disk; {index.captures} forward+backward "
               f"pass{'es' if index.captures > 1 else ''}{passes.share_note('index')}{about(index.capture_floors)}, "
               f"then {index.reads} read{'s' if index.reads > 1 else ''} of the index")
    print_line(f"  stream: nothing on disk; {p.stream.passes} forward+backward "
               f"pass{'es' if p.stream.passes > 1 else ''}{passes.share_note('stream')}{about(p.stream.floors)}")
    if curv.state_bytes:
        print_line(f"  {s.engine} state: {fmt(curv.state_bytes)} on disk under either store (eigenbases and eigenvalues)")
    cross = p.cross_check
    shared = "its scores come from the engine's scoring pass"
    if cross is not None and cross.gradients + cross.model == 0:
        print_line(f"  gradian attribute's cross-check {cross.engine} adds no pass: {shared}")
    elif cross is not None:
        print_line(f"  gradian attribute's cross-check {cross.engine} adds {cross.gradients} "
                   f"pass{'es' if cross.gradients > 1 else ''} ({cross.what()}"
                   + ("" if "scoring" in cross.names else f"; {shared}") + "): recomputed by a stream"
                   + (f"{about(cross.gradients + cross.model)}" if seconds is not None else "") + ", read from the index")
    if s.store == "auto":
        print_line(f"  engine.store auto chooses the {p.auto_store}: {p.auto_reason}")
    else:
        print_line(f"  engine.store is {s.store} (auto would choose the {p.auto_store}: {p.auto_reason})")
    left = fmt(p.disk_bytes) if p.disk_bytes else "nothing"
    print_line(f"disk: index {fmt(index.disk_bytes)} ({plan.n_examples:,} x {plan.stored_per_example:,} {s.storage_dtype}); "
               f"the planned run ({p.store}) leaves {left}")
    if plan.replay is not None:
        _print_replay(plan, print_line, fmt)
    if estimate is not None:
        if estimate.seconds is None:
            print_line(f"time: {estimate.source}")
        else:
            print_line(f"time: about {_duration(estimate.seconds)} per forward+backward pass over the data "
                       f"({estimate.seconds_per_token * 1e3:.3f} ms per token, {estimate.source} on {estimate.device}, "
                       f"{estimate.measured_tokens} tokens)")
    if estimate is not None and estimate.eigendecompositions is not None:
        curv = plan.priced.curvature
        print_line(f"time: {plan.settings.engine}'s {curv.eigh_count:,} eigendecompositions of its factors (widest "
                   f"{curv.eigh_widest:,}) about {_duration(estimate.eigendecompositions)} more, on this host's CPU "
                   f"where the fit makes them (one of side {estimate.eigh_timed_side:,} timed, scaled as the cube "
                   "of each side); a fitted state stored in cache_dir is not decomposed again")
    for note in plan.notes:
        print_line(f"note: {note}")
    proposal = plan.proposal
    if proposal is not None:
        if proposal.changes:
            changes = ", ".join(f"{k}={v}" for k, v in proposal.changes.items())
            host = f", host {fmt(proposal.host_peak)}" if proposal.host_peak else ""
            print_line(f"proposed: {changes} -> peak {fmt(proposal.peak_memory)}{host}, {proposal.store}, "
                       f"disk {fmt(proposal.disk_bytes)}" + ("" if proposal.fits else " (still over budget)"))
            for reason in proposal.reasons:
                print_line(f"  - {reason}")
        elif plan.fits:
            print_line("fits the budgets as configured")


def _print_replay(plan: Plan, print_line: Callable[[str], None], fmt: Callable[[float], str]) -> None:
    """The replay's steps, work, memory and disk, from ``plan.replay``."""
    from gradian.plan.replay import STATE_PARTS

    r = plan.replay
    assert r is not None
    which = ("every step" if r.horizon == r.steps else "the last epoch" if r.horizon == r.steps_per_epoch
             else "engine.replay_horizon")
    print_line(f"replay ({r.optimizer}, the run's recipe): {r.steps:,} optimizer steps "
               f"({r.steps_per_epoch:,} an epoch) over {r.rows:,} rows; the row weights act in the last "
               f"{r.horizon:,} ({which})")
    if r.start_step:
        print_line(f"  start: the run's {Path(r.start_checkpoint).name} (after step {r.start_step:,}; "
                   "engine.replay_start: auto), where the replay starts if its optimizer state agrees with the "
                   "recipe when it is read; the steps before it are not retrained")
    print_line(f"  steps: {r.forward_steps:,} replayed forward, the state kept every {r.checkpoint_every} "
               f"({r.kept_states} kept); {r.recomputed_steps:,} recomputed and {r.differentiated_steps:,} "
               "differentiated sweeping back")
    about = f", about {_duration(r.seconds)}" if r.seconds is not None else ""
    print_line(f"  work: {r.training_runs:.2f} training runs{about} (({r.forward_steps:,} + {r.recomputed_steps:,} + "
               f"{r.differentiated_step:.2f} x {r.differentiated_steps:,}) / {r.steps:,} steps; a differentiated step "
               f"is {r.differentiated_step:.2f} plain steps, {r.differentiated_source})")
    w = r.widest_step
    held = ("the initial and final ones and a segment's" if r.on_disk
            else "the kept ones, the final one and a segment's")
    print_line(f"  memory: {fmt(r.peak)} on {plan.settings.device}: weights {fmt(r.weights)}, adapter and its initial "
               f"copy {fmt(r.adapter + r.state_bytes // STATE_PARTS)}, {r.peak_states + 2} states of {fmt(r.state_bytes)} "
               f"(LoRA tensors and AdamW moments: {r.peak_states} held in the sweep, {held}; the adjoint, a rebuilt "
               f"step's), row weights and their gradient {fmt(r.row_weights_bytes)}, one differentiated step's graph "
               f"{fmt(r.step_graph)} (the widest step, {w.rows} rows x {w.width} tokens)")
    if r.on_disk:
        print_line(f"  disk: {fmt(r.disk_bytes)} under cache_dir/replay at most ({r.kept_states - 1} kept states "
                   "past the initial one, the final one and two sweep records), removed once the replay "
                   "finishes but for its result")
    else:
        print_line("  disk: nothing (the states are held in memory, not written)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# plan: a Plan; a budget it reads is set whenever the check on it failed, which the Optional fields do not say
def _over_budget_line(plan: Any, fmt: Callable[[float], str]) -> str:
    p, over = plan.priced, []
    if not plan.fits_replay:
        r = plan.replay
        return (f"refused: engine.name replay needs {fmt(r.peak)} of memory (weights {fmt(r.weights)}, "
                f"{r.peak_states + 2} states of {fmt(r.state_bytes)}, one step's graph {fmt(r.step_graph)}) over "
                f"--memory {fmt(plan.budgets.memory)}: choose engine.name: ekfac, or a device with more memory")
    if not plan.fits_memory:
        over.append(f"{fmt(p.device_peak)} of memory per device (budget {fmt(plan.budgets.memory)})")
    if not plan.fits_host:
        over.append(f"{fmt(p.host_peak)} of host memory (budget {fmt(plan.budgets.host_memory(plan.settings.device))})")
    if not plan.fits_disk:
        over.append(f"{fmt(plan.disk_bytes)} of disk (budget {fmt(plan.budgets.disk)})")
    fix = ""
    if plan.proposal is not None and plan.proposal.changes:
        fix = "; set " + ", ".join(f"{k}: {v}" for k, v in plan.proposal.changes.items())
    return f"warning: the planned run needs {' and '.join(over)}{fix}"


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
