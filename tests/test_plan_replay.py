"""`gradian plan --engine replay`: the replay priced against what the replay engine really does.

Ground truth: a real ``transformers.Trainer`` run of a tiny Llama (its ``global_step``), and the
replay engine itself scoring it, instrumented: every training step it takes (plain or
differentiated) is counted, and every state it makes (the LoRA tensors and AdamW's moments) is
followed by weak reference, so the bytes of the states alive at any moment are measured, not
computed. Then a tinyworld fine-tune through the command, and each refusal before work.
"""

from __future__ import annotations

import json
import shutil
import weakref

import numpy as np
import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from gradian.cli import app  # noqa: E402
from gradian.data import dataset_from_rows, tokenize_examples  # noqa: E402
from gradian.errors import ConfigError  # noqa: E402
from gradian.plan import AdapterShape, CaptureSettings, DatasetShape, read_model_shape  # noqa: E402
from gradian.plan.planner import PlanSettings, make_plan  # noqa: E402
from gradian.plan.replay import STATE_PARTS, replay_cost  # noqa: E402
from gradian.replay.recipe import recipe_from_run  # noqa: E402
from gradian.runs import normalize_trainer_config  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

ROWS = [{"prompt": f"question {k} about {'abcdefghijk'[k]} ?", "completion": " ".join(["answer"] * (1 + k % 4))}
        for k in range(11)]
#: 11 rows in batches of 2, two batches a step: an epoch is 3 steps (4, 4 and 3 rows), two epochs
ARGS = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=2e-2,
            lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0, weight_decay=0.01, seed=4)


#: the keys of the plan's ``replay`` block in ``gradian plan --json``
REPLAY_KEYS = ["steps", "steps_per_epoch", "optimizer", "rows", "horizon", "checkpoint_every", "forward_steps",
               "recomputed_steps", "differentiated_steps", "differentiated_step", "differentiated_source",
               "state_bytes", "kept_states", "peak_states", "row_weights_bytes", "widest_step", "step_graph",
               "weights", "adapter", "on_disk", "seconds_per_token", "start_step", "start_checkpoint", "training_runs", "held_states_bytes", "peak",
               "disk_bytes",
               "seconds"]


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = [{"input_ids": list(r.input_ids), "labels": list(r.labels)} for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, chat_tokenizer):
    """A Trainer run of a tiny Llama with LoRA on q_proj and v_proj: model, initial tensors, config, rows."""
    from transformers import Trainer, TrainingArguments

    from gradian.train.data import PadCollator

    rows = tokenize_examples(dataset_from_rows(ROWS).examples, chat_tokenizer, 64)
    model = build_tiny_lora("llama", target_modules=["q_proj", "v_proj"])
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("trainer")), report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="no", logging_steps=1, remove_unused_columns=False,
                             **ARGS)
    trainer = Trainer(model=model.train(), args=args, train_dataset=_Rows(rows),
                      data_collator=PadCollator(chat_tokenizer.pad_token_id))
    trainer.train()
    config = normalize_trainer_config(json.loads(json.dumps(args.to_dict(), default=str)))
    return model.eval(), init, config, trainer.state.global_step, rows


class _Watch:
    """Counts the replay's steps and measures the bytes of its states alive (by weak reference)."""

    def __init__(self, monkeypatch):
        from gradian.replay import engine, unrolled

        self.plain = self.differentiated = 0
        self.peak = 0
        self.after_forward: int | None = None
        self._refs: list[tuple[weakref.ref, int]] = []
        step, detached, initial = unrolled._Steps.step, unrolled._detached, unrolled._initial_state
        measure_of = engine.query_measure
        watch = self

        def follow(state):
            for part in state:
                for x in part:
                    watch._refs.append((weakref.ref(x), x.numel() * x.element_size()))
            return state

        def counted(self_, t, state, w, *, create_graph):
            if create_graph:
                watch.differentiated += 1
            else:
                watch.plain += 1
            watch.peak = max(watch.peak, watch.alive())
            return step(self_, t, state, w, create_graph=create_graph)

        def measured(*args, **kwargs):
            measure = measure_of(*args, **kwargs)

            def first_call(model):
                if watch.after_forward is None:
                    watch.after_forward = watch.alive()
                return measure(model)
            return first_call

        monkeypatch.setattr(unrolled._Steps, "step", counted)
        monkeypatch.setattr(unrolled, "_detached", lambda state: follow(detached(state)))
        monkeypatch.setattr(unrolled, "_initial_state", lambda params, start=None: (
            lambda out: (out[0], follow(out[1])))(initial(params, start)))
        monkeypatch.setattr(engine, "query_measure", measured)

    def alive(self) -> int:
        return sum(size for ref, size in self._refs if ref() is not None)


def _start_after(model, lora, init, rows, run_recipe, pad_id, steps):
    """The replay's own state after its first ``steps`` steps, as a trainer checkpoint would hold it."""
    from gradian.replay import ReplayStart
    from gradian.replay.unrolled import _detached, _initial_state, _Steps

    names, state = _initial_state({n: init[n] for n in lora})
    run = _Steps(model, names, rows, run_recipe.batches, run_recipe.recipe, pad_id)
    for t in range(steps):
        state = _detached(run.step(t, state, torch.ones(len(rows)), create_graph=False))
    theta, m, v = (dict(zip(names, part)) for part in state)
    return ReplayStart(step=steps, m=m, v=v), theta


@pytest.mark.parametrize("on_disk", [False, True], ids=["in-memory", "on-disk"])
@pytest.mark.parametrize("horizon, start", [(None, 0), (5, 0), (None, 3)], ids=["epoch", "horizon-5", "from-step-3"])
def test_the_priced_steps_and_states_are_what_the_replay_engine_does(trained, chat_tokenizer, monkeypatch, tmp_path,
                                                                     horizon, start, on_disk):
    """The engine without a state folder (its API) holds every kept state; with one (what the
    attribution lane gives it) it holds the initial and final states and a segment's, and writes
    the rest: its steps, the bytes of its states alive and what it keeps on disk are the plan's,
    also when it starts from a checkpoint's state after step 3 of 6."""
    from gradian.config import EngineConfig
    from gradian.query import QueryItem
    from gradian.replay.engine import ReplayEngine, ReplayFitContext, ReplayInputs

    model, init, config, global_step, rows = trained
    run_recipe = recipe_from_run(config, len(rows))
    shape = read_model_shape(model.config.to_dict())
    cost = replay_cost(run_recipe, shape, AdapterShape(model.peft_config["default"].r, ("q_proj", "v_proj")),
                       [len(r.input_ids) for r in rows], [r.n_supervised for r in rows], CaptureSettings(),
                       horizon=horizon, checkpoint_every=2, on_disk=on_disk, start_step=start)
    assert cost.steps == global_step == 6 and cost.steps_per_epoch == 3 and cost.checkpoint_every == 2
    assert cost.forward_steps == 6 - start
    lora = {n: p for n, p in model.named_parameters() if n in init}
    begin, begin_params = _start_after(model, lora, init, rows, run_recipe, chat_tokenizer.pad_token_id, start) \
        if start else (None, {})
    # a state: every LoRA tensor and its two moments, as the tensors themselves weigh
    assert cost.state_bytes == STATE_PARTS * sum(p.numel() * p.element_size() for p in lora.values())

    watch = _Watch(monkeypatch)
    folder = tmp_path / "replay"
    inputs = ReplayInputs(model=model, lora_params=lora, init={n: init[n] for n in lora}, rows=rows,
                          positions=list(range(len(rows))), n_examples=len(rows), run_recipe=run_recipe,
                          pad_id=chat_tokenizer.pad_token_id, tokenizer=chat_tokenizer, query_max_seq_length=64,
                          horizon=horizon, checkpoint_every=2, state_dir=folder if on_disk else None,
                          start=begin, start_params=begin_params)
    engine, engine_cfg = ReplayEngine(), EngineConfig(name="replay")
    state = engine.fit(None, engine_cfg, ReplayFitContext(replay=inputs))
    item = QueryItem(prompt_messages=[{"role": "user", "content": "question 1 about b ?"}], wanted="answer answer",
                     generated=None, regressed=True, item_id="q0")
    on_disk_now: list[int] = []

    def progress(done, total):
        on_disk_now.append(sum(f.stat().st_size for f in folder.rglob("*.pt")) if folder.exists() else 0)

    result = engine.score(state, {"q": np.zeros(1)}, engine_cfg, query_items=[item], query_signal="target",
                          progress=progress)
    assert np.isfinite(result.scores).all() and np.abs(result.scores).sum() > 0
    assert state.meta["steps"] == cost.steps and state.meta["horizon"] == cost.horizon
    assert state.meta["checkpoint_every"] == cost.checkpoint_every
    assert watch.plain == cost.forward_steps + cost.recomputed_steps
    assert watch.differentiated == cost.differentiated_steps == cost.horizon
    # after the forward replay: the kept states and the final one, or on disk the initial and final ones
    assert watch.after_forward == (2 if on_disk else cost.kept_states + 1) * cost.state_bytes
    assert watch.peak == cost.peak_states * cost.state_bytes
    if not on_disk:
        assert cost.disk_bytes == 0 and not folder.exists()
        return
    # the tensors' bytes are the plan's; torch.save adds its pickle (a few KiB a file at this size)
    files = 3 + 2 + 1  # at most: the kept states and the final one; two sweep records; progress.json
    assert cost.kept_states * cost.state_bytes <= max(on_disk_now) <= cost.disk_bytes + files * 16 * 1024
    # once finished only the result stays; a second score reads it back and makes no step
    assert sorted(f.name for f in next(folder.iterdir()).iterdir()) == ["progress.json", "result.pt"]
    steps_before = watch.plain + watch.differentiated
    again = engine.score(state, {"q": np.zeros(1)}, engine_cfg, query_items=[item], query_signal="target")
    assert watch.plain + watch.differentiated == steps_before
    assert np.array_equal(again.scores, result.scores)
    assert any("read back from" in n for n in again.notes)


def test_the_plan_of_a_tinyworld_run_has_its_steps_and_says_what_it_writes(tinyworld_run):
    run = tinyworld_run("poison_capitals")
    done = CliRunner().invoke(app, ["plan", "--config", str(run.config_path), "--engine", "replay", "--device", "cpu",
                                    "--no-calibrate", "--json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    replay = data["replay"]
    assert list(replay) == REPLAY_KEYS
    state = json.loads((run.root / "run" / "trainer_state.json").read_text())
    rows = (run.root / "train.jsonl").read_text().strip().splitlines()
    assert replay["steps"] == state["global_step"] and replay["rows"] == len(rows)
    assert replay["horizon"] == replay["steps_per_epoch"] and replay["on_disk"]
    assert replay["disk_bytes"] == replay["kept_states"] * replay["state_bytes"] + 2 * (
        replay["state_bytes"] + replay["row_weights_bytes"] // 2)
    # a state is the adapter's LoRA values (a row's gradient, unprojected, every module) and two moments, float32
    assert data["settings"]["projection_dim"] is None and data["settings"]["module_filter"] is None
    assert replay["state_bytes"] == STATE_PARTS * 4 * data["values_per_example"]
    text = CliRunner().invoke(app, ["plan", "--config", str(run.config_path), "--engine", "replay", "--device", "cpu",
                                    "--no-calibrate"])
    assert f"replay (adamw, the run's recipe): {state['global_step']:,} optimizer steps" in text.output
    assert "under cache_dir/replay at most" in text.output


def test_a_replay_plan_without_the_run_is_refused_naming_the_flags():
    args = ["plan", "--model-config", "qwen2.5-0.5b", "--r", "8", "--target-modules", "q_proj,v_proj",
            "--n-examples", "10", "--no-calibrate", "--engine", "replay"]
    done = CliRunner().invoke(app, args)
    assert isinstance(done.exception, ConfigError) and done.exception.exit_code == 2
    assert "--run OUTPUT_DIR or --mlflow-run ID" in str(done.exception)
    # the planner itself refuses a replay it was not given, with the engine's words
    with pytest.raises(ConfigError, match="--run OUTPUT_DIR or --mlflow-run ID"):
        make_plan(read_model_shape("qwen2.5-0.5b"), AdapterShape(8, ("q_proj",)), DatasetShape.uniform(10, 64),
                  PlanSettings(engine="replay"))


def test_a_run_whose_optimizer_the_replay_cannot_differentiate_is_refused(tinyworld_run, tmp_path):
    run = tinyworld_run("poison_capitals")
    copy = tmp_path / "run"
    shutil.copytree(run.root / "run", copy)
    for name in ("gradian_run.json", "training_args.json"):
        path = copy / name
        data = json.loads(path.read_text())
        for holder in (data, data.get("config") or {}, (data.get("config") or {}).get("extra") or {}):
            if "optim" in holder:
                holder["optim"] = "adafactor"
        path.write_text(json.dumps(data))
    done = CliRunner().invoke(app, ["plan", "--config", str(run.config_path), "--run", str(copy), "--engine",
                                    "replay", "--device", "cpu", "--no-calibrate"])
    assert isinstance(done.exception, ConfigError), done.output
    message = str(done.exception)
    assert "optim 'adafactor'" in message and "adamw_torch" in message and "sgd" in message
    assert "engine.name: ekfac" in message


def test_a_replay_over_the_memory_budget_is_refused_in_one_line_with_its_figures(tinyworld_run):
    run = tinyworld_run("poison_capitals")
    base = ["plan", "--config", str(run.config_path), "--engine", "replay", "--device", "cpu", "--no-calibrate"]
    priced = json.loads(CliRunner().invoke(app, [*base, "--json"]).stdout)
    peak = priced["replay"]["peak"]
    done = CliRunner().invoke(app, [*base, "--memory", str(peak // 2), "--fail-if-over"])
    assert done.exit_code == 1
    refused = [line for line in done.output.splitlines() if line.startswith("refused:")]
    assert len(refused) == 1 and "engine.name replay needs" in refused[0] and "--memory" in refused[0]
    assert "engine.name: ekfac" in refused[0]
    roomy = CliRunner().invoke(app, [*base, "--memory", str(2 * peak + priced["device_peak"]), "--fail-if-over"])
    assert roomy.exit_code == 0 and "refused:" not in roomy.output
