"""projects/benchmarks/run_all.py: finding the scripts and reading their figures."""

from __future__ import annotations

import pytest

from tests.plugins.benchmarks import import_benchmark


@pytest.fixture(scope="module")
def run_all():
    return import_benchmark("run_all")


def test_every_bench_script_is_found(run_all):
    found = {p.name for p in run_all.discover()}
    assert {"bench_diagnose.py", "bench_grads.py"} <= found
    assert all(name.startswith("bench_") for name in found)


def test_figures_from_printed_lines(run_all):
    text = (
        "rows: 10000\n"
        "load dataset: 0.52 s, tokenize: 1.30 s\n"
        "slowest checks (each timed alone, tokenization included where needed):\n"
        "  data.near_duplicates                     2.11 s\n"
        "diagnose total: 3.21 s  ->  3,115 rows/second\n"
    )
    assert run_all.figures_from_text(text) == {
        "rows": 10000.0, "load_dataset_s": 0.52, "tokenize_s": 1.3, "data.near_duplicates_s": 2.11,
        "diagnose_total_s": 3.21, "rows_per_second": 3115.0,
    }


def test_figures_from_json(run_all):
    doc = {"capture": {"hooks_over_plain": 1.4, "vmap_error": "RuntimeError: x", "threads": 2},
           "datainf": {"n=2000": {"ms_per_example_per_query_1": 0.01}}, "ok": True, "nan": float("nan")}
    got = run_all.flatten_numbers(doc)
    assert got == {"capture.hooks_over_plain": 1.4, "capture.threads": 2.0,
                   "datainf.n_2000.ms_per_example_per_query_1": 0.01, "ok": 1.0}
    assert run_all._last_json('noise\n{"a": 1}\n') == {"a": 1}
    assert run_all._last_json("no json here") is None


def test_the_attribution_quality_figures_read_the_typed_cluster_rows():
    """bench_attribution_quality's figures from a ranking where the planted rows are the most
    harmful and their cluster carries most of the negative influence."""
    import pandas as pd

    from gradian.report.schema import ClusterRow

    bench = import_benchmark("bench_attribution_quality")
    rankings = pd.DataFrame({"row_index": range(6), "score": [-5.0, -4.0, 0.5, -0.5, 1.0, 2.0]})
    clusters = [ClusterRow(cluster="clean", label="clean", n=4, signed_influence=3.0, share_of_negative=0.05,
                           mean_per_example=0.75),
                ClusterRow(cluster="poison", label="poison", n=2, signed_influence=-9.0, share_of_negative=0.95,
                           mean_per_example=-4.5)]
    figures = bench.quality(rankings, clusters, planted={0, 1}, planted_cluster="poison")
    assert figures["auc"] == 1.0 and figures["top_k_precision"] == 1.0
    assert figures["planted_share_of_negative"] == 0.95
    assert figures["planted_cluster_rank"] == 1 and figures["planted_mean_rank"] == 1 and figures["n_clusters"] == 2


def test_lds_modes_read_engine_settings_and_need_a_fidelity_run(tmp_path):
    bench = import_benchmark("bench_lds_modes")
    assert bench.mode_overrides("default") == {}
    assert bench.mode_overrides("checkpoints=all+normalize_train=relatif") == {
        "engine.checkpoints": "all", "engine.normalize_train": "relatif"}
    with pytest.raises(SystemExit):
        bench.mode_overrides("checkpoints")
    with pytest.raises(bench.NoFidelityRun, match="no fidelity run of poison_capitals"):
        bench.measure(tmp_path, "poison_capitals", ["default"])


@pytest.mark.parametrize("args", [["--drops", "1.5"], ["--drops", "0"], ["--drops", "half"], ["--subsets", "2"]])
def test_replay_lds_refuses_bad_shares_and_subset_counts(args, capsys):
    """bench_replay_lds: a share outside (0, 1), one that is not a number, or fewer than 4 subsets
    exits 2 naming the flag, before any fine-tune."""
    bench = import_benchmark("bench_replay_lds")
    with pytest.raises(SystemExit) as stop:
        bench.main([*args, "--work", "/nonexistent/never-written"])
    assert stop.value.code == 2 and args[0].split("-")[-1] in capsys.readouterr().err
