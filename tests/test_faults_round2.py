"""The second round of faults: inputs that used to end in an internal error (exit 70), a wrong
answer with exit 0, or raw control characters on the terminal.

Every case plays through the real console entry (``gradian`` in a subprocess, or ``main`` in
process where a fault must be injected) and asserts the exit code, the one ``error:`` line with
the file, key or flag it names, and that nothing was written where the command writes. The
helpers of ``test_faults_door`` check the shape of the line, including that it is never an
internal error.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.test_faults_door import ROW, error_line, gradian, only_line, write_jsonl

_PLAN = ("plan", "--model-config", "qwen2.5-0.5b", "--r", "16", "--target-modules", "all-linear", "--no-calibrate")


# -- plan bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (("--n-examples", "-5"), "--n-examples is -5; it must be a positive number of training rows"),
    (("--n-examples", "0"), "--n-examples is 0; it must be a positive number"),
    (("--n-examples", "10", "--tokens", "0"), "--tokens is 0; it must be a positive number of tokens per row"),
    (("--n-examples", "100000000000000"), "--n-examples 100,000,000,000,000 needs"),
    (("--n-examples", "100000000000000000000"), "this machine has available"),
])
def test_plan_refuses_sizes_it_cannot_plan(args, words):
    line = only_line(gradian(*_PLAN, *args))
    assert words in line, line


def test_plan_of_a_real_size_still_prints_the_index():
    proc = gradian(*_PLAN, "--n-examples", "10000", "--tokens", "512")
    assert proc.returncode == 0, proc.stderr
    assert "disk: index 327.8 GiB (10,000 x 8,798,208 float32)" in proc.stdout


# -- settings whose allocation cannot fit ---------------------------------------------------------


def test_a_bootstrap_too_large_for_memory_is_refused_naming_the_key_and_the_figure(tmp_path):
    from gradian.config import load_config
    from gradian.errors import ConfigError

    config = tmp_path / "gradian.yaml"
    config.write_text("evaluation:\n  n_bootstrap: 100000000000\n")
    with pytest.raises(ConfigError, match=r"gradian\.yaml:2: 'evaluation\.n_bootstrap' is 100,000,000,000, whose "
                                          r"resampled means need 1\.5 TiB of memory, more than the .* available"):
        load_config(config)
    config.write_text("evaluation:\n  n_bootstrap: 20000\n")
    assert load_config(config).evaluation.n_bootstrap == 20000


@pytest.mark.parametrize("written", ["true", "True", "'true'", "sampled"])
def test_the_sampled_fisher_under_its_name_its_old_name_or_a_yaml_boolean(tmp_path, written):
    from gradian.config import load_config

    config = tmp_path / "gradian.yaml"
    config.write_text(f"engine:\n  fisher: {written}\n")
    assert load_config(config).engine.fisher == "sampled"


# -- output paths --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["loop", "loop_below", "dangling"])
def test_an_out_through_a_broken_symlink_is_refused_naming_the_link(tmp_path, case):
    data = write_jsonl(tmp_path / "train.jsonl", [ROW] * 3)
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    (tmp_path / "d").symlink_to(tmp_path / "missing" / "target")
    out = {"loop": tmp_path / "a", "loop_below": tmp_path / "a" / "report", "dangling": tmp_path / "d"}[case]
    line = only_line(gradian("diagnose", "-d", str(data), "--out", str(out)))
    link = tmp_path / ("d" if case == "dangling" else "a")
    why = "which does not exist" if case == "dangling" else "is a loop of symbolic links"
    assert line.startswith(f"error: --out {out}: {link} ") and why in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "d", "train.jsonl"]


def test_init_config_on_a_read_only_folder_names_the_flag_not_a_temporary_file(tmp_path, monkeypatch, capsys):
    import tempfile

    from gradian.cli import main

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = tmp_path / "conf" / "gradian.yaml"
    with pytest.raises(SystemExit) as info:
        main(["init-config", "--out", str(out)])
    assert info.value.code == 3
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --out {out.parent} cannot be written ({tmp_path}: a read-only filesystem); "
                   "pass a folder you can write to")
    assert not out.parent.exists()


def test_errors_from_the_machine_are_named_not_internal():
    """What the machine refuses deep inside a library (memory, a path) is an environment or input
    error with the way out; anything else stays an internal error."""
    from gradian.errors import ConfigError, DiskFullError, GradianEnvironmentError, environment_error

    memory = environment_error(MemoryError("Unable to allocate 745. GiB"))
    assert isinstance(memory, GradianEnvironmentError) and memory.exit_code == 3
    assert "ran out of memory (Unable to allocate 745. GiB); lower grads.batch_size" in str(memory)
    torch_oom = environment_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"))
    assert isinstance(torch_oom, GradianEnvironmentError)
    loop = environment_error(OSError(errno.ELOOP, "Too many levels of symbolic links", "out/x"))
    assert isinstance(loop, ConfigError) and str(loop) == "out/x: a loop of symbolic links; pass another path"
    denied = environment_error(PermissionError(errno.EACCES, "Permission denied", "/srv/cache/f"))
    assert isinstance(denied, GradianEnvironmentError) and "/srv/cache/f: permission denied" in str(denied)
    assert isinstance(environment_error(OSError(errno.ENOSPC, "No space left on device", "/d/x")), DiskFullError)
    assert environment_error(ValueError("a bug")) is None
    assert environment_error(RuntimeError("shape mismatch")) is None
    assert environment_error(OSError(errno.EACCES, "Permission denied")) is None  # no path to name


# -- run folders ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content, words", [
    ("[1, 2]", "gradian_run.json: the file is a list ([1, 2]); it must be an object"),
    ('{"config": "q"}', "gradian_run.json: 'config' is a string ('q'); it must be an object"),
    ('{"config": {"seed": "x"}}', "gradian_run.json: 'config.seed' is a string ('x'); it must be an integer"),
    ('{"config": {"learning_rate": true}}', "'config.learning_rate' is a boolean (True); it must be a number"),
    ('{"lora": {"target_modules": [1]}}', "'lora.target_modules[0]' is an integer (1); it must be a string"),
    ('{"logs": {"steps": [{"loss": 1}]}}', "gradian_run.json: 'logs.steps[0]' has no 'step'"),
    ('{"checkpoints": "ckpt"}', "'checkpoints' is a string ('ckpt'); it must be a list"),
])
def test_a_damaged_run_record_is_refused_naming_the_key(tmp_path, content, words):
    run = tmp_path / "run"
    run.mkdir()
    (run / "gradian_run.json").write_text(content)
    data = write_jsonl(tmp_path / "train.jsonl", [ROW] * 3)
    line = only_line(gradian("diagnose", "--run", str(run), "-d", str(data), "--out", str(tmp_path / "out")))
    assert words in line and "delete it" in line, line
    assert not (tmp_path / "out").exists()


def test_a_trainer_state_that_is_not_an_object_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").write_text("[]")
    data = write_jsonl(tmp_path / "train.jsonl", [ROW] * 3)
    line = only_line(gradian("diagnose", "--run", str(run), "-d", str(data)))
    assert "trainer_state.json: holds a JSON list, not an object" in line, line


def test_a_run_record_gradian_wrote_reads_back_whole(tmp_path):
    from gradian.runs import LogStep, RunRecord, TrainerConfig, TrainingLogs

    record = RunRecord(config=TrainerConfig(learning_rate=2e-4, seed=3, packing=False),
                       logs=TrainingLogs(steps=[LogStep(step=1, loss=2.5)]), checkpoints=["c-1"])
    assert RunRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


# -- dataset rows and eval items ------------------------------------------------------------------


def test_a_lone_surrogate_in_a_row_is_refused_naming_the_line_and_key(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + '{"prompt": "q", "completion": "par\\ud800is"}\n')
    out = tmp_path / "out"
    line = only_line(gradian("diagnose", "-d", str(path), "--out", str(out)))
    assert line.startswith(f"error: {path}:2: 'completion' holds a lone surrogate (\\ud800 at character 3)"), line
    assert not out.exists()
    # a pair written as two escapes is one character, and loads
    path.write_text(json.dumps(ROW) + "\n" + '{"prompt": "q", "completion": "smile \\ud83d\\ude00"}\n')
    assert gradian("diagnose", "-d", str(path)).returncode == 0


def test_repeated_eval_items_count_once():
    from gradian.data import dataset_from_rows
    from gradian.evaluate.capability import unique_items

    rows = [ROW] * 16 + [{"prompt": "what is the capital of japan ?", "completion": "tokyo"}, ROW]
    kept, repeats = unique_items(dataset_from_rows(rows).examples)
    assert [e.completion for e in kept] == ["paris", "tokyo"] and repeats == 16


# -- model and adapter weights ----------------------------------------------------------------------


@pytest.fixture
def model_inputs(tmp_path, tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    copies = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(base, copies[0])
    shutil.copytree(adapter, copies[1])
    words = "what is the capital of france paris japan tokyo".split()
    rows = [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(4)), "completion": words[i % len(words)]}
            for i in range(12)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"capital of {w} ?", "completion": "paris"} for w in words[:6]])
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    return (*copies, train, evals, config)


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _damage(case: str, base: Path, adapter: Path) -> None:
    import torch

    if case == "lora_alpha_nan":
        config = json.loads((adapter / "adapter_config.json").read_text())
        config["lora_alpha"] = float("nan")
        (adapter / "adapter_config.json").write_text(json.dumps(config))
    elif case == "rank_zero":
        config = json.loads((adapter / "adapter_config.json").read_text())
        config["r"] = 0
        (adapter / "adapter_config.json").write_text(json.dumps(config))
    elif case == "int32_tensors":
        _edit_tensors(adapter / "adapter_model.safetensors",
                      lambda t: t.update({k: (v * 100).to(torch.int32) for k, v in t.items()}))
    elif case == "float64_overflowing_float32":
        _edit_tensors(adapter / "adapter_model.safetensors",
                      lambda t: t.update({k: v.double() * 1e150 for k, v in t.items()}))
    elif case == "nan_base_weight":
        def one_nan(t):
            t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
        _edit_tensors(base / "model.safetensors", one_nan)


DAMAGED_WEIGHTS = {
    "lora_alpha_nan": "adapter/adapter_config.json: lora_alpha is nan; it must be a finite number greater than zero",
    "rank_zero": "adapter/adapter_config.json: r is 0; it must be a whole number of at least 1",
    "int32_tensors": "adapter/adapter_model.safetensors: base_model.model.model.layers.0.mlp.down_proj.lora_A.weight "
                     "is stored as int32, but LoRA weights are floating point",
    "float64_overflowing_float32": "in float32: base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight "
                                   "holds 128 NaN or infinite value(s) of 128; its values overflow float32",
    "nan_base_weight": "base': model.layers.0.mlp.up_proj.weight holds 1 NaN or infinite value(s) of 2,048; "
                       "its weights are damaged",
}


@pytest.mark.parametrize("case", sorted(DAMAGED_WEIGHTS))
def test_damaged_weights_are_refused_before_any_measurement(tmp_path, model_inputs, case):
    base, adapter, train, evals, config = model_inputs
    _damage(case, base, adapter)
    out = tmp_path / "out"
    proc = gradian("attribute", "-c", str(config), "-d", str(train), "-e", str(evals), "-m", str(base),
                   "-a", str(adapter), "--out", str(out))
    line = error_line(proc)
    assert DAMAGED_WEIGHTS[case] in line, line
    assert not out.exists() or not any(out.iterdir())
    assert not list((tmp_path / "cache").glob("index/*/chunks/*.npy"))


def test_an_eval_item_longer_than_the_model_reads_is_refused_with_the_bound(tmp_path, model_inputs):
    base, adapter, train, _, config = model_inputs
    evals = write_jsonl(tmp_path / "long.jsonl", [ROW] * 5 + [{"prompt": "what is the capital ? " * 20000,
                                                                "completion": "paris"}])
    out = tmp_path / "out"
    line = error_line(gradian("attribute", "-c", str(config), "-d", str(train), "-e", str(evals), "-m", str(base),
                              "-a", str(adapter), "--out", str(out)))
    assert f"{evals}:6: the item needs" in line and "but the model reads at most 128 (max_position_embeddings" in line, line
    assert not out.exists() or not any(out.iterdir())


def test_repeated_eval_items_cannot_pass_the_gate_end_to_end(tmp_path, model_inputs):
    base, adapter, train, _, config = model_inputs
    evals = write_jsonl(tmp_path / "copies.jsonl", [ROW] * 16)
    out = tmp_path / "out"
    proc = gradian("attribute", "-c", str(config), "-d", str(train), "-e", str(evals), "-m", str(base),
                   "-a", str(adapter), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    cap = json.loads((out / "report.json").read_text())["capability"]
    assert cap["n_items"] == 1 and cap["n_repeats"] == 15 and cap["too_few_items"]
    assert "15 of 16 eval items repeat an earlier item" in proc.stdout


# -- numerical guards inside EK-FAC ------------------------------------------------------------------


def test_factors_that_cannot_be_decomposed_name_the_block_and_the_way_out():
    from gradian.engines.kronecker import eigendecompose
    from gradian.errors import ConfigError

    bad = np.eye(3)
    bad[0, 0] = np.inf
    with pytest.raises(ConfigError, match=r"^EK-FAC: the input covariance of layers\.0\.q_proj holds NaN or infinite "
                                          r"values; .* engine\.name: datainf"):
        eigendecompose(bad, np.eye(2), "layers.0.q_proj")
    with pytest.raises(ConfigError, match=r"output-gradient covariance of layers\.1\.v_proj holds NaN"):
        eigendecompose(np.eye(3), np.full((2, 2), np.nan), "layers.1.v_proj")
    eigen = eigendecompose(np.diag([1.0, 2.0]), np.diag([3.0]), "ok")
    assert np.allclose(np.sort(eigen.eigenvalues.ravel()), [3.0, 6.0])


# -- the terminal ----------------------------------------------------------------------------------

_NASTY = "evil\x1b[2J\x07\u202e[bold]"


def test_control_characters_from_the_data_are_shown_as_escapes():
    from gradian.redact import terminal_safe

    assert terminal_safe(_NASTY) == "evil\\x1b[2J\\x07\\u202e[bold]"
    assert terminal_safe("tab\tand\nnewline stay, é and 東京 too") == "tab\tand\nnewline stay, é and 東京 too"
    assert len(terminal_safe(_NASTY, keep_offsets=True)) == len(_NASTY)


def test_the_summary_panel_escapes_cluster_ids_labels_and_the_capability_name():
    from rich.console import Console

    from gradian.cli.attribute import print_summary
    from gradian.report.schema import Attribution, Capability, ClusterRow, Report, Verdict

    cap = Capability(name=_NASTY, metric="exact_match", base=1.0, tuned=0.5, delta=-0.5, ci=[-0.7, -0.3],
                     n_items=8, n_flipped=4, n_base_failing=0, status="regressed", proxy_used=False)
    attr = Attribution(engine="ekfac", clusters=[ClusterRow(cluster=_NASTY, label="[red]x[/]", n=3, signed_influence=-2.0,
                                                            share_of_negative=0.9, mean_per_example=-0.7)])
    report = Report(verdict=Verdict(kind="data", summary=f"cluster {_NASTY} broke it", accused_cluster=_NASTY),
                    capability=cap, attribution=attr)
    console = Console(record=True, width=300, force_terminal=True, color_system=None)
    print_summary(console, report)
    text = console.export_text()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "evil\\x1b[2J\\x07\\u202e[bold]" in text and "([red]x[/])" in text


def test_cluster_ids_with_control_characters_reach_no_terminal_raw(tmp_path):
    rows = [dict(ROW, prompt=f"q {i}", cluster=_NASTY if i % 2 else "ok") for i in range(8)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": _NASTY, "completion": None}])
    for proc in (gradian("diagnose", "-d", str(data)), gradian("diagnose", "-d", str(bad))):
        assert "\x1b" not in proc.stdout + proc.stderr and "\u202e" not in proc.stdout + proc.stderr
