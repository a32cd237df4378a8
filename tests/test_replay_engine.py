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
