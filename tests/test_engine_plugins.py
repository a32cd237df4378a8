"""Attribution engines are plugins too: a third party adds one with one file and one entry point.

The third party is a distribution written into a temporary folder (its package and a
``*.dist-info`` whose ``entry_points.txt`` registers the engine under ``gradian.engines``), found
through ``PYTHONPATH`` exactly as an installed one is. Its engine, ``twice_dot``, scores every row
by the plain gradient dot product times its one option, ``factor`` (2 unless
``engine.options.twice_dot.factor`` says otherwise), so its figures are known exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gradian.errors import ConfigError
from tests.test_run_source_plugins import write_distribution, write_tiny_data

GRADIAN = Path(sys.executable).parent / "gradian"

_ENGINE_MODULE = '''
"""``twice_dot``: a multiple of the gradient dot product, as a third party would write an engine."""
from dataclasses import dataclass

from gradian.engines import Engine, EngineResult
from gradian.engines.graddot import gradient_dot


@dataclass
class TwiceDotOptions:
    factor: float = 2.0


class TwiceDot(Engine):
    name = "twice_dot"
    summary = "twice the plain gradient dot product (a test plugin)"
    curvature = "none"
    Options = TwiceDotOptions

    def score(self, state, query, config, **context):
        factor = self.options(config).factor
        scores, single = gradient_dot(state.train, query)
        return EngineResult(self.name, factor * (scores[:, 0] if single else scores),
                            notes=[f"twice_dot: {factor} x graddot"])
'''


@pytest.fixture(scope="module")
def engine_site(tmp_path_factory):
    return write_distribution(tmp_path_factory.mktemp("engine-plugin"), "gradian-twice", "gradian_twice", "twice_dot",
                              _ENGINE_MODULE, group="gradian.engines", attribute="TwiceDot")


def test_an_installed_engine_is_a_choice_everywhere_the_names_are_read(engine_site, monkeypatch):
    from gradian.config import engine_names, load_config
    from gradian.engines import InMemoryGradients, engine_summaries, get_engine

    monkeypatch.syspath_prepend(str(engine_site))
    assert "twice_dot" in engine_names() and {"ekfac", "datainf", "graddot"} <= set(engine_names())
    assert load_config(overrides={"engine.name": "twice_dot"}).engine.name == "twice_dot"
    assert engine_summaries()["twice_dot"] == "twice the plain gradient dot product (a test plugin)"
    rng = np.random.default_rng(0)
    train = InMemoryGradients({"b": rng.standard_normal((5, 3))})
    query = {"b": rng.standard_normal(3)}
    twice = get_engine("twice_dot").score(get_engine("twice_dot").fit(train, None), query, None).scores
    once = get_engine("graddot").score(get_engine("graddot").fit(train, None), query, None).scores
    np.testing.assert_array_equal(twice, 2.0 * once)


def test_an_engine_reads_its_own_options_and_refuses_what_it_does_not_take(engine_site, monkeypatch, tmp_path):
    """``engine.options.<name>`` reaches the engine's ``Options`` class, from a file or a flag;
    an unknown key, a value of the wrong kind, options for an engine that takes none and options
    under a name that is no engine are each refused, naming the key."""
    from gradian.config import load_config
    from gradian.engines import InMemoryGradients, get_engine

    monkeypatch.syspath_prepend(str(engine_site))
    engine = get_engine("twice_dot")
    rng = np.random.default_rng(1)
    train = InMemoryGradients({"b": rng.standard_normal((4, 3))})
    query = {"b": rng.standard_normal(3)}
    once = get_engine("graddot").score(get_engine("graddot").fit(train, None), query, None).scores
    file = tmp_path / "gradian.yaml"
    file.write_text("engine:\n  name: twice_dot\n  options:\n    twice_dot:\n      factor: 3\n")
    cfg = load_config(file).engine
    assert engine.options(cfg).factor == 3 and engine.options(None).factor == 2.0
    np.testing.assert_array_equal(engine.score(engine.fit(train, cfg), query, cfg).scores, 3 * once)
    assert engine.describe(cfg) == {"options.factor": 3} and engine.settings(cfg) == {"options": {"factor": 3}}
    flagged = load_config(file, {"engine.options.twice_dot.factor": 0.5}).engine
    assert engine.options(flagged).factor == 0.5

    with pytest.raises(ConfigError, match=r"engine.options.twice_dot.factr: engine 'twice_dot' has no such option; "
                                          r"its options are factor"):
        engine.options(load_config(overrides={"engine.options.twice_dot.factr": 3}).engine)
    with pytest.raises(ConfigError, match=r"engine.options.twice_dot.factor is 'big'; it must be a number"):
        engine.options(load_config(overrides={"engine.options.twice_dot.factor": "big"}).engine)
    with pytest.raises(ConfigError, match=r"engine.options.graddot.factor: engine 'graddot' takes no options"):
        get_engine("graddot").options(load_config(overrides={"engine.options.graddot.factor": 3}).engine)
    with pytest.raises(ConfigError, match=r"'engine.options.twice_dott' is .*one of .*twice_dot.*did you mean 'twice_dot'"):
        load_config(overrides={"engine.options.twice_dott.factor": 3})


def test_a_plugin_may_not_take_a_built_in_name(tmp_path, monkeypatch):
    from gradian.config import engine_names

    site = write_distribution(tmp_path, "gradian-impostor", "gradian_impostor", "ekfac", _ENGINE_MODULE,
                              group="gradian.engines", attribute="TwiceDot")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ConfigError, match=r"engine 'ekfac' is declared by gradian \(gradian.engines.ekfac:EKFACEngine\) "
                                          r"and by gradian-impostor \(gradian_impostor:TwiceDot\)"):
        engine_names()


def test_an_unknown_engine_names_the_choices_and_the_entry_points():
    from gradian.config import load_config

    with pytest.raises(ConfigError, match=r"'engine.name' is 'ekfax'; it must be one of datainf, ekfac, graddot, kfac, "
                                          r"replay, tracin \(did you mean 'ekfac'\?\)"):
        load_config(overrides={"engine.name": "ekfax"})
    from gradian.engines import get_engine

    with pytest.raises(ConfigError, match="gradian.engines entry points"):
        get_engine("ekfax")


def test_a_plugin_engine_runs_through_attribute_the_mlflow_child_run_and_explain(engine_site, tmp_path, tiny_lora_dirs,
                                                                                 tracking):
    """One file and one entry point: ``gradian attribute --engine twice_dot`` ranks with it, with
    the option the config gives it (``factor: 3``), so its scores are three times graddot's on the
    same index; the child run it logs under the training run names it and its option in its
    params, and ``gradian explain`` drills into its top row."""
    import mlflow
    from mlflow import MlflowClient

    base_dir, adapter_dir = tiny_lora_dirs
    train, evals = write_tiny_data(tmp_path)
    cfg = tmp_path / "gradian.yaml"
    cfg.write_text(f"cache_dir: {tmp_path / 'cache'}\nevaluation:\n  metric: contains\n  require_significant: false\n"
                   "  max_new_tokens: 4\n  n_bootstrap: 100\nclustering:\n  method: declared\n"
                   "engine:\n  options:\n    twice_dot:\n      factor: 3.0\n")
    with mlflow.start_run() as source:  # the training run, with its adapter as an artifact
        mlflow.log_artifacts(str(adapter_dir), "adapter")
    env = {**os.environ, "PYTHONPATH": str(engine_site), "MLFLOW_TRACKING_URI": tracking}

    def attribute(engine: str, out: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(GRADIAN), "attribute", "-c", str(cfg), "--mlflow-run", source.info.run_id,
                               "--base-model", str(base_dir), "-d", str(train), "-e", str(evals), "--engine", engine,
                               "--cross-check", "none", "-o", str(out)], capture_output=True, text=True, env=env,
                              cwd=tmp_path)

    proc = attribute("twice_dot", tmp_path / "twice")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "twice" / "report.json").read_text())
    assert report["attribution"]["engine"] == "twice_dot"
    proc = attribute("graddot", tmp_path / "once")
    assert proc.returncode == 0, proc.stderr[-2000:]
    twice = pd.read_parquet(tmp_path / "twice" / "rankings.parquet").set_index("example_id")
    once = pd.read_parquet(tmp_path / "once" / "rankings.parquet").set_index("example_id")
    np.testing.assert_allclose(twice["score"], 3.0 * once.loc[twice.index, "score"], rtol=1e-12, atol=0)

    client = MlflowClient(tracking_uri=tracking)
    children = client.search_runs([source.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{source.info.run_id}'")
    assert sorted(run.data.params.get("engine") for run in children) == ["graddot", "twice_dot"]
    assert {run.data.params.get("engine"): run.data.params.get("options.factor") for run in children} == \
        {"graddot": None, "twice_dot": "3.0"}

    top = twice.sort_values("harm_rank").index[0]
    proc = subprocess.run([str(GRADIAN), "explain", "--report", str(tmp_path / "twice"), "--example-id", top, "--json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    explanation = json.loads(proc.stdout)
    assert explanation["example_id"] == top
