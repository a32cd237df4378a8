"""Validation at the door: bad input stops the real console entry with one line, before any work.

Each family plays its bad inputs through ``gradian`` in a subprocess (the real entry point, so
the error handling itself is under test) and asserts the exit code, that stderr holds exactly one
``error:`` line naming the file:line, key, flag or path, no traceback, and that nothing was
written where the command would have written. Positive controls beside them: a good input still
runs, and JSON Lines whose strings hold U+2028, U+2029 or U+0085 load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROW = {"prompt": "what is the capital of france ?", "completion": "paris"}


def gradian(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def error_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one ``error:`` line of a failed command, after checking the exit code and the shape."""
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr  # nothing after it
    assert "internal error" not in errors[0], errors[0]
    return errors[0]


def only_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """Like ``error_line``, and nothing else on stderr: the command stopped before any stage ran."""
    line = error_line(proc, code)
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [line], proc.stderr
    return line


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# -- dataset rows --------------------------------------------------------------------------------

_DEEP = "[" * 100_000 + "]" * 100_000

# name -> (file name, content: a list of rows, or raw text), the line named, words of the message
BAD_ROWS = {
    "list_row": ("d.jsonl", [ROW, [1, 2]], "d.jsonl:2", "is a list, not an object"),
    "empty_object": ("d.jsonl", [{}], "d.jsonl:1", "the row is empty ({})"),
    "null_completion": ("d.jsonl", [ROW, {"prompt": "q", "completion": None}], "d.jsonl:2",
                        "'completion' is null beside 'prompt'"),
    "number_prompt": ("d.jsonl", [{"prompt": 5, "completion": "x"}], "d.jsonl:1",
                      "'prompt' is a number (5); it must be a string"),
    "object_answer": ("d.jsonl", [{"question": "q", "answer": {"a": 1}}], "d.jsonl:1", "'answer' is an object"),
    "messages_string": ("d.jsonl", [{"messages": "hello"}], "d.jsonl:1", "'messages' is a string; it must be a list"),
    "turn_content_null": ("d.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": None}]}],
                          "d.jsonl:1", "turn 1 (assistant) has no content"),
    "turn_content_number": ("d.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": 7}]}],
                            "d.jsonl:1", "turn 1 (assistant) has content that is a number"),
    "turn_not_object": ("d.jsonl", [{"messages": ["hi", "there"]}], "d.jsonl:1", "turn 0 is a string"),
    "only_nulls": ("d.jsonl", [{"text": None}], "d.jsonl:1", "the row is all nulls"),
    "json_number_row": ("d.json", [ROW, 3], "d.json row 1", "is a number, not an object"),
    "no_known_keys": ("d.jsonl", [{"promt": "q", "answr": "a"}] * 2, "d.jsonl:", "no row has a known shape (keys found: promt, answr)"),
    "plain_strings": ("d.jsonl", ["just text", "more text"], "d.jsonl:", "the rows are plain strings"),
    "deep_jsonl": ("d.jsonl", '{"prompt": "q", "completion": "a"}\n' + _DEEP + "\n", "d.jsonl:2", "nested too deeply"),
    "deep_json": ("d.json", _DEEP, "d.json:", "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_are_refused_naming_the_line(tmp_path, case):
    name, content, where, words = BAD_ROWS[case]
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif name.endswith(".json"):
        path.write_text(json.dumps(content))
    else:
        write_jsonl(path, content)
    out = tmp_path / "out"
    line = only_line(gradian("diagnose", "--dataset", str(path), "--out", str(out)))
    assert f"{tmp_path}/{where}" in line and words in line, line
    assert not out.exists()


# -- dataset files -------------------------------------------------------------------------------


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _saved(path: Path, damage: str | None = None) -> Path:
    from datasets import Dataset

    Dataset.from_list([ROW] * 3).save_to_disk(str(path))
    if damage == "truncated_arrow":
        for arrow in path.glob("*.arrow"):
            arrow.write_bytes(arrow.read_bytes()[:100])
    elif damage == "bad_state":
        (path / "state.json").write_text("{not json")
    return path


def _bad_file(tmp_path: Path, case: str) -> Path:
    if case == "parquet_without_expected_columns":
        return _parquet(tmp_path / "d.parquet", {"a": [1, 2], "notes": ["x", "y"]})
    if case == "not_a_parquet_file":
        (tmp_path / "d.parquet").write_bytes(b"PAR1 but not really")
        return tmp_path / "d.parquet"
    if case == "folder_not_save_to_disk":
        (tmp_path / "rows").mkdir()
        (tmp_path / "rows" / "a.txt").write_text("x")
        return tmp_path / "rows"
    if case in ("saved_truncated_arrow", "saved_bad_state"):
        return _saved(tmp_path / "saved", case.removeprefix("saved_"))
    if case == "saved_without_expected_columns":
        from datasets import Dataset

        Dataset.from_list([{"a": 1, "b": "x"}] * 2).save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved"
    if case == "fifo":
        os.mkfifo(tmp_path / "d.jsonl")
        return tmp_path / "d.jsonl"
    if case == "character_device":
        return Path(os.devnull)
    if case == "not_utf8_jsonl":
        (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "caf\xe9", "completion": "x"}\n')
        return tmp_path / "d.jsonl"
    raise AssertionError(case)


BAD_FILES = {
    "parquet_without_expected_columns": "has none of the expected columns (found: a, notes); expected messages",
    "not_a_parquet_file": "cannot read as Parquet",
    "folder_not_save_to_disk": "must be written by datasets' save_to_disk",
    "saved_truncated_arrow": "a damaged save_to_disk dataset",
    "saved_bad_state": "a damaged save_to_disk dataset (JSONDecodeError",
    "saved_without_expected_columns": "has none of the expected columns (found: a, b)",
    "fifo": "is a named pipe (FIFO), not a regular file",
    "character_device": "is a character device, not a regular file",
    "not_utf8_jsonl": "not UTF-8 text",
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_dataset_files_are_refused_naming_the_path(tmp_path, case):
    path = _bad_file(tmp_path, case)
    out = tmp_path / "out"
    # a FIFO is never opened: with no writer, reading it would block past this timeout
    line = only_line(gradian("diagnose", "--dataset", str(path), "--out", str(out), timeout=60))
    assert str(path) in line and BAD_FILES[case] in line, line
    assert not out.exists()


def test_good_inputs_still_load(tmp_path):
    """Positive controls: JSON Lines with line separators inside strings, CRLF line ends, good
    Parquet columns and a save_to_disk folder load, and diagnose runs on them."""
    from gradian.data import load_dataset

    odd = "one\u2028two\u2029three\u0085four"
    jsonl = write_jsonl(tmp_path / "odd.jsonl", [{"prompt": odd, "completion": "paris"}, ROW])
    loaded = load_dataset(jsonl)
    assert len(loaded) == 2 and loaded[0].prompt_text == odd and loaded[1].line == 2
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b"".join(json.dumps(r).encode() + b"\r\n" for r in (ROW, ROW)))
    assert len(load_dataset(crlf)) == 2
    parquet = _parquet(tmp_path / "d.parquet", {"question": ["q", None], "answer": ["a", None],
                                                "prompt": [None, "p"], "completion": [None, "c"]})
    assert [e.shape for e in load_dataset(parquet)] == ["question_answer", "prompt_completion"]
    assert len(load_dataset(_saved(tmp_path / "saved"))) == 3
    proc = gradian("diagnose", "--dataset", str(jsonl))
    assert proc.returncode == 0, proc.stderr


# -- config files --------------------------------------------------------------------------------

# name -> (config text, file:line suffix or "", words of the message)
BAD_CONFIGS = {
    "duplicate_key": ("seed: 1\nseed: 2\n", ":2", "key 'seed' is set twice (first at line 1)"),
    "duplicate_nested_key": ("grads:\n  batch_size: 2\n  chunk_size: 8\n  batch_size: 4\n", ":4",
                             "key 'grads.batch_size' is set twice (first at line 2)"),
    "duplicate_section": ("grads:\n  batch_size: 2\nengine:\n  name: datainf\ngrads:\n  chunk_size: 8\n", ":5",
                          "key 'grads' is set twice (first at line 1)"),
    "not_utf8": (b"seed: 1  # caf\xe9\n", ":1", "not UTF-8 text (byte 0xe9"),
    "infinite_learning_rate": ("train:\n  learning_rate: .inf\n", ":2", "'train.learning_rate' is inf; it must be a finite number"),
    "nan_ci_level": ("evaluation:\n  ci_level: .nan\n", ":2", "'evaluation.ci_level' is nan; it must be a finite number"),
    "infinite_lambda_override": ("engine:\n  lambda_override: .inf\n", ":2", "'engine.lambda_override' is inf"),
    "zero_lambda_override": ("engine:\n  lambda_override: 0.0\n", ":2", "'engine.lambda_override' is 0.0; it must be greater than zero"),
    "infinite_extra": ("train:\n  extra:\n    adam_beta1: -.inf\n", ":3", "'train.extra.adam_beta1' is -inf"),
    "negative_seed": ("seed: -1\n", ":1", "'seed' is -1; it must be a whole number from 0 to 4294967295"),
    "seed_2_64": ("seed: 18446744073709551616\n", ":1", "'seed' is 18446744073709551616"),
    "projection_seed_2_32": ("grads:\n  projection_seed: 4294967296\n", ":2", "'grads.projection_seed' is 4294967296"),
    "min_items_zero": ("evaluation:\n  min_items: 0\n", ":2", "'evaluation.min_items' is 0; it must be a whole number of at least 1"),
    "deeply_nested": ("seed: " + "[" * 20_000 + "]" * 20_000 + "\n", "", "nested too deeply to read"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_files_are_refused_naming_the_key(tmp_path, case):
    text, line_suffix, words = BAD_CONFIGS[case]
    config = tmp_path / "gradian.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    data = write_jsonl(tmp_path / "train.jsonl", [ROW])
    out = tmp_path / "out"
    line = only_line(gradian("diagnose", "--config", str(config), "--dataset", str(data), "--out", str(out)))
    assert f"{config}{line_suffix}:" in line and words in line, line
    assert not out.exists()


def test_a_flag_over_a_bad_file_value_is_named_as_the_flags(tmp_path):
    """The value a flag set is not blamed on the file's line; the largest seed is accepted."""
    from gradian.config import load_config
    from gradian.errors import ConfigError

    config = tmp_path / "gradian.yaml"
    config.write_text("seed: 4294967295\nengine:\n  lambda_scale: 0.2\n")
    assert load_config(config).seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"^.*gradian\.yaml \+ command-line flags: 'engine\.lambda_scale' is inf"):
        load_config(config, {"engine.lambda_scale": float("inf")})


# -- models, adapters and settings that need the model ------------------------------------------


@pytest.fixture
def inputs(tmp_path, tiny_lora_dirs):
    """A private copy of the tiny adapter, a 12-row training file and a 6-item eval file."""
    base, adapter = tiny_lora_dirs
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    words = "what is the capital of france paris japan tokyo".split()
    rows = [{"prompt": " ".join(words[(i + k) % len(words)] for k in range(4)), "completion": words[i % len(words)]}
            for i in range(12)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval.jsonl", [ROW] * 6)
    return base, copy, train, evals


def _nan_weights(adapter: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    tensors[sorted(tensors)[3]][0, 0] = float("nan")
    save_file(tensors, str(path))


BAD_MODEL_INPUTS = {
    "adapter_config_is_a_list": (2, "adapter/adapter_config.json: holds a JSON list, not an object"),
    "nan_adapter_weights": (2, "adapter/adapter_model.safetensors: base_model.model"),
    "flash_attention_without_the_package": (3, "attn_implementation: flash_attention_2 needs the flash-attn package"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODEL_INPUTS))
def test_bad_model_inputs_stop_the_index_before_any_gradient(tmp_path, inputs, case):
    base, adapter, train, _ = inputs
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    if case == "adapter_config_is_a_list":
        (adapter / "adapter_config.json").write_text('["q_proj", "v_proj"]')
    elif case == "nan_adapter_weights":
        _nan_weights(adapter)
    else:
        if importlib.util.find_spec("flash_attn") is not None:
            pytest.skip("flash-attn is installed here")
        config.write_text(config.read_text() + "attn_implementation: flash_attention_2\n")
    code, words = BAD_MODEL_INPUTS[case]
    line = error_line(gradian("index", "-c", str(config), "-d", str(train), "-m", str(base), "-a", str(adapter)), code)
    assert words in line, line
    assert not list((tmp_path / "cache").glob("index/*/chunks/*.npy"))


def test_settings_that_cannot_fit_the_data_stop_before_the_model_loads(tmp_path, inputs):
    base, adapter, train, evals = inputs
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\nclustering:\n  method: hdbscan\n  min_cluster_size: 100\n")
    out = tmp_path / "out"
    proc = gradian("attribute", "-c", str(config), "-d", str(train), "-e", str(evals), "-m", str(base),
                   "-a", str(adapter), "--out", str(out))
    line = error_line(proc)
    assert "'clustering.min_cluster_size' is 100 but" in line and "train.jsonl has only 12 rows" in line, line
    assert "loading" not in proc.stderr and not out.exists()


def test_damping_that_overflows_the_scores_names_the_key_and_writes_nothing(tmp_path, inputs):
    base, adapter, train, evals = inputs
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\nevaluation:\n  require_significant: false\n"
                      "  metric: loglik\nengine:\n  name: datainf\n  lambda_override: 1.0e-300\n")
    out = tmp_path / "out"
    proc = gradian("attribute", "-c", str(config), "-d", str(train), "-e", str(evals), "-m", str(base),
                   "-a", str(adapter), "--cross-check", "none", "--out", str(out))
    line = error_line(proc)
    assert "NaN or infinite with engine.lambda_override=1e-300" in line and "Nothing was written" in line, line
    assert "RuntimeWarning" not in proc.stderr and not out.exists()


# -- output and cache folders --------------------------------------------------------------------


def _folder_case(tmp_path: Path, inputs, case: str) -> tuple[list[str], str]:
    base, adapter, train, evals = inputs
    model = ["-m", str(base), "-a", str(adapter)]
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    cache = tmp_path / "gradian.yaml"
    cache.write_text(f"cache_dir: {blocker}\n")
    cases = {
        "attribute_out_is_a_file": (["attribute", "-d", str(train), "-e", str(evals), *model, "--out", str(blocker)],
                                    f"--out {blocker} is an existing file, not a folder"),
        "attribute_out_under_a_file": (["attribute", "-d", str(train), "-e", str(evals), *model,
                                        "--out", str(blocker / "report")], f"--out {blocker / 'report'}: {blocker} is a file"),
        "attribute_cache_dir_is_a_file": (["attribute", "-c", str(cache), "-d", str(train), "-e", str(evals), *model],
                                          f"cache_dir {blocker} is an existing file"),
        "index_cache_dir_is_a_file": (["index", "-c", str(cache), "-d", str(train), *model],
                                      f"cache_dir {blocker} is an existing file"),
        "diagnose_out_is_a_file": (["diagnose", "-d", str(train), "--out", str(blocker)],
                                   f"--out {blocker} is an existing file"),
        "counterfactual_out_is_a_file": (["counterfactual", "-d", str(train), "--drop-ids", "x", *model,
                                          "--out", str(blocker)], f"--out {blocker} is an existing file"),
    }
    return cases[case]


@pytest.mark.parametrize("case", ["attribute_out_is_a_file", "attribute_out_under_a_file", "attribute_cache_dir_is_a_file",
                                  "index_cache_dir_is_a_file", "diagnose_out_is_a_file", "counterfactual_out_is_a_file"])
def test_unusable_output_folders_are_refused_before_any_work(tmp_path, inputs, case):
    args, words = _folder_case(tmp_path, inputs, case)
    line = only_line(gradian(*args))  # nothing logged first: no stage ran
    assert words in line, line
    assert (tmp_path / "taken").read_text() == "keep me"


def test_an_unwritable_folder_is_an_environment_error(tmp_path, monkeypatch, capsys):
    """A read-only filesystem (played by the probe file failing with EROFS) exits 3, naming the flag."""
    import errno
    import tempfile

    from gradian.cli import main

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    data = write_jsonl(tmp_path / "train.jsonl", [ROW])
    with pytest.raises(SystemExit) as info:
        main(["diagnose", "-d", str(data), "--out", str(tmp_path / "out")])
    assert info.value.code == 3
    err = capsys.readouterr().err.strip()
    assert err == f"error: --out {tmp_path / 'out'} cannot be written ({tmp_path}: a read-only filesystem); pass a folder you can write to"


# -- the significance gate -----------------------------------------------------------------------


def _capability(n: int):
    from gradian.evaluate.capability import summarize_capability
    from gradian.evaluate.result import ItemResult

    items = [ItemResult(example_id=f"e{i}", index=i, prompt="q", wanted="a", base_score=1.0, tuned_score=0.0,
                        base_correct=True, tuned_correct=False, flipped=True) for i in range(n)]
    return summarize_capability(items, name="capitals", metric="exact_match", n_bootstrap=200)


@pytest.mark.parametrize("n, allowed", [(1, False), (4, False), (5, True)])
def test_too_few_eval_items_do_not_pass_the_gate(n, allowed):
    from gradian.evaluate import gate_attribution

    result = _capability(n)
    assert result.status == "regressed"  # every item flipped: the interval is [-1, -1], falsely certain
    gate = gate_attribution(result, require_significant=True, min_items=5)
    assert gate.allowed is allowed and gate.gated is not allowed
    if not allowed:
        assert gate.finding.id == "attribution.gate_failed"
        assert f"Only {n} eval item(s)" in gate.finding.title and "evaluation.min_items=5" in gate.finding.title
        assert gate.finding.evidence["min_items"] == 5


def test_a_one_item_eval_set_gets_no_attribution_end_to_end(tmp_path, inputs):
    base, adapter, train, _ = inputs
    one = write_jsonl(tmp_path / "one.jsonl", [ROW])
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\nevaluation:\n  metric: loglik\n")
    out = tmp_path / "out"
    proc = gradian("attribute", "-c", str(config), "-d", str(train), "-e", str(one), "-m", str(base),
                   "-a", str(adapter), "--cross-check", "none", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["attribution"] is None and report["verdict"]["kind"] == "inconclusive"
    assert report["capability"]["too_few_items"] is True and report["capability"]["min_items"] == 5
    gate = next(f for f in report["findings"] if f["id"] == "attribution.gate_failed")
    assert gate["title"].startswith("Only 1 eval item(s) for 'capability', fewer than evaluation.min_items=5")
    assert "fewer than evaluation.min_items=5" in report["verdict"]["summary"]
