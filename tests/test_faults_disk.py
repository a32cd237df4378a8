"""A full disk and unwritable folders: refused before the work, or stopped cleanly part way.

- An index whose missing chunks need more bytes than the cache folder's disk has free is refused
  before any chunk is computed (exit 3, one line naming cache_dir, the bytes needed and free, and
  the settings that shrink it); the estimate is exactly the bytes a build writes.
- A disk that fills up while a chunk is written stops the build (exit 3, one line): the chunks
  before it stay whole and recorded, the partial chunk and its ``.tmp`` are gone, the manifest
  says ``building``, and the next build computes only the missing chunks.
- A disk that fills up while a report is written leaves none of that report's files (never a
  report.json without its html or its rankings), and exits 3 with one line.
- ``gradian train --out`` and ``gradian explain``'s cache_dir are checked before any model loads.
- Fewer eval items than ``evaluation.min_items``: the capability block says so.

The full disk is played by the write raising ``OSError(ENOSPC)``, through the real console entry
in this process (so the monkeypatch reaches it) or the function that writes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from gradian.errors import DiskFullError
from tests.test_faults_door import ROW, gradian, only_line, write_jsonl

_Usage = namedtuple("_Usage", "total used free")
_WORDS = "what is the capital of france paris japan tokyo".split()


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _succeed(argv: list[str], capsys) -> str:
    """``gradian argv`` in this process, which must succeed; its stdout."""
    from gradian.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    assert info.value.code in (0, None), captured.err
    return captured.out


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """``gradian argv`` in this process: (exit code, the one error line, checked for shape)."""
    from gradian.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return info.value.code, errors[0]


@pytest.fixture
def index_inputs(tmp_path, tiny_lora_dirs):
    """The index command's arguments for a 12-row dataset in 3 chunks of 4, and its cache folder."""
    base, adapter = tiny_lora_dirs
    rows = [{"prompt": " ".join(_WORDS[(i + k) % len(_WORDS)] for k in range(4)), "completion": _WORDS[i % len(_WORDS)]}
            for i in range(12)]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    cache = tmp_path / "cache"
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {cache}\ngrads:\n  chunk_size: 4\n  batch_size: 3\n")
    return ["index", "-c", str(config), "-d", str(train), "-m", str(base), "-a", str(adapter)], cache


def _index_root(cache: Path) -> Path:
    (root,) = [p.parent for p in (cache / "index").glob("*/manifest.json")]
    return root


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- free disk, before the build -----------------------------------------------------------------


def test_an_index_larger_than_the_free_disk_is_refused_before_any_chunk(index_inputs, monkeypatch, capsys):
    import gradian.data
    import gradian.index.build as store

    argv, cache = index_inputs
    computed, tokenized = [], []
    monkeypatch.setattr(store, "compute_chunks", lambda *a, **k: computed.append(a))
    real_tokenize = gradian.data.tokenize_examples
    monkeypatch.setattr(gradian.data, "tokenize_examples", lambda *a, **k: (tokenized.append(1), real_tokenize(*a, **k))[1])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10**9, 10**9 - 1000, 1000))
    code, line = _run(argv, capsys)
    assert code == 3
    assert f"under cache_dir {cache}:" in line and "need " in line and "and 1000 B is free; nothing was computed" in line, line
    for fix in ("cache_dir to a folder on a bigger disk", "grads.storage_dtype: float16",
                "grads.projection_dim with engine.name: datainf", "`gradian plan --disk <size>`"):
        assert fix in line, fix
    assert computed == [] and tokenized == []  # refused before the tokenizer ran, let alone a gradient
    assert not list(cache.glob("index/*/chunks/*.npy"))


def test_the_disk_estimate_is_the_bytes_a_build_writes(index_inputs, capsys):
    from gradian.config import load_config
    from gradian.index.build import BuildTarget, _chunk_bytes

    argv, cache = index_inputs
    _succeed(argv, capsys)
    root = _index_root(cache)
    manifest = json.loads((root / "manifest.json").read_text())
    target = BuildTarget(root=root, lock=root, index_id=manifest["index_id"], identity=manifest["identity"],
                     blocks=manifest["blocks"], total_width=manifest["total_width"], gm=None, tokenizer=None,
                     dataset=list(range(manifest["n_examples"])),
                     config=load_config(overrides={"grads.chunk_size": 4}))
    for k in range(manifest["n_chunks"]):
        on_disk = sum((root / "chunks" / f"{k:05d}{suffix}").stat().st_size for suffix in (".npy", ".norms.npy"))
        assert _chunk_bytes(target, k) == on_disk


# -- a disk that fills up during the build -------------------------------------------------------


def test_a_disk_full_mid_index_keeps_the_whole_chunks_and_the_rerun_resumes(index_inputs, monkeypatch, capsys):
    import gradian.index.build as store
    from gradian.atomic import atomic_open
    from gradian.index import GradientIndex

    argv, cache = index_inputs
    real_write = store.write_bytes_atomic

    def fills_up_on_chunk_1(path, data):
        if path.name == "00001.npy":
            with atomic_open(path) as handle:  # half the bytes land in the .tmp, then the disk is full
                handle.write(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data)

    monkeypatch.setattr(store, "write_bytes_atomic", fills_up_on_chunk_1)
    code, line = _run(argv, capsys)
    root = _index_root(cache)
    assert code == 3
    assert (f"the disk under cache_dir {cache} filled up while chunk 1 of the gradient index {root} was written: "
            "the partial chunk was removed and the 1 of 3 chunks already written are kept") in line, line
    assert "for the 2 chunk(s) left" in line and "run the same command again to resume" in line, line

    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["status"] == "building" and manifest["n_chunks_done"] == 1
    record = manifest["chunks"][0]
    assert manifest["chunks"][1:] == [None, None]
    assert _sha256(root / "chunks" / "00000.npy") == record["sha256"]
    assert _sha256(root / "chunks" / "00000.norms.npy") == record["norms_sha256"]
    assert sorted(p.name for p in (root / "chunks").iterdir()) == ["00000.norms.npy", "00000.npy"]  # no .tmp
    assert not list(root.glob(".*.tmp"))

    monkeypatch.setattr(store, "write_bytes_atomic", real_write)
    written = []
    real_chunk = store._write_chunk
    monkeypatch.setattr(store, "_write_chunk", lambda r, k, rows, s: (written.append(k), real_chunk(r, k, rows, s))[1])
    assert "built index" in _succeed(argv, capsys)
    assert written == [1, 2]  # chunk 0 was kept, not computed again
    index = GradientIndex.open(root)
    index.verify()
    assert index.manifest["status"] == "complete" and index.manifest["chunks"][0] == record


def test_a_disk_full_while_recording_a_chunk_is_the_same_clean_stop(index_inputs, monkeypatch, capsys):
    """The chunk's files landed but the manifest that records them did not: the chunk is not kept."""
    import gradian.index.build as store

    argv, cache = index_inputs
    real_manifest = store.write_manifest
    calls = []

    def fills_up_on_the_second_record(path, manifest):
        calls.append(manifest["n_chunks_done"])
        if manifest["status"] == "building" and manifest["n_chunks_done"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_manifest(path, manifest)

    monkeypatch.setattr(store, "write_manifest", fills_up_on_the_second_record)
    code, line = _run(argv, capsys)
    root = _index_root(cache)
    assert code == 3 and "while chunk 1 of the gradient index" in line and "1 of 3 chunks" in line, line
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["n_chunks_done"] == 1 and manifest["chunks"][1] is None
    assert sorted(p.name for p in (root / "chunks").iterdir()) == ["00000.norms.npy", "00000.npy"]


def test_disk_full_is_an_environment_error_that_is_also_an_oserror():
    err = DiskFullError("x")
    assert err.exit_code == 3 and isinstance(err, OSError)


# -- a disk that fills up while the report is written --------------------------------------------


def _fsync_fails_after(monkeypatch, n_ok: int) -> None:
    """The ``n_ok + 1``-th fsync of this test raises ENOSPC: the disk fills up part way."""
    real_fsync = os.fsync
    count = {"n": 0}

    def fsync(fd):
        count["n"] += 1
        if count["n"] > n_ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_report_write_that_fills_the_disk_leaves_no_file_of_it(tmp_path, monkeypatch):
    from gradian.report import write_report
    from tests.test_report import _logs, full_report

    report, rankings = full_report()
    out = tmp_path / "out"
    tables = {"rankings.parquet": b"PAR1 rankings", "accused.parquet": b"PAR1 accused"}
    _fsync_fails_after(monkeypatch, 4)  # json, md, html and one plot are on disk; the rest is not
    with pytest.raises(DiskFullError) as info:
        write_report(report, out, rankings=rankings, logs=_logs(), extra_files=tables)
    message = str(info.value)
    assert f"the disk under {out} filled up while the report was written (9 files" in message, message
    assert "none of this report's files were written; free space or pass another --out" in message
    assert "\n" not in message and info.value.exit_code == 3
    assert not out.exists()  # the folder this write created is gone again
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_failed_report_write_keeps_the_previous_report_whole(tmp_path, monkeypatch):
    from gradian.report import write_report
    from tests.test_report import _logs, full_report

    report, rankings = full_report()
    out = tmp_path / "out"
    first = write_report(report, out, rankings=rankings, logs=_logs())
    before = {p: p.read_bytes() for p in first}
    report["verdict"] = dict(report["verdict"], summary="a second report")
    _fsync_fails_after(monkeypatch, 2)
    with pytest.raises(DiskFullError):
        write_report(report, out, rankings=rankings, logs=_logs(), extra_files={"rankings.parquet": b"PAR1"})
    assert {p: p.read_bytes() for p in first} == before  # every file of the first report, unchanged
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == sorted(p.name for p in first)


def test_diagnose_on_a_full_disk_exits_3_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", [ROW, {"prompt": "and japan ?", "completion": "tokyo"}])
    out = tmp_path / "out"
    _fsync_fails_after(monkeypatch, 1)
    code, line = _run(["diagnose", "-d", str(data), "--out", str(out)], capsys)
    assert code == 3 and f"the disk under {out} filled up while the report was written (3 files" in line, line
    assert not out.exists()


# -- train and explain check their folders before loading a model -------------------------------


def test_train_refuses_an_out_that_is_a_file_before_loading_anything(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    config = tmp_path / "gradian.yaml"
    config.write_text("base_model: no/such-model\n")
    line = only_line(gradian("train", "-c", str(config), "--out", str(blocker)))
    assert f"--out {blocker} is an existing file, not a folder" in line, line
    config.write_text(f"base_model: no/such-model\ntrain:\n  output_dir: {blocker / 'run'}\n")
    line = only_line(gradian("train", "-c", str(config)))
    assert f"train.output_dir {blocker / 'run'}: {blocker} is a file" in line, line
    assert blocker.read_text() == "keep me"


def test_train_on_a_read_only_folder_is_an_environment_error(tmp_path, monkeypatch, capsys):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    config = tmp_path / "gradian.yaml"
    config.write_text("base_model: no/such-model\n")
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    code, line = _run(["train", "-c", str(config), "--out", str(tmp_path / "run")], capsys)
    assert code == 3
    assert line == (f"error: --out {tmp_path / 'run'} cannot be written ({tmp_path}: a read-only filesystem); "
                    "pass a folder you can write to")


def test_explain_refuses_a_cache_dir_that_is_a_file_before_loading_anything(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    report = tmp_path / "report"
    report.mkdir()
    # a report whose dataset and model do not exist: the folder check must come first
    (report / "report.json").write_text(json.dumps({"verdict": {"kind": "data", "summary": ""}, "manifest": {"kind": "attribute",
        "config": {"cache_dir": str(blocker), "base_model": "no/such-model", "dataset": str(tmp_path / "none.jsonl")}}}))
    line = only_line(gradian("explain", "--report", str(report), "--example-id", "x"))
    assert f"cache_dir {blocker} is an existing file, not a folder" in line, line


# -- too few eval items --------------------------------------------------------------------------


def _capability(n: int, min_items: int | None):
    from gradian.evaluate.capability import summarize_capability
    from gradian.evaluate.result import ItemResult

    items = [ItemResult(example_id=f"e{i}", index=i, prompt="q", wanted="a", base_score=1.0, tuned_score=0.0,
                        base_correct=True, tuned_correct=False, flipped=True) for i in range(n)]
    return summarize_capability(items, name="capitals", metric="exact_match", n_bootstrap=200, min_items=min_items)


@pytest.mark.parametrize("n, too_few", [(1, True), (4, True), (5, False)])
def test_the_capability_block_says_when_there_are_too_few_items(n, too_few):
    from gradian.report import render_html, render_markdown
    from gradian.report.schema import Capability

    result = _capability(n, min_items=5)
    block = result.to_full_dict()
    assert block["status"] == "regressed" and block["too_few_items"] is too_few and block["min_items"] == 5
    assert Capability.from_json(json.loads(json.dumps(block)), "capability").too_few_items is too_few
    words = f"(too few items: {n}, fewer than evaluation.min_items=5)"
    report = {"verdict": {"kind": "inconclusive", "summary": ""}, "capability": block, "findings": []}
    assert (words in render_markdown(report)) is too_few
    assert (words in render_html(report)) is too_few


def test_without_a_minimum_no_capability_is_too_few():
    assert _capability(1, min_items=None).too_few_items is False
