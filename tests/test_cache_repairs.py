"""A cache that repairs itself says so: `gradian attribute` over a damaged index chunk or a damaged
fitted EK-FAC state recomputes what is damaged, ends as a clean run does (exit 0, the same
rankings), and names the repair on stderr and in report.json's manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

WORDS = "what is the capital of france paris japan tokyo".split()


def _gradian(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=300)


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _config(folder: Path, cache: Path) -> Path:
    config = folder / "gradian.yaml"
    config.write_text(f"cache_dir: {cache}\nevaluation:\n  require_significant: false\ngrads:\n  chunk_size: 4\n")
    return config


def _attribute(inputs: dict, config: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return _gradian("attribute", "-c", str(config), "-d", str(inputs["train"]), "-e", str(inputs["evals"]),
                    "-m", str(inputs["base"]), "-a", str(inputs["adapter"]), "--out", str(out), *extra)


def _rankings(out: Path):
    import pandas as pd

    frame = pd.read_parquet(out / "rankings.parquet")
    return frame[["example_id", "score", "rank_score", "harm_rank", "cluster"]].reset_index(drop=True)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_lora_dirs):
    """One clean `gradian attribute` (EK-FAC, cross-checked): its inputs, its cache and its report."""
    base, adapter = tiny_lora_dirs
    folder = tmp_path_factory.mktemp("clean_attribute")
    rows = [{"prompt": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4)), "completion": WORDS[i % len(WORDS)]}
            for i in range(12)]
    inputs = {"base": base, "adapter": adapter, "train": _write_jsonl(folder / "train.jsonl", rows),
              "evals": _write_jsonl(folder / "eval.jsonl",
                                    [{"prompt": f"capital of {w} ?", "completion": "paris"} for w in WORDS[:6]])}
    cache, out = folder / "cache", folder / "out"
    proc = _attribute(inputs, _config(folder, cache), out)
    assert proc.returncode == 0, proc.stderr
    assert "repaired" not in proc.stderr and "damaged" not in proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["manifest"]["engine_state"]["engine"] == "ekfac"
    assert report["manifest"]["index_manifest"]["repairs"] == [] and report["manifest"]["index"]["repaired"] == []
    return inputs, cache, out, report


def _own_cache(clean, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the clean run's cache and a config that points at it."""
    cache = tmp_path / "cache"
    shutil.copytree(clean[1], cache)
    return cache, _config(tmp_path, cache)


def test_force_over_a_damaged_fitted_state_refits_it_and_ranks_as_a_clean_run(clean, tmp_path):
    inputs, _, clean_out, clean_report = clean
    cache, config = _own_cache(clean, tmp_path)
    state_id = clean_report["manifest"]["engine_state"]["state_id"]
    _flip(cache / "engines" / state_id / "arrays.npz")
    out = tmp_path / "out"
    proc = _attribute(inputs, config, out, "--force")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # rich wraps the log lines at the console's width, inside words too: compare without whitespace
    said = "".join(proc.stderr.split())
    expected = (f"ekfac: the fitted state {state_id} in {cache / 'engines' / state_id} is damaged (arrays.npz does "
                "not match the sha256 state.json recorded")
    assert "".join(expected.split()) in said and "fittingitagain" in said, proc.stderr
    engine_state = json.loads((out / "report.json").read_text())["manifest"]["engine_state"]
    assert engine_state["state_id"] == state_id and engine_state["cache_hit"] is False
    assert engine_state["repaired"].startswith("arrays.npz does not match the sha256 state.json recorded")
    assert _rankings(out).equals(_rankings(clean_out))


def test_attribute_over_a_damaged_index_chunk_says_so_and_records_it_in_the_report(clean, tmp_path):
    inputs, _, clean_out, clean_report = clean
    cache, config = _own_cache(clean, tmp_path)
    index_id = clean_report["manifest"]["index"]["index_id"]
    chunk = cache / "index" / index_id / "chunks" / "00001.npy"
    _flip(chunk)
    out = tmp_path / "out"
    proc = _attribute(inputs, config, out)
    assert proc.returncode == 0, proc.stderr
    problem = "damaged (its bytes do not match the sha256 recorded when it was written)"
    line = (f"repaired index {index_id}: chunks/00001.npy was {problem}: "
            "recomputed (chunk 1: its data and norms files)")
    assert line in proc.stderr.splitlines(), proc.stderr
    manifest = json.loads((out / "report.json").read_text())["manifest"]
    (record,) = manifest["index_manifest"]["repairs"]
    assert record["file"] == str(chunk) and record["chunk"] == 1 and record["problem"] == problem
    assert record["action"].startswith("recomputed")
    assert manifest["index"]["repaired"] == [f"{chunk} was {problem}: {record['action']}"]  # this run's repairs
    assert manifest["engine_state"]["cache_hit"] is True  # the index is the same, so is its fitted state
    assert _rankings(out).equals(_rankings(clean_out))
