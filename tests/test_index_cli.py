"""``gradian index`` / ``gradian show-index`` end to end on a tiny saved model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")

from gradian.cli import app  # noqa: E402


@pytest.fixture
def dataset_path(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "what is the capital of france ?", "completion": c} for c in ("paris", "tokyo", "hello", "one two")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_index_then_cache_hit_then_show(tmp_path, tiny_lora_dirs, dataset_path):
    base, adapter = tiny_lora_dirs
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\ngrads:\n  chunk_size: 2\n  storage_dtype: float16\n")
    args = ["index", "-c", str(config), "-d", str(dataset_path), "-m", str(base), "-a", str(adapter)]
    runner = CliRunner()
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "built index" in first.output and "4 examples" in first.output
    second = runner.invoke(app, args)
    assert "reused index" in second.output
    root = second.output.strip().splitlines()[-1]
    shown = runner.invoke(app, ["show-index", root])
    assert shown.exit_code == 0, shown.output
    assert "complete" in shown.output and "float16" in shown.output
    assert "reused index" not in runner.invoke(app, args + ["--force"]).output


def test_changed_dataset_builds_a_new_index(tmp_path, tiny_lora_dirs, dataset_path):
    base, adapter = tiny_lora_dirs
    common = ["-m", str(base), "-a", str(adapter), "-d", str(dataset_path)]
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    runner = CliRunner()
    one = runner.invoke(app, ["index", "-c", str(config), *common]).output.strip().splitlines()[-1]
    dataset_path.write_text(dataset_path.read_text() + json.dumps({"prompt": "hello", "completion": "world"}) + "\n")
    result = runner.invoke(app, ["index", "-c", str(config), *common])
    assert "built index" in result.output and "5 examples" in result.output
    assert result.output.strip().splitlines()[-1] != one


def test_bad_adapter_is_one_clear_error(tmp_path, tiny_lora_dirs, dataset_path):
    from gradian.cli import main

    base, _ = tiny_lora_dirs
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "-d", str(dataset_path), "-m", str(base), "-a", str(tmp_path)])
    assert exit_info.value.code == 2


def _gradian(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=180)


def test_damaged_files_are_reported_in_the_output_and_the_manifest_when_recomputed(tmp_path, tiny_lora_dirs,
                                                                                   dataset_path):
    """`gradian index` over a store with a damaged norms file (a flipped byte) and a damaged chunk
    (cut short) recomputes both chunks and says so: one line on stderr naming each file, what was
    wrong and that it was recomputed, and a record each in manifest.json."""
    base, adapter = tiny_lora_dirs
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\ngrads:\n  chunk_size: 2\n")
    args = ["index", "-c", str(config), "-d", str(dataset_path), "-m", str(base), "-a", str(adapter)]
    first = _gradian(*args)
    assert first.returncode == 0, first.stderr
    assert "repaired" not in first.stdout + first.stderr
    root = first.stdout.strip().splitlines()[-1]
    index_id = root.rsplit("/", 1)[-1]
    chunks = tmp_path / "cache" / "index" / index_id / "chunks"
    norms, data = chunks / "00000.norms.npy", chunks / "00001.npy"
    originals = {norms: norms.read_bytes(), data: data.read_bytes()}
    flipped = bytearray(originals[norms])
    flipped[-3] ^= 0x01
    norms.write_bytes(bytes(flipped))
    data.write_bytes(originals[data][:-17])
    problems = {norms: "damaged (its bytes do not match the sha256 recorded when it was written)",
                data: f"damaged ({len(originals[data]) - 17} bytes, {len(originals[data])} were written: "
                      "truncated or overwritten)"}

    second = _gradian(*args)
    assert second.returncode == 0, second.stderr
    assert "built index" in second.stdout and second.stdout.strip().splitlines()[-1] == root
    said = [line for line in second.stderr.splitlines() if "repaired" in line]
    assert said == [f"note: repaired index {index_id}: "
                    f"chunks/00000.norms.npy was {problems[norms]}: recomputed (chunk 0: its data and norms files); "
                    f"chunks/00001.npy was {problems[data]}: recomputed (chunk 1: its data and norms files)"], \
        second.stderr
    for path, before in originals.items():
        assert path.read_bytes() == before  # content-addressed: the same bytes again
    manifest = json.loads((chunks.parent / "manifest.json").read_text())
    assert [(r["file"], r["chunk"], r["problem"]) for r in manifest["repairs"]] == [
        (str(norms), 0, problems[norms]), (str(data), 1, problems[data])]
    assert all(r["action"].startswith("recomputed") for r in manifest["repairs"])
