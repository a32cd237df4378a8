"""Config: defaults, YAML + flag merging, unknown keys, bad values, starter file, hash."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradian.config import (
    GradianConfig,
    config_hash,
    load_config,
    render_starter_config,
)
from gradian.config.loader import config_to_dict
from gradian.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gradian.yaml"
    path.write_text(text)
    return path


def test_defaults_match_documented_values():
    c = load_config()
    assert c.seed == 1234 and c.cache_dir == ".gradian" and c.attn_implementation == "eager"
    assert c.grads.strategy == "hooks" and c.grads.batch_size == 4 and c.grads.chunk_size == 256
    assert c.engine.name == "ekfac" and c.engine.lambda_scale == 0.1 and c.engine.fisher == "empirical"
    assert c.evaluation.metric == "exact_match" and c.evaluation.n_bootstrap == 2000
    assert c.clustering.method == "auto" and c.clustering.n_clusters == 8
    assert c.train.r == 8 and c.train.lora_alpha == 16 and c.train.learning_rate == 2e-4


def test_yaml_then_flags_flags_win(tmp_path):
    path = write(tmp_path, "base_model: a/b\ngrads:\n  batch_size: 2\n  module_filter: down_proj\n")
    c = load_config(path, overrides={"grads.batch_size": 8, "base_model": None, "engine.name": "graddot"})
    assert c.base_model == "a/b"  # None override is skipped
    assert c.grads.batch_size == 8  # flag wins
    assert c.grads.module_filter == "down_proj"
    assert c.engine.name == "graddot"


def test_unknown_key_names_file_line_and_closest_key(tmp_path):
    path = write(tmp_path, "seed: 1\ngrads:\n  batch_size: 2\n  module_filtr: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:4" in msg and "grads.module_filtr" in msg and "grads.module_filter" in msg


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'lamda_scale'"):
        load_config(write(tmp_path, "lamda_scale: 0.1\n"))


def test_unknown_override_key():
    with pytest.raises(ConfigError, match="grads.batchsize.*grads.batch_size"):
        load_config(overrides={"grads.batchsize": 1})


@pytest.mark.parametrize(
    "text, key",
    [
        ("grads:\n  batch_size: -1\n", "grads.batch_size"),
        ("evaluation:\n  metric: accuracy\n", "evaluation.metric"),
        ("engine:\n  lambda_scale: 0\n", "engine.lambda_scale"),
        ("engine:\n  lambda_scale: -0.5\n", "engine.lambda_scale"),
        ("evaluation:\n  ci_level: 1.5\n", "evaluation.ci_level"),
        ("grads:\n  storage_dtype: int8\n", "grads.storage_dtype"),
        ("grads:\n  module_filter: '(['\n", "grads.module_filter"),
        ("train:\n  learning_rate: 0\n", "train.learning_rate"),
        ("grads:\n  batch_size: lots\n", "grads.batch_size"),
        ("engine:\n  factor_rows: 0\n", "engine.factor_rows"),
        ("engine:\n  factor_rows: 2.5\n", "engine.factor_rows"),
        ("engine:\n  correction_rows: 0\n", "engine.correction_rows"),
        ("engine:\n  correction_rows: 2.5\n", "engine.correction_rows"),
    ],
)
def test_bad_values_name_the_field(tmp_path, text, key):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert key in str(err.value)


def test_trl_backend_is_a_choice_of_the_file_and_a_bad_backend_is_refused(tmp_path):
    assert load_config(write(tmp_path, "train:\n  backend: trl\n")).train.backend == "trl"
    with pytest.raises(ConfigError, match="train.backend"):
        load_config(write(tmp_path, "train:\n  backend: jax\n"))


def test_invalid_yaml_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match=r"gradian.yaml:\d"):
        load_config(write(tmp_path, "seed: 1\ngrads: [\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="init-config"):
        load_config("/nonexistent/gradian.yaml")


def test_starter_config_loads_back_unchanged(tmp_path):
    path = write(tmp_path, render_starter_config(base_model="org/model-1B"))
    assert load_config(path) == GradianConfig(base_model="org/model-1B")
    text = path.read_text()
    assert "# " in text and "lambda_scale: 0.1" in text  # commented, every field present


def test_hash_is_stable_and_sensitive():
    a, b = load_config(), load_config()
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 64
    assert config_hash(a) == config_hash(config_to_dict(a))  # dict and dataclass agree
    changed = load_config(overrides={"engine.lambda_scale": 0.2})
    assert config_hash(changed) != config_hash(a)


# the worked example's own file, written as the documentation spells it (``adapter:``)
WORKED_EXAMPLE = """\
base_model: unsloth/Llama-3.2-1B-Instruct
adapter: results/A-wrong_facts/run/adapter
dataset: results/A-wrong_facts/train.jsonl
eval_dataset: results/A-wrong_facts/eval.jsonl
evaluation:
  metric: contains
clustering:
  method: declared
"""


def test_adapter_is_accepted_as_adapter_path(tmp_path):
    c = load_config(write(tmp_path, WORKED_EXAMPLE))
    assert c.adapter_path == "results/A-wrong_facts/run/adapter"
    assert c.evaluation.metric == "contains" and c.clustering.method == "declared"


def test_alias_and_canonical_key_together_is_an_error_naming_both(tmp_path):
    path = write(tmp_path, "adapter: a\nseed: 1\nadapter_path: b\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "'adapter'" in msg and "'adapter_path'" in msg
    assert f"{path}:1" in msg and f"{path}:3" in msg


def test_starter_config_writes_the_canonical_name():
    text = render_starter_config()
    assert "\nadapter_path: " in text
    assert "\nadapter: " not in text


def test_run_names_the_training_run_and_run_dir_is_still_read(tmp_path):
    assert load_config(write(tmp_path, "run: runs:/0123\n")).run == "runs:/0123"
    assert load_config(write(tmp_path, "run_dir: out/run\n")).run == "out/run"  # the earlier name
    assert load_config(overrides={"run": "out/run"}).run == "out/run"
    with pytest.raises(ConfigError, match="both 'run_dir' and 'run' are set"):
        load_config(write(tmp_path, "run_dir: a\nrun: b\n"))


def test_the_verdict_section_is_read_checked_and_reaches_the_decision(tmp_path):
    from gradian.config import load_config
    from gradian.errors import ConfigError
    from gradian.report.decision import decide_verdict
    from gradian.report.schema import Attribution

    config = tmp_path / "gradian.yaml"
    config.write_text("verdict:\n  data_min_share: 0\n")
    with pytest.raises(ConfigError, match=r"'verdict\.data_min_share' is 0(\.0)?; it must lie in \(0, 1\]"):
        load_config(config)
    config.write_text("verdict:\n  config_min_severity: severe\n")
    with pytest.raises(ConfigError, match=r"'verdict\.config_min_severity' is 'severe'; it must be one of critical"):
        load_config(config)
    attribution = Attribution(engine="ekfac", cross_check="datainf", engine_agreement_spearman=0.7)
    hedges = lambda cfg: {h.code for h in decide_verdict(None, [], attribution, cfg.verdict).hedges}  # noqa: E731
    assert "engine_disagreement" in hedges(load_config())  # 0.7 is below the default 0.8
    config.write_text("verdict:\n  engine_agreement_moderate: 0.6\n")
    assert "engine_disagreement" not in hedges(load_config(config))
