"""Streamed passes sharded over torchrun's processes: two gloo processes give one process's scores.

Ground truth is the same streamed EK-FAC (prime pass for the norms and Kronecker factors,
eigenvalue correction, scoring pass with RelatIF's self-influence) run by one plain process on the
same saved tiny Llama + LoRA in float64. The two-process run shards every pass (rank 0 chunks 0-2,
rank 1 chunks 3-5); its per-row outputs are placed exactly, its sums are added span by span, so
the scores agree to float64 rounding (relative 1e-12), and no per-example gradient is written. A
run killed in the scoring pass resumes with only the chunks it had not finished, and a finished
sharded pass is read back whole by one process. ``gradian attribute`` under torchrun with
``engine.store: stream`` ranks the rows as one process does, EK-FAC and its DataInf cross-check
alike. Every process runs with one thread, as torchrun sets for its workers, so thread-split float
sums cannot differ between the runs.

This file is also the worker the tests launch (``python -m torch.distributed.run ... <this file>``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: 22 rows in chunks of 4 (the last holds 2), batches of 3: rank 0 takes chunks 0-2, rank 1 chunks 3-5
N_ROWS, CHUNK, BATCH = 22, 4, 3


# -- the worker ---------------------------------------------------------------------------------------

def _work(config_path: str, out: str) -> None:
    """Prime, fit and score streamed EK-FAC on this process's share (all of it without torchrun);
    rank 0 writes the scores and the fitted arrays, every rank its stream's counters. With
    ``STOP_RANK``/``STOP_AFTER`` set, that rank stops after that many chunks, as a kill would."""
    from gradian.config import load_config
    from gradian.data import dataset_from_rows, load_dataset, tokenize_examples
    from gradian.distributed import join_shard_group
    from gradian.grads import capture_per_example_grads, collate, load_model_for_gradients
    from gradian.model_loading import load_tokenizer
    from tests.test_stream_resume import _attribute

    cfg = load_config(Path(config_path))
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.base_model)
    dataset = load_dataset(cfg.dataset)
    tokenized = tokenize_examples(dataset.examples, tokenizer, cfg.grads.max_seq_length)
    asked = tokenize_examples(dataset_from_rows([{"prompt": "what is item 3 ?", "completion": "item 3 is 4"},
                                                 {"prompt": "say hello", "completion": "hello"}]).examples,
                              tokenizer, 64)
    query = {k: v.detach().numpy() for k, v in capture_per_example_grads(gm, collate(asked, tokenizer.pad_token_id)).items()}
    with join_shard_group(None) as shard:
        rank = shard.rank if shard is not None else 0
        stop = int(os.environ["STOP_AFTER"]) if os.environ.get("STOP_RANK") == str(rank) else None
        stream, state, result = _attribute(cfg, gm, tokenizer, dataset, tokenized, query, stop_after=stop, shard=shard)
    Path(out).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        np.savez(Path(out) / "scores.npz", scores=result.scores, ranking=result.ranking,
                 **{f"state.{k}": v for k, v in state.arrays.items()})
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps({
        "passes": stream.passes, "rows_computed": stream.rows_computed, "chunks_resumed": stream.chunks_resumed,
        "factors_from": state.meta["factors_from"], "repaired": stream.repaired}))


if __name__ == "__main__":
    _work(sys.argv[1], sys.argv[2])
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch build has no torch.distributed with gloo", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(config: Path, out: Path, nproc: int | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    prefix = [sys.executable]
    if nproc:
        prefix += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                   "--master-port", str(_free_port())]
    environment = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false", MASTER_ADDR="127.0.0.1",
                       PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        environment.pop(name, None)
    return subprocess.run([*prefix, __file__, str(config), str(out)], env=environment, capture_output=True, text=True,
                          timeout=240)


def _ran(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _read(out: Path) -> tuple[dict[str, np.ndarray], list[dict[str, object]]]:
    with np.load(out / "scores.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    return arrays, [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_lora_dirs):
    base, adapter = tiny_lora_dirs
    folder = tmp_path_factory.mktemp("stream-sharded")
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is item {i} ?", "completion": f"item {i} is {i % 5}"}) + "\n"
                            for i in range(N_ROWS)))

    def config(cache: str) -> Path:
        path = folder / f"{cache}.yaml"
        path.write_text(f"cache_dir: {folder / cache}\nbase_model: {base}\nadapter_path: {adapter}\ndataset: {data}\n"
                        f"dtype: float64\ndevice: cpu\nengine:\n  name: ekfac\n  store: stream\n"
                        f"grads:\n  chunk_size: {CHUNK}\n  batch_size: {BATCH}\n  max_seq_length: 64\n")
        return path

    return folder, config


@pytest.fixture(scope="module")
def single(inputs):
    folder, config = inputs
    _ran(_launch(config("single"), folder / "single-out"))
    return _read(folder / "single-out")


@pytest.fixture(scope="module")
def sharded(inputs):
    folder, config = inputs
    _ran(_launch(config("sharded"), folder / "sharded-out", nproc=2))
    return _read(folder / "sharded-out")


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * float(np.abs(want).max()))


@pytest.mark.slow
def test_two_gloo_processes_score_what_one_process_scores(inputs, single, sharded):
    folder, _ = inputs
    (want, [one]), (got, ranks) = single, sharded
    assert set(got) == set(want) and want["scores"].shape == (N_ROWS, 2)
    # the influence scores and the RelatIF ranking; the eigenbases themselves are not compared: a
    # factor of these few tokens has a null space, whose basis eigh picks freely from the last bits
    # of the sums, while the scores do not depend on it
    _close(got["scores"], want["scores"])
    _close(got["ranking"], want["ranking"])
    # each rank computed its own span in each of the three passes, and nothing else
    assert [r["rows_computed"] for r in ranks] == [3 * 3 * CHUNK, 3 * (N_ROWS - 3 * CHUNK)]
    assert [r["passes"] for r in ranks] == [3, 3] and one["passes"] == 3
    assert all(r["factors_from"] == "index build" for r in ranks)
    # no per-example gradient is written: only the passes' per-row outputs and sums, and no index
    cache = folder / "sharded"
    assert not (cache / "index").exists()
    rows_files = sorted(cache.rglob("rows-*.npz"))
    assert len(rows_files) == 2 * 6  # prime (norms) and scoring (scores, self-influence), one per chunk
    for path in rows_files:
        with np.load(path) as npz:
            for key in npz.files:
                assert npz[key].ndim <= 2 and npz[key].shape[0] <= CHUNK and npz[key].size <= 2 * CHUNK, (path, key)
    # rank 0 recorded every pass whole: no rank's span record is left
    assert not list(cache.rglob("progress-*.json")) and len(list(cache.rglob("progress.json"))) == 3


@pytest.mark.slow
def test_a_finished_sharded_pass_is_read_back_by_one_process(inputs, sharded):
    folder, config = inputs
    _ran(_launch(config("sharded"), folder / "reread-out"))
    got, [one] = _read(folder / "reread-out")
    assert one["passes"] == 0 and one["rows_computed"] == 0 and one["chunks_resumed"] == 3 * 6
    for name, value in sharded[0].items():
        assert np.array_equal(got[name], value), name


@pytest.mark.slow
def test_a_sharded_run_killed_in_the_scoring_pass_resumes_with_the_chunks_left(inputs, sharded):
    folder, config = inputs
    cut = config("cut")
    # rank 1 stops right after the first chunk of its scoring span (3 prime, 3 correction, 1 score)
    stopped = _launch(cut, folder / "cut-out", nproc=2, STOP_RANK="1", STOP_AFTER="7")
    assert stopped.returncode != 0 and "Interrupted: 7" in stopped.stderr, stopped.stderr[-3000:]
    assert not (folder / "cut-out" / "scores.npz").exists()
    _ran(_launch(cut, folder / "cut-out", nproc=2))
    got, ranks = _read(folder / "cut-out")
    # the prime and correction passes were finished and are read back; of the scoring pass, rank
    # 0's span was kept whole and rank 1 computes its last two chunks (4 + 2 rows)
    assert [r["rows_computed"] for r in ranks] == [0, N_ROWS - 4 * CHUNK]
    assert [r["passes"] for r in ranks] == [0, 1]
    for name, value in sharded[0].items():
        assert np.array_equal(got[name], value), name


def _attribute_cli(tmp_path: Path, tiny_lora_dirs, name: str, nproc: int | None, engine_yaml: str,
                   grads_yaml: str = "") -> tuple:
    """``gradian attribute`` (under torchrun with ``nproc`` processes) on 12 rows: its process,
    report.json and rankings."""
    import pandas as pd

    base, adapter = tiny_lora_dirs
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"what is item {i} ?", "completion": f"item {i} is {i % 5}",
                                         "cluster": "ab"[i % 2]}) + "\n" for i in range(12)))
    evals.write_text("".join(json.dumps({"prompt": f"what is item {i} ?", "completion": f"item {i} is {i % 5}"}) + "\n"
                             for i in range(4)))
    config = tmp_path / f"{name}.yaml"
    config.write_text(f"cache_dir: {tmp_path / name}\ndtype: float64\ndevice: cpu\n"
                      f"engine:\n{engine_yaml}grads:\n  chunk_size: 4\n  batch_size: 2\n{grads_yaml}"
                      "evaluation:\n  metric: contains\n  require_significant: false\n  max_new_tokens: 2\n"
                      "  n_bootstrap: 50\nclustering:\n  method: declared\n  explain_top_accused: 0\n")
    prefix = [sys.executable, "-m", "gradian"]
    if nproc:
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                  "127.0.0.1", "--master-port", str(_free_port()), "-m", "gradian"]
    environment = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false")
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        environment.pop(variable, None)
    done = subprocess.run([*prefix, "attribute", "-c", str(config), "-m", str(base), "-a", str(adapter),
                           "-d", str(train), "-e", str(evals), "--engine", "ekfac", "--cross-check", "datainf",
                           "-o", str(tmp_path / f"{name}-out")], env=environment, capture_output=True, text=True,
                          timeout=300)
    _ran(done)
    assert done.stdout.count("Verdict") == 1  # rank 1 leaves after its last sharded work
    report = json.loads((tmp_path / f"{name}-out" / "report.json").read_text())
    return done, report, pd.read_parquet(tmp_path / f"{name}-out" / "rankings.parquet").set_index("example_id")


@pytest.mark.slow
def test_attribute_under_torchrun_streams_on_both_ranks_and_ranks_what_one_process_ranks(tmp_path, tiny_lora_dirs):
    def attribute(name: str, nproc: int | None):
        _, report, rankings = _attribute_cli(tmp_path, tiny_lora_dirs, name, nproc, "  store: stream\n")
        assert not (tmp_path / name / "index").exists()
        assert report["manifest"]["index_manifest"]["processes"] == (nproc or 1)
        return rankings

    sharded, single = attribute("sharded", 2), attribute("single", None)
    assert list(sharded.index) == list(single.index)
    for column in ("score", "cross_check_score"):
        _close(sharded[column].to_numpy(), single[column].to_numpy())


@pytest.mark.slow
def test_store_auto_under_torchrun_streams_past_the_index_limit_and_shards_the_index_below_it(tmp_path,
                                                                                               tiny_lora_dirs):
    """Under torchrun, ``engine.store: auto`` is rank 0's choice for both ranks: an index over
    grads.max_index_gb is streamed, every pass sharded; one that fits is built by both ranks,
    each its share of the chunks and the Kronecker factor sums of its share, and rank 0 fits (with
    no factor pass of its own) and scores over it. Both rank as one process."""
    done, streamed, streamed_rows = _attribute_cli(tmp_path, tiny_lora_dirs, "over", 2, "  store: auto\n",
                                                   "  max_index_gb: 0.000000001\n")
    assert not (tmp_path / "over" / "index").exists() and "over grads.max_index_gb" in done.stderr
    assert streamed["manifest"]["index"]["store"] == "stream"
    assert streamed["manifest"]["index_manifest"]["processes"] == 2
    done, indexed, indexed_rows = _attribute_cli(tmp_path, tiny_lora_dirs, "fits", 2, "  store: auto\n")
    assert indexed["manifest"]["index"]["store"] == "index" and (tmp_path / "fits" / "index").is_dir()
    # each rank gathered the factors of its share of the chunks on the way, so the fit on rank 0
    # made no factor pass of its own over the whole data
    assert "ekfac: fitted state" in done.stderr and "Kronecker factors came from the gradients' own pass" in done.stderr
    _, _, single = _attribute_cli(tmp_path, tiny_lora_dirs, "single", None, "  store: index\n")
    for rows in (streamed_rows, indexed_rows):
        assert list(rows.index) == list(single.index)
        for column in ("score", "cross_check_score"):
            _close(rows[column].to_numpy(), single[column].to_numpy())
