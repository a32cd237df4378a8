"""The attribute pipeline end to end on a tiny random model: plumbing, files, rankings, errors.

Whether the verdict is right is tested on tinyworld (tests/test_attribute_tinyworld.py); here the
model is random, so only the shape of what comes out, and its consistency, is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

WORDS = "paris tokyo hello world yes no one two three four five".split()


@pytest.fixture
def data_files(tmp_path):
    train = tmp_path / "train.jsonl"
    rows = [{"prompt": f"what is the capital of {WORDS[i % 3]} ?", "completion": f"{WORDS[(i * 7) % len(WORDS)]} {WORDS[i % 5]}",
             "cluster": "a" if i < 8 else "b"} for i in range(20)]
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    evals = tmp_path / "eval.jsonl"
    evals.write_text("\n".join(json.dumps({"prompt": f"what is the capital of {w} ?", "completion": w})
                               for w in ("paris", "tokyo", "france", "japan")) + "\n")
    return train, evals


def make_config(tmp_path, base_dir, adapter_dir, train, evals, **extra):
    from gradian.config import load_config

    overrides = {
        "base_model": str(base_dir), "adapter_path": str(adapter_dir), "dataset": str(train),
        "eval_dataset": str(evals), "cache_dir": str(tmp_path / "cache"), "evaluation.metric": "contains",
        "evaluation.require_significant": False, "evaluation.max_new_tokens": 4, "evaluation.n_bootstrap": 200,
        "clustering.method": "declared", "grads.batch_size": 4, "grads.chunk_size": 8,
    }
    overrides.update(extra)
    return load_config(overrides=overrides)


def test_pipeline_writes_a_consistent_report(tmp_path, tiny_lora_dirs, data_files):
    from gradian.attribution import run_attribution

    base_dir, adapter_dir = tiny_lora_dirs
    # no item flips on this random adapter, so with query_scope flipped the query is the whole eval
    # set (4 items); under the default (lost) it would be the items whose answer lost likelihood
    cfg = make_config(tmp_path, base_dir, adapter_dir, *data_files, **{"evaluation.query_scope": "flipped"})
    out = tmp_path / "out"
    outcome = run_attribution(cfg, capability="capitals", out_dir=out)
    report = json.loads((out / "report.json").read_text())
    assert json.loads(json.dumps(outcome.report.to_json())) == report  # what was returned is what was written
    assert report["capability"]["name"] == "capitals" and report["capability"]["n_items"] == 4
    attr = report["attribution"]
    assert attr["engine"] == "ekfac" and attr["cross_check"] == "datainf"  # the defaults
    assert -1.0 <= attr["engine_agreement_spearman"] <= 1.0
    assert {c["cluster"] for c in attr["clusters"]} == {"a", "b"}
    # the eval prompts repeat training prompts ("what is the capital of paris ?"): a critical
    # contamination finding leads, and its category decides the kind
    assert report["findings"][0]["id"] == "data.train_eval_contamination", report["findings"][0]
    assert report["verdict"]["kind"] == "data", report["verdict"]
    assert report["manifest"]["index"]["n_examples"] == 20 and report["manifest"]["config_hash"]
    for name in ("report.md", "report.html", "rankings.parquet"):
        assert (out / name).is_file()

    rankings = pd.read_parquet(out / "rankings.parquet")
    assert len(rankings) == 20 and rankings["example_id"].is_unique
    assert rankings["predicted_loss_delta_if_removed"].tolist() == pytest.approx((rankings["score"] / 20).tolist())
    # the cluster table sums the same scores the rankings hold
    for cluster in attr["clusters"]:
        members = rankings[rankings["cluster"] == cluster["cluster"]]
        assert cluster["n"] == len(members)
        assert cluster["signed_influence"] == pytest.approx(members["score"].sum(), rel=1e-6, abs=1e-9)

    # EK-FAC ranks by RelatIF, each row by its harm summed over the items it hurts (engine.rank_items:
    # harm): rank_score is below zero exactly for the rows that hurt an item (those with a worst
    # item); harm_rank and the top rows follow it
    assert ((rankings["rank_score"] < 0) == (rankings["worst_item"] != "")).all()
    assert rankings.sort_values("harm_rank")["rank_score"].is_monotonic_increasing
    assert not rankings.sort_values("harm_rank")["score"].is_monotonic_increasing  # not the influence order
    by_rank = rankings[rankings["rank_score"] < 0].sort_values("rank_score")["example_id"].tolist()
    assert [r["example_id"] for r in attr["top_harmful"]] == by_rank[:len(attr["top_harmful"])]

    # per-item scores: every row names the regressed item it hurts most (or none) and its share
    assert set(rankings["worst_item"]) - {""} <= set(attr["query"]["item_ids"]) and len(attr["query"]["item_ids"]) == 4
    hurting = rankings[rankings["worst_item"] != ""]
    assert ((hurting["worst_item_share"] > 0) & (hurting["worst_item_share"] <= 1)).all()
    assert (rankings.loc[rankings["worst_item"] == "", "worst_item_share"] == 0).all()
    for row in attr["top_harmful"]:
        assert row["items_hurt"] and sum(i["share"] for i in row["items_hurt"]) <= 1.0 + 1e-9

    # a second run with the same inputs is served from the index cache
    again = run_attribution(cfg, capability="capitals")
    assert again.report.to_json()["manifest"]["index"]["index_id"] == report["manifest"]["index"]["index_id"]
    assert again.rankings["score"].tolist() == pytest.approx(rankings["score"].tolist())
    # ordered by the mean over the items instead, RelatIF keeps the influence's sign row by row
    mean = run_attribution(make_config(tmp_path, base_dir, adapter_dir, *data_files, **{
        "evaluation.query_scope": "flipped", "engine.rank_items": "mean"}), capability="capitals").rankings
    assert (np.sign(mean["rank_score"]) == np.sign(mean["score"])).all()
    assert mean["score"].tolist() == pytest.approx(rankings["score"].tolist())


def test_gate_refuses_attribution_inside_the_noise_band(tmp_path, tiny_lora_dirs, data_files):
    from gradian.attribution import run_attribution

    base_dir, adapter_dir = tiny_lora_dirs
    cfg = make_config(tmp_path, base_dir, adapter_dir, *data_files, **{"evaluation.require_significant": True})
    outcome = run_attribution(cfg, capability="capitals")
    # the random adapter barely moves 4 items: the interval straddles zero (deterministic for the seed)
    assert outcome.report.to_json()["capability"]["status"] != "regressed"
    assert outcome.report.to_json()["attribution"] is None and outcome.rankings is None
    assert any(f["id"] == "attribution.gate_failed" for f in outcome.report.to_json()["findings"])


def test_attribute_cli_requires_an_adapter(tmp_path, data_files):
    train, evals = data_files
    proc = subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", "attribute",
                           "--dataset", str(train), "--eval-dataset", str(evals)], capture_output=True, text=True)
    assert proc.returncode == 2 and "--adapter" in proc.stderr and "Traceback" not in proc.stderr


def test_attribute_cli_end_to_end(tmp_path, tiny_lora_dirs, data_files):
    base_dir, adapter_dir = tiny_lora_dirs
    train, evals = data_files
    cfg = tmp_path / "gradian.yaml"
    cfg.write_text(
        f"cache_dir: {tmp_path / 'cache'}\nevaluation:\n  metric: contains\n  require_significant: false\n"
        "  max_new_tokens: 4\n  n_bootstrap: 100\nclustering:\n  method: declared\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", "from gradian.cli import main; main()", "attribute", "-c", str(cfg),
         "-m", str(base_dir), "-a", str(adapter_dir), "-d", str(train), "-e", str(evals),
         "--capability", "capitals", "--engine", "graddot", "--cross-check", "none", "-o", str(tmp_path / "o")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Verdict" in proc.stdout
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["attribution"]["engine"] == "graddot" and report["attribution"]["cross_check"] is None


def test_index_cli_and_show_index(tmp_path, tiny_lora_dirs, data_files):
    base_dir, adapter_dir = tiny_lora_dirs
    train, _ = data_files
    cfg = tmp_path / "gradian.yaml"
    cfg.write_text(f"cache_dir: {tmp_path / 'cache'}\ngrads:\n  chunk_size: 8\n")
    cmd = [sys.executable, "-m", "gradian", "index", "-c", str(cfg), "-m", str(base_dir), "-a", str(adapter_dir),
           "-d", str(train)]
    first = subprocess.run(cmd, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.startswith("built index")
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.stdout.startswith("reused index")  # same inputs: a cache hit
    root = tmp_path / "cache" / "index"
    shown = subprocess.run([sys.executable, "-m", "gradian", "show-index", str(root), "--json"],
                           capture_output=True, text=True)
    manifest = json.loads(shown.stdout)
    assert manifest["n_examples"] == 20 and manifest["status"] == "complete"
    assert manifest["index_id"] in first.stdout


def test_without_an_eval_set_the_report_says_it_has_no_capability_target(tmp_path, tiny_lora_dirs, data_files):
    from gradian.attribution import run_attribution
    from gradian.config import load_config

    base_dir, adapter_dir = tiny_lora_dirs
    train, _ = data_files
    cfg = load_config(overrides={"base_model": str(base_dir), "adapter_path": str(adapter_dir),
                                 "dataset": str(train), "cache_dir": str(tmp_path / "cache"),
                                 "clustering.method": "declared", "grads.chunk_size": 8})
    report = run_attribution(cfg, cross_check="none").report.to_json()
    ids = [f["id"] for f in report["findings"]]
    assert ids.count("attribution.no_capability_target") == 1
    assert report["capability"] is None and report["attribution"]["query"]["scope"] == "training_fallback"


def test_ekfac_through_the_pipeline_caches_its_state_and_picks_an_independent_cross_check(tmp_path, tiny_lora_dirs,
                                                                                       data_files):
    from gradian.attribution import run_attribution

    base_dir, adapter_dir = tiny_lora_dirs
    cfg = make_config(tmp_path, base_dir, adapter_dir, *data_files, **{"engine.name": "ekfac"})
    first = run_attribution(cfg, capability="capitals", cross_check="kfac")
    attr, manifest = first.report.to_json()["attribution"], first.report.to_json()["manifest"]
    assert attr["engine"] == "ekfac" and attr["cross_check"] == "kfac"
    state = manifest["engine_state"]
    assert state["engine"] == "ekfac" and state["state_id"] and not state["cache_hit"]
    assert state["settings"] == {"fisher": "empirical", "eigenvalue_correction": True}
    assert (tmp_path / "cache" / "engines" / state["state_id"] / "arrays.npz").is_file()
    again = run_attribution(cfg, capability="capitals", cross_check="ekfac")
    assert again.report.to_json()["manifest"]["engine_state"]["cache_hit"]
    assert again.rankings["score"].tolist() == first.rankings["score"].tolist()
    # ekfac cross-checked against itself is no cross-check: graddot (no curvature) is used instead
    assert again.report.to_json()["attribution"]["cross_check"] == "graddot"
    assert any("not independent" in n for n in again.report.to_json()["attribution"]["notes"])


def test_a_lora_module_left_out_of_the_gradients_is_a_finding_of_the_report(tmp_path, tiny_lora_dirs, data_files):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gradian.attribution import run_attribution
    from gradian.config import load_config

    base_dir, _ = tiny_lora_dirs
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], init_lora_weights=False,
                      task_type="CAUSAL_LM")
    adapter = tmp_path / "adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir)), lora).save_pretrained(str(adapter))
    train, _ = data_files
    cfg = load_config(overrides={"base_model": str(base_dir), "adapter_path": str(adapter), "dataset": str(train),
                                 "cache_dir": str(tmp_path / "cache"), "clustering.method": "declared",
                                 "engine.name": "datainf", "grads.chunk_size": 8})
    report = run_attribution(cfg, cross_check="none", out_dir=tmp_path / "out").report.to_json()
    (left_out,) = [f for f in report["findings"] if f["id"] == "attribution.lora_modules_skipped"]
    assert left_out["evidence"]["skipped_modules"] == ["model.embed_tokens"]
    assert "attribution.lora_modules_skipped" in (tmp_path / "out" / "report.md").read_text()
