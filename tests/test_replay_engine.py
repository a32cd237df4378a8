"""``engine.name: replay`` end to end: a tinyworld fine-tune retrained from its recipe and differentiated.

Ground truth: the run itself (its saved adapter, which the replay must reproduce), the planted rows
of ``poison_capitals`` (ranked by harm), and a retrain of the tiny model without a row (the sign).
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.errors import ConfigError  # noqa: E402


def _auc(harm: np.ndarray, planted: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(planted, harm))


@pytest.fixture(scope="module")
def replayed(tinyworld_run, tmp_path_factory):
    from gradian.attribution import run_attribution
    from gradian.data import load_dataset

    run = tinyworld_run("poison_capitals")
    cfg = run.config(**{"engine.name": "replay", "evaluation.query_signal": "contrastive"})
    out = tmp_path_factory.mktemp("replay-report")
    outcome = run_attribution(cfg, capability="capitals", cross_check="none", out_dir=out)
    ids = load_dataset(cfg.dataset).ids
    position = {eid: j for j, eid in enumerate(ids)}
    planted = np.array([position[e] in run.planted_rows for e in outcome.rankings["example_id"]])
    return types.SimpleNamespace(run=run, outcome=outcome, planted=planted, out=out)


def test_the_replay_reproduces_the_run_and_says_so(replayed):
    report = replayed.outcome.report.to_json()
    assert report["attribution"]["engine"] == "replay"
    params = report["manifest"]["engine_state"]["params"]
    state = json.loads((replayed.run.root / "run" / "trainer_state.json").read_text())
    assert params["replay_steps"] == state["global_step"] > 0
    # float32 over every AdamW step of the run: rounding only
    assert params["replay_fidelity_rel_diff"] < 1e-3
    assert params["replay_fidelity_faithful"] is True
    notes = " ".join(report["attribution"]["notes"])
    assert "the replayed adapter differs from the run's by" in notes and "effect of each row on this run" in notes
    assert f"the last {params['replay_horizon']} of the {params['replay_steps']} steps" in notes


def test_the_replay_ranks_the_planted_rows_as_harmful(replayed):
    harm = -replayed.outcome.rankings["score"].to_numpy()
    assert np.isfinite(harm).all()
    # 0.78-0.87 over fine-tune seeds 0-2 (docs/validation.md) and 0.75 on a fine-tune made on
    # another CPU model: well above chance (0.5) on every one, though below EK-FAC
    assert _auc(harm, replayed.planted) >= 0.7


def test_the_child_run_parameters_name_the_engine_and_its_fidelity(replayed):
    from gradian.report.tracker import run_params

    params = run_params(replayed.outcome.report)
    assert params["engine"] == "replay"
    assert float(params["replay_fidelity_rel_diff"]) < 1e-3
    assert params["replay_fidelity_faithful"] == "True"


def test_replay_without_a_run_is_refused_naming_the_flag():
    from gradian.attribution.replay_inputs import replay_inputs

    with pytest.raises(ConfigError, match="--run OUTPUT_DIR or --mlflow-run ID"):
        replay_inputs(None, None, None, None, None)


@pytest.mark.parametrize("key", ["engine.replay_horizon", "engine.replay_checkpoint_every"])
@pytest.mark.parametrize("value", [0, -3])
def test_a_horizon_or_interval_below_one_step_is_refused_naming_the_key(key, value):
    from gradian.config import load_config

    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"'{key}' is"):
        load_config(None, {key: value})
    assert getattr(load_config(None, {key: 5}).engine, name) == 5
    assert getattr(load_config().engine, name) is None


def test_the_states_go_under_cache_dir_and_a_second_run_reads_the_replay_back(replayed):
    """The lane gives the replay a folder under cache_dir named by its inputs: once finished it
    holds the result alone, and the same attribution again makes no step and scores the same."""
    from gradian.attribution import run_attribution
    from gradian.replay import unrolled

    cfg = replayed.run.config(**{"engine.name": "replay", "evaluation.query_signal": "contrastive"})
    notes = " ".join(replayed.outcome.report.to_json()["attribution"]["notes"])
    folder = Path(re.search(r"written under (\S+) while it ran", notes).group(1))
    assert folder.parent == Path(cfg.cache_dir) / "replay"
    assert sorted(f.name for f in folder.iterdir()) == ["progress.json", "result.pt"]
    steps = []
    original = unrolled._Steps.step
    unrolled._Steps.step = lambda self, *a, **k: steps.append(1) or original(self, *a, **k)
    try:
        again = run_attribution(cfg, capability="capitals", cross_check="none", out_dir=replayed.out / "again")
    finally:
        unrolled._Steps.step = original
    assert not steps
    assert np.array_equal(again.rankings["score"].to_numpy(), replayed.outcome.rankings["score"].to_numpy())
    notes = " ".join(again.report.to_json()["attribution"]["notes"])
    assert f"read back from {folder}" in notes


def test_a_replay_that_cannot_fit_the_free_memory_is_refused_before_any_step(replayed, monkeypatch):
    from gradian import sizes
    from gradian.attribution import run_attribution
    from gradian.replay import unrolled

    monkeypatch.setattr(sizes, "available_memory", lambda: 64 * 1024)
    monkeypatch.setattr(unrolled._Steps, "step", lambda *a, **k: pytest.fail("a step ran"))
    cfg = replayed.run.config(**{"engine.name": "replay", "evaluation.query_signal": "contrastive",
                                 "engine.replay_horizon": 3})
    with pytest.raises(ConfigError) as refused:
        run_attribution(cfg, capability="capitals", cross_check="none", out_dir=replayed.out / "refused")
    message = str(refused.value)
    assert "engine.name replay needs about" in message and "64.0 KiB of host memory is available" in message
    assert "engine.replay_checkpoint_every" in message and "engine.name: ekfac" in message


@pytest.fixture(scope="module")
def checkpointed(tinyworld_run, tmp_path_factory):
    """The same fine-tune as ``replayed``'s, trained again keeping a trainer checkpoint (adapter and
    optimizer state) at the end of every epoch, and attributed with the replay engine."""
    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from gradian.train import train_lora

    run = tinyworld_run("poison_capitals")
    state = json.loads((run.root / "run" / "trainer_state.json").read_text())
    per_epoch = state["global_step"] // int(state["num_train_epochs"])
    out = tmp_path_factory.mktemp("replay-checkpointed")
    train_lora(load_config(run.config_path, {"train.save_checkpoints": True, "train.save_steps": per_epoch}),
               out / "run")
    cfg = run.config(**{"engine.name": "replay", "evaluation.query_signal": "contrastive", "run": str(out / "run"),
                        "adapter_path": str(out / "run" / "adapter")})
    outcome = run_attribution(cfg, capability="capitals", cross_check="none", out_dir=out / "report")
    return types.SimpleNamespace(run=run, root=out / "run", cfg=cfg, outcome=outcome, steps=state["global_step"],
                                 per_epoch=per_epoch)


def test_a_replay_starts_from_the_runs_checkpoint_before_the_last_epoch(checkpointed, replayed):
    """With a checkpoint at the start of the last epoch the replay retrains that epoch only, from the
    run's own tensors and moments: it ends on the run's adapter, and its scores are those of the
    replay of every step (this run replays faithfully from the first step too)."""
    from scipy.stats import spearmanr

    from safetensors.torch import load_file

    ours = load_file(str(checkpointed.root / "adapter" / "adapter_model.safetensors"))
    shared = load_file(str(replayed.run.root / "run" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(ours[k], shared[k]) for k in shared)  # the same run, checkpoints aside
    report = checkpointed.outcome.report.to_json()
    params = report["manifest"]["engine_state"]["params"]
    start = checkpointed.steps - checkpointed.per_epoch
    assert params["replay_start_step"] == start and params["replay_horizon"] == checkpointed.per_epoch
    assert params["replay_fidelity_rel_diff"] < 1e-4 and params["replay_fidelity_faithful"] is True
    notes = " ".join(report["attribution"]["notes"])
    assert f"checkpoint-{start} (its LoRA tensors and optimizer moments after step {start})" in notes
    assert f"the last {checkpointed.per_epoch} of the run's {checkpointed.steps} optimizer steps retrained" in notes
    a = checkpointed.outcome.rankings.sort_values("row_index")["score"].to_numpy()
    b = replayed.outcome.rankings.sort_values("row_index")["score"].to_numpy()
    assert spearmanr(a, b).statistic > 0.999
    assert np.abs(a - b).max() < 1e-2 * np.abs(b).max()


def test_held_scaling_replays_the_same_run_and_keeps_its_own_states(checkpointed):
    """engine.replay_scaling: held reaches the sweep: the same replayed run (the same fidelity
    figure, bit for bit), other scores, its own folder of states beside the exact replay's, and the
    report and the child run's parameters say which derivative was taken."""
    from gradian.attribution import run_attribution

    cfg = _checkpoint_config(checkpointed, **{"evaluation.query_signal": "contrastive",
                                               "engine.replay_scaling": "held"})
    held = run_attribution(cfg, capability="capitals", cross_check="none", out_dir=checkpointed.root.parent / "held")
    report = held.report.to_json()
    params = report["manifest"]["engine_state"]["params"]
    exact = checkpointed.outcome.report.to_json()["manifest"]["engine_state"]["params"]
    assert params["replay_scaling"] == "held" and exact["replay_scaling"] == "exact"
    assert params["replay_fidelity_rel_diff"] == exact["replay_fidelity_rel_diff"]
    notes = " ".join(report["attribution"]["notes"])
    assert "engine.replay_scaling: held" in notes
    folders = {m.group(1) for r in (report, checkpointed.outcome.report.to_json())
               for m in [re.search(r"(?:written under|read back from) (\S+?)[, ]", " ".join(r["attribution"]["notes"]))]}
    assert len(folders) == 2, folders
    a = held.rankings.sort_values("row_index")["score"].to_numpy()
    b = checkpointed.outcome.rankings.sort_values("row_index")["score"].to_numpy()
    assert not np.allclose(a, b, rtol=1e-3, atol=0)


def _checkpoint_config(checkpointed, **overrides):
    return checkpointed.run.config(**{"engine.name": "replay", "run": str(checkpointed.root),
                                      "adapter_path": str(checkpointed.root / "adapter"), **overrides})


@pytest.fixture(scope="module")
def checkpointed_loaded(checkpointed):
    """The checkpointed run's model, tokenizer, dataset and run record, loaded once for the tests
    that gather the replay's inputs under several settings."""
    from gradian.data import load_dataset
    from gradian.grads import load_model_for_gradients
    from gradian.model_loading import load_tokenizer
    from gradian.runs import read_run_dir

    cfg = _checkpoint_config(checkpointed)
    return (load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg),
            load_tokenizer(cfg.tokenizer or cfg.base_model, cfg.trust_remote_code), load_dataset(cfg.dataset),
            read_run_dir(checkpointed.root))


def _checkpoint_inputs(checkpointed, loaded, **overrides):
    from gradian.attribution.replay_inputs import replay_inputs

    gm, tokenizer, dataset, run = loaded
    return replay_inputs(_checkpoint_config(checkpointed, **overrides), gm, tokenizer, dataset, run)


def test_replay_start_beginning_or_a_longer_horizon_retrain_from_the_first_step(checkpointed,
                                                                             checkpointed_loaded):
    """engine.replay_start: beginning ignores the checkpoints; a horizon reaching back before every
    checkpoint but the first starts from that one."""
    def inputs(**overrides):
        return _checkpoint_inputs(checkpointed, checkpointed_loaded, **overrides)

    assert inputs(**{"engine.replay_start": "beginning"}).start is None
    two = inputs(**{"engine.replay_horizon": 2 * checkpointed.per_epoch})
    assert two.start_step == checkpointed.steps - 2 * checkpointed.per_epoch
    assert inputs(**{"engine.replay_horizon": checkpointed.steps}).start is None


def _damage(folder, how):
    import shutil

    if how == "no optimizer":
        (folder / "optimizer.pt").unlink()
    elif how == "garbage":
        (folder / "optimizer.pt").write_bytes(b"not a torch file")
    elif how == "learning rate":
        saved = torch.load(folder / "optimizer.pt", weights_only=True)
        for group in saved["param_groups"]:
            group["lr"] *= 1.5
        torch.save(saved, folder / "optimizer.pt")
    elif how == "step":
        state = json.loads((folder / "trainer_state.json").read_text())
        state["global_step"] += 1
        (folder / "trainer_state.json").write_text(json.dumps(state))
    elif how == "adapter":
        for name in ("adapter_model.safetensors", "adapter_model.bin"):
            (folder / name).unlink(missing_ok=True)
    else:
        shutil.rmtree(folder)


@pytest.mark.parametrize("how, reason", [
    ("no optimizer", "holds no optimizer.pt"),
    ("garbage", "is not a torch optimizer state"),
    ("learning rate", "where the run's recorded schedule gives"),
    ("step", "says global_step"),
    ("adapter", "cannot be read"),
])
def test_a_checkpoint_that_disagrees_with_the_recipe_is_passed_over_with_the_reason(checkpointed, checkpointed_loaded,
                                                                                    tmp_path, how, reason):
    """A damaged or inconsistent last checkpoint is not used: the note names it and why, and the
    replay starts from the checkpoint before it."""
    import shutil

    from gradian.replay.trainer_checkpoint import choose_start

    inputs = _checkpoint_inputs(checkpointed, checkpointed_loaded)
    folders = sorted(checkpointed.root.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    copies = []
    for folder in folders:
        copies.append(tmp_path / folder.name)
        shutil.copytree(folder, copies[-1])
    latest = checkpointed.steps - checkpointed.per_epoch
    target = next(c for c in copies if c.name == f"checkpoint-{latest}")
    _damage(target, how)
    choice = choose_start([str(c) for c in copies], inputs.lora_params, inputs.model.active_adapter,
                          inputs.run_recipe.recipe, latest)
    assert choice.start is not None and choice.start.step == latest - checkpointed.per_epoch
    assert len(choice.notes) == 1 and f"checkpoint-{latest} was not used as the start" in choice.notes[0]
    assert reason in choice.notes[0]


def test_the_plan_prices_the_replay_from_the_runs_checkpoint(checkpointed, tmp_path):
    """gradian plan --engine replay on the checkpointed run: the forward replay starts at the last
    epoch's checkpoint, and the text names it."""
    import yaml
    from typer.testing import CliRunner

    from gradian.cli import app

    config = yaml.safe_load(checkpointed.run.config_path.read_text())
    config.update(run=str(checkpointed.root), adapter_path=str(checkpointed.root / "adapter"))
    path = tmp_path / "gradian.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["plan", "--config", str(path), "--engine", "replay", "--device", "cpu", "--no-calibrate"]
    done = CliRunner().invoke(app, [*args, "--json"])
    assert done.exit_code == 0, done.output
    replay = json.loads(done.stdout)["replay"]
    start = checkpointed.steps - checkpointed.per_epoch
    assert replay["start_step"] == start and replay["forward_steps"] == checkpointed.per_epoch
    assert replay["start_checkpoint"].endswith(f"checkpoint-{start}")
    text = CliRunner().invoke(app, args).output
    assert f"start: the run's checkpoint-{start} (after step {start:,}" in text
    config.setdefault("engine", {})["replay_start"] = "beginning"
    path.write_text(yaml.safe_dump(config))
    beginning = CliRunner().invoke(app, [*args, "--json"])
    assert beginning.exit_code == 0, beginning.output
    replay = json.loads(beginning.stdout)["replay"]
    assert replay["start_step"] == 0 and replay["forward_steps"] == checkpointed.steps
