"""Under ``engine.store: index``, an index too big for ``grads.max_index_gb`` gets a projection
(announced and recorded), or, under an engine that needs whole gradients, a clear error; a small
one is left alone. (Under the default ``engine.store: auto`` it is streamed instead:
tests/test_stream.py.)"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from gradian.config import load_config  # noqa: E402
from gradian.errors import ConfigError  # noqa: E402
from gradian.grads import wrap_peft_model  # noqa: E402
from gradian.engines.registry import whole_gradient_engines  # noqa: E402
from gradian.index.sizing import AUTO_PROJECTION_FLOOR, auto_projection, index_bytes  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

GIB = 2**30


@pytest.fixture(scope="module")
def gm():
    # hidden 64 and r=4: the widest block holds (4 x 64) + (64 x 4) = 512 values, so a 256-wide
    # projection halves it and narrower blocks keep their width
    return wrap_peft_model(build_tiny_lora("llama"))


def _config(limit_gb, **extra):
    return load_config(overrides={"grads.max_index_gb": limit_gb, **extra})


def test_a_full_index_under_the_limit_is_left_alone(gm):
    config = _config(100.0)
    same, decision = auto_projection(config, gm, 1000, whole_gradient_engines(["ekfac", "datainf"]))
    assert same is config and decision is None


def test_over_the_limit_the_widest_fitting_power_of_two_is_chosen(gm):
    n = 1000
    full = index_bytes(gm, _config(None).grads, n)
    projected = index_bytes(gm, _config(None, **{"grads.projection_dim": AUTO_PROJECTION_FLOOR}).grads, n)
    assert projected < full
    limit_gb = (projected + full) / 2 / GIB  # room for the 256-wide index, not the full one
    config, decision = auto_projection(_config(limit_gb), gm, n, whole_gradient_engines(["datainf", "graddot"]))
    assert config.grads.projection_dim == AUTO_PROJECTION_FLOOR
    assert decision.full_bytes == full and decision.stored_bytes == projected
    assert decision.stored_bytes <= decision.limit_bytes < decision.full_bytes
    assert "grads.max_index_gb" in decision.message() and "256" in decision.message()
    assert _config(limit_gb).grads.projection_dim is None  # the given config is not changed


def test_a_projection_set_by_the_user_or_no_limit_is_never_overridden(gm):
    for config in (_config(1e-9, **{"grads.projection_dim": 64}), _config(None)):
        assert auto_projection(config, gm, 1000, whole_gradient_engines(["datainf"])) == (config, None)


def test_engines_that_need_whole_gradients_stop_with_the_ways_out(gm):
    with pytest.raises(ConfigError, match=r"over grads.max_index_gb.*ekfac fit curvature on whole gradients.*"
                                          r"engine.name: datainf"):
        auto_projection(_config(1e-9), gm, 1000, whole_gradient_engines(["ekfac", "datainf"]))


def test_when_even_the_narrowest_projection_does_not_fit_it_says_so(gm):
    with pytest.raises(ConfigError, match=f"even a projection to {AUTO_PROJECTION_FLOOR} values"):
        auto_projection(_config(1e-9), gm, 1000, whole_gradient_engines(["datainf"]))


@pytest.mark.parametrize("value", [0, -1.0])
def test_a_non_positive_limit_is_rejected(value):
    with pytest.raises(ConfigError, match="grads.max_index_gb"):
        _config(value)


def test_the_attribute_lane_projects_the_index_and_the_query_alike(tmp_path, tiny_lora_dirs):
    """Through run_attribution: the index manifest records the decision, the report's config has
    the projection, and the engine scored every row (the query was projected the same way)."""
    from gradian.attribution import run_attribution

    base_dir, adapter_dir = tiny_lora_dirs
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"question {i} ?", "completion": f"answer {i % 3}"}) + "\n"
                             for i in range(12)))
    overrides = {"base_model": str(base_dir), "adapter_path": str(adapter_dir), "dataset": str(train),
                 "cache_dir": str(tmp_path / "cache"), "clustering.method": "none", "engine.name": "datainf",
                 "grads.chunk_size": 8, "engine.store": "index"}
    probe = load_config(overrides=overrides)
    from gradian.grads import load_model_for_gradients

    loaded = load_model_for_gradients(str(base_dir), str(adapter_dir), probe)
    full = index_bytes(loaded, probe.grads, 12)
    projected = index_bytes(loaded, load_config(overrides={"grads.projection_dim": AUTO_PROJECTION_FLOOR}).grads, 12)
    assert projected < full
    cfg = load_config(overrides={**overrides, "grads.max_index_gb": (projected + full) / 2 / GIB})
    notes: list[str] = []
    outcome = run_attribution(cfg, cross_check="none", log=notes.append)
    report = outcome.report.to_json()
    dim = report["manifest"]["config"]["grads"]["projection_dim"]
    assert dim == AUTO_PROJECTION_FLOOR
    decision = report["manifest"]["index_manifest"]["projection_auto"]
    assert decision["projection_dim"] == dim and decision["full_bytes"] == full
    assert decision["stored_bytes"] <= decision["limit_bytes"] < full
    assert any(note.startswith("note: the full-width index would take") for note in notes)
    assert report["attribution"]["n_examples"] == 12
