"""Sharded index builds: two gloo processes under torchrun store exactly what one process stores.

The torchrun tests launch ``python -m torch.distributed.run --nproc-per-node 2 -m gradian index``
on CPU (gloo) against a tiny saved Llama + LoRA, and compare the store byte for byte with a
plain ``python -m gradian index`` of the same inputs. Every process runs with one thread, as
torchrun sets for its workers, so thread-split float sums cannot differ between the two builds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradian.config import EngineConfig, load_config  # noqa: E402
from gradian.data import dataset_from_rows  # noqa: E402
from gradian.engines import score  # noqa: E402
from gradian.grads import wrap_peft_model  # noqa: E402
from gradian.index import GradientIndex  # noqa: E402
from gradian.index.sharded import shard_of  # noqa: E402
from tests.plugins.tiny_lora import build_tiny_lora  # noqa: E402

WORDS = "what is the capital of france paris japan tokyo hello world one two three four five".split()

#: 9 rows in chunks of 3, batches of 2: rank 0 computes chunk 0 (rows 0-2), rank 1 chunks 1-2
#: (rows 3-8), so rank 1's first row is odd and a batching that ran across chunk boundaries
#: would pad its rows differently from the single-process build
N_ROWS, CHUNK, BATCH = 9, 3, 2


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    # lengths vary, so rows in one batch are padded
    return [{"prompt": " ".join(rng.choice(WORDS, 2 + i % 4)), "completion": " ".join(rng.choice(WORDS, 1 + i % 3))}
            for i in range(n)]


# -- without processes ------------------------------------------------------------------------------

def test_shards_are_contiguous_and_cover_the_work_once():
    todo = [0, 1, 2, 5, 6, 7, 8]
    shards = [shard_of(todo, r, 3) for r in range(3)]
    assert shards == [[0, 1], [2, 5], [6, 7, 8]]
    assert shard_of([4], 0, 2) == [] and shard_of([4], 1, 2) == [4]


def test_without_torchrun_there_is_no_group_and_distributed_is_refused(tmp_path, monkeypatch, capsys):
    from gradian.cli import main
    from gradian.distributed import join_shard_group

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with join_shard_group(None) as group:
        assert group is None
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "-c", str(config), "--distributed", "-d", "x.jsonl", "-a", "adapter"])
    assert exit_info.value.code == 2
    assert "--distributed: this process was not started by torchrun" in capsys.readouterr().err


def test_a_build_interrupted_across_ranks_resumes_in_one_process(tmp_path, chat_tokenizer, monkeypatch):
    """The chunk records a killed sharded build leaves are taken as done; only the rest is computed."""
    import gradian.index.build as store

    gm = wrap_peft_model(build_tiny_lora("llama", dtype=torch.float64))
    dataset = dataset_from_rows(_rows(N_ROWS))
    config = load_config(overrides={"cache_dir": str(tmp_path), "grads.chunk_size": CHUNK,
                                    "grads.batch_size": BATCH, "grads.max_seq_length": 64})
    complete = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    reference = {name: complete.block(name).copy() for name in complete.block_names}
    _leave_as_killed(complete.root, finished=[0, 1])
    written = []
    original = store._write_chunk
    monkeypatch.setattr(store, "_write_chunk",
                        lambda root, k, rows, s: (written.append(k), original(root, k, rows, s))[1])
    resumed = GradientIndex.build(gm, chat_tokenizer, dataset, config)
    assert written == [2] and not resumed.cache_hit
    assert not list((resumed.root / "chunks").glob("*.record.json"))
    for name in resumed.block_names:
        np.testing.assert_array_equal(GradientIndex.open(resumed.root).block(name), reference[name])


def _leave_as_killed(root, finished):
    """Turn a complete store into what a sharded build leaves when its ranks are killed after
    ``finished``: a ``building`` manifest that records no chunk (rank 0 commits them at the end),
    a chunk record beside each finished chunk, nothing of the others but a half-written file."""
    from gradian.index.build import write_chunk_record
    from gradian.index.integrity import write_manifest

    manifest = json.loads((root / "manifest.json").read_text())
    records = manifest["chunks"]
    manifest.update(status="building", chunks=[None] * manifest["n_chunks"], n_chunks_done=0)
    for key in ("build_seconds", "bytes", "bytes_per_example", "checksum"):
        manifest.pop(key, None)
    write_manifest(root / "manifest.json", manifest)
    for k, record in enumerate(records):
        if k in finished:
            write_chunk_record(root, k, record)
        else:
            (root / "chunks" / f"{k:05d}.npy").unlink()
            (root / "chunks" / f"{k:05d}.norms.npy").unlink()
            (root / "chunks" / f".{k:05d}.npy.a1b2.tmp").write_bytes(b"half")


# -- two processes under torchrun -------------------------------------------------------------------

def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", MASTER_ADDR="127.0.0.1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _index(args, nproc=None):
    prefix = [sys.executable, "-m", "gradian"]
    if nproc:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                  "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "gradian"]
    done = subprocess.run([*prefix, "index", *args], env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    folder = tmp_path_factory.mktemp("sharded")
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(N_ROWS)))

    def args(cache):
        config = folder / f"{cache}.yaml"
        config.write_text(f"cache_dir: {folder / cache}\ndevice: auto\n"
                          f"grads:\n  chunk_size: {CHUNK}\n  batch_size: {BATCH}\n  max_seq_length: 64\n")
        return ["-c", str(config), "-d", str(data), "-m", str(base), "-a", str(adapter)]

    return args


@pytest.fixture(scope="module")
def single(inputs):
    out = _index(inputs("single"))
    return GradientIndex.open(out.strip().splitlines()[-1])


def _manifest_without_times(index):
    manifest = json.loads((index.root / "manifest.json").read_text())
    for key in ("created_at", "build_seconds", "checksum"):
        manifest.pop(key)
    manifest.pop("repairs", None)  # what this build repaired: the resumed one did, the clean one did not
    return manifest


def _chunk_files(root):
    return {p.name: p for p in sorted((root / "chunks").iterdir())}


def _written_at(root):
    """Each chunk file's (inode, mtime): a file written again is a new inode, a new mtime or both."""
    return {name: (path.stat().st_ino, path.stat().st_mtime_ns) for name, path in _chunk_files(root).items()}


@pytest.fixture(scope="module")
def sharded_output(inputs):
    return _index(inputs("sharded"), nproc=2)


@pytest.mark.slow
def test_two_gloo_processes_build_the_single_process_index_bit_for_bit(sharded_output, single):
    out = sharded_output
    assert out.count("built index") == 1 and "reused" not in out  # rank 0 reports, rank 1 prints nothing
    sharded = GradientIndex.open(out.strip().splitlines()[-1])
    assert sharded.root.name == single.root.name  # the same content address
    assert _manifest_without_times(sharded) == _manifest_without_times(single)  # identity, checksums, sizes
    files, reference = _chunk_files(sharded.root), _chunk_files(single.root)
    assert list(files) == list(reference) == [f"{k:05d}{suffix}" for k in range(3) for suffix in (".norms.npy", ".npy")]
    for name, path in files.items():
        assert path.read_bytes() == reference[name].read_bytes(), name
    assert (sharded.root / "example_ids.json").read_bytes() == (single.root / "example_ids.json").read_bytes()

    rng = np.random.default_rng(1)
    query = {b["name"]: rng.standard_normal(b["width"]) for b in single.manifest["blocks"]}
    for engine in ("graddot", "datainf"):
        np.testing.assert_array_equal(score(sharded, query, EngineConfig(name=engine)).scores,
                                      score(single, query, EngineConfig(name=engine)).scores)


@pytest.mark.slow
def test_an_interrupted_sharded_build_resumes_computing_only_what_is_missing_or_damaged(inputs, single,
                                                                                       sharded_output):
    import shutil

    args = inputs("resumed")
    folder = single.root.parent.parent.parent
    shutil.copytree(folder / "sharded", folder / "resumed")
    root = folder / "resumed" / "index" / single.root.name
    # the sharded build as if rank 1 were killed after its first chunk (chunk 1; chunk 2 never
    # written), and chunk 0's data damaged on disk since
    _leave_as_killed(root, finished=[0, 1])
    data = bytearray((root / "chunks" / "00000.npy").read_bytes())
    data[-3] ^= 0x40
    (root / "chunks" / "00000.npy").write_bytes(bytes(data))
    before = _written_at(root)

    out = _index(args, nproc=2)
    assert "built index" in out
    after = _written_at(root)
    # no chunk record or half-written file is left
    assert list(after) == [f"{k:05d}{suffix}" for k in range(3) for suffix in (".norms.npy", ".npy")]
    # chunk 1 kept as it was; chunk 0 (rank 0's share now) and chunk 2 (rank 1's) written anew
    assert {name for name in after if before.get(name) != after[name]} == {
        "00000.npy", "00000.norms.npy", "00002.npy", "00002.norms.npy"}
    resumed = GradientIndex.open(root)
    assert _manifest_without_times(resumed) == _manifest_without_times(single)
    for name, path in _chunk_files(resumed.root).items():
        assert path.read_bytes() == _chunk_files(single.root)[name].read_bytes(), name


@pytest.mark.slow
def test_attribute_under_torchrun_indexes_on_both_ranks_and_reports_once(tmp_path, tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps(r | {"cluster": "ab"[i % 2]}) + "\n" for i, r in enumerate(_rows(12))))
    evals.write_text("".join(json.dumps({"prompt": f"what is the capital of {w} ?", "completion": w}) + "\n"
                             for w in ("paris", "tokyo", "france", "japan")))
    config = tmp_path / "gradian.yaml"
    config.write_text(f"cache_dir: {tmp_path / 'cache'}\ngrads:\n  chunk_size: 4\n  batch_size: 2\n"
                      "evaluation:\n  metric: contains\n  require_significant: false\n  max_new_tokens: 2\n"
                      "  n_bootstrap: 50\nclustering:\n  method: declared\n  explain_top_accused: 0\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), "-m", "gradian", "attribute", "-c", str(config), "-m", str(base),
               "-a", str(adapter), "-d", str(train), "-e", str(evals), "--engine", "graddot", "--cross-check", "none",
               "-o", str(tmp_path / "out")]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("Verdict") == 1  # rank 1 left after the index
    stored = [p.parent for p in (tmp_path / "cache" / "index").glob("*/manifest.json")]
    assert len(stored) == 1  # rank 0's pipeline found the sharded index, it built no other
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    on_disk = json.loads((stored[0] / "manifest.json").read_text())
    assert report["manifest"]["index_manifest"] == on_disk and on_disk["status"] == "complete"


def test_a_rank_s_full_disk_ends_every_rank_with_exit_code_3():
    from gradian.errors import ConfigError, DiskFullError
    from gradian.index.sharded import ShardedBuildError, _exit_code, _raise_first_failure

    assert _exit_code(DiskFullError("full")) == 3 and _exit_code(ConfigError("bad")) == 2
    assert _exit_code(RuntimeError("bug")) == 70
    outcomes = [{"records": {}, "error": None},
                {"records": {}, "error": "no space left on /cache", "exit_code": _exit_code(DiskFullError("x"))}]
    with pytest.raises(ShardedBuildError, match="rank 1 of the sharded index build failed") as caught:
        _raise_first_failure(outcomes)
    assert caught.value.exit_code == 3
