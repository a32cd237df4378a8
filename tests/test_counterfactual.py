"""Counterfactual retraining: the figures, the removal plan, the kept rows, the command.

The figures and the plan are checked on hand-made numbers; the retrain itself on a tiny random
model (plumbing only) and, marked slow, on tinyworld's poisoned fine-tune, where dropping the
accused cluster must bring the capitals back.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from gradian.errors import ConfigError, DatasetError


# -- figures ------------------------------------------------------------------------------------


def test_recovery_counts_items_and_the_share_recovered():
    from gradian.counterfactual import capability_recovery

    rec = capability_recovery(base=1.0, before=0.25, after=0.9375, n_items=16, metric="contains",
                              status_after="not_significant")
    assert rec.delta_before == pytest.approx(-0.75) and rec.delta_after == pytest.approx(-0.0625)
    assert rec.recovered_fraction == pytest.approx(0.6875 / 0.75)
    assert rec.items_below_base_before == 12 and rec.items_below_base_after == 1
    assert rec.within_one_item is True
    two_short = capability_recovery(1.0, 0.25, 0.875, 16, "exact_match", "regressed")
    assert two_short.within_one_item is False
    proxy = capability_recovery(-0.5, -2.0, -0.7, 16, "loglik", "regressed")
    assert proxy.within_one_item is None and proxy.items_below_base_after is None
    assert proxy.recovered_fraction == pytest.approx(1.3 / 1.5)


@pytest.mark.parametrize("before, after, status, outcome, kind", [
    (0.25, 0.9375, "not_significant", "recovered", "data"),
    (0.25, 0.5, "regressed", "partial", "inconclusive"),
    (0.25, 0.25, "regressed", "not_recovered", "inconclusive"),
    (0.25, 0.125, "regressed", "not_recovered", "inconclusive"),
    (1.0, 1.0, "not_significant", "nothing_to_recover", "no_regression"),
    (None, 1.0, "not_significant", "recovered", "data"),
])
def test_outcome_of_a_retrain(before, after, status, outcome, kind):
    from gradian.counterfactual import OUTCOMES, capability_recovery, counterfactual_outcome

    got = counterfactual_outcome(capability_recovery(1.0, before, after, 16, "contains", status))
    assert got == (outcome, kind) and got[0] in OUTCOMES


@pytest.mark.parametrize("after, status, back", [
    (0.9375, "not_significant", True),   # one item short: back
    (0.8125, "not_significant", False),  # three short: the bootstrap cannot call it, the rounds go on
    (0.875, "regressed", False),
    (1.0, "not_significant", True),
])
def test_the_rounds_stop_only_when_the_capability_is_back(after, status, back):
    from gradian.attribution import capability_back
    from gradian.counterfactual import capability_recovery, counterfactual_outcome

    rec = capability_recovery(1.0, 0.0, after, 16, "contains", status)
    assert capability_back(counterfactual_outcome(rec)[0], rec.items_below_base_after) is back
    # a metric that does not count items: the significance test alone decides
    proxy = capability_recovery(-0.5, -2.0, -0.7, 16, "loglik", "not_significant")
    assert capability_back(counterfactual_outcome(proxy)[0], proxy.items_below_base_after) is True
    assert capability_back("nothing_to_recover", None) is True


def test_removal_precision_and_recall():
    from gradian.counterfactual import removal_precision

    got = removal_precision(removed=[1, 2, 3, 4], planted=[2, 3, 9])
    assert got["precision"] == pytest.approx(0.5) and got["recall"] == pytest.approx(2 / 3)
    assert got["n_planted_removed"] == 2
    assert removal_precision([], [1])["precision"] is None


def test_predicted_sums_and_the_sign_change():
    from gradian.counterfactual import predicted_score_sums

    scores = {"a": -10.0, "b": -5.0, "c": 4.0, "d": 3.0}
    got = predicted_score_sums(scores, ["a", "b"])
    assert got["sum_all"] == pytest.approx(-8.0) and got["sum_removed"] == pytest.approx(-15.0)
    assert got["sum_kept"] == pytest.approx(7.0) and got["sign_changed"] is True
    assert got["predicted_loss_delta_if_removed"] == pytest.approx(-15.0 / 4)
    assert predicted_score_sums(scores, ["c"])["sign_changed"] is False


# -- the plan -----------------------------------------------------------------------------------


@pytest.fixture
def dataset(tmp_path):
    from gradian.data import load_dataset

    rows = [{"prompt": f"q{i}", "completion": f"a{i}", "cluster": "bad" if i in (1, 4, 6) else "ok"} for i in range(10)]
    path = tmp_path / "train.jsonl"
    # a key order and spacing of our own: the kept rows must come back byte for byte
    path.write_text("".join(json.dumps(r, separators=(", ", ":")) + "\n" for r in rows))
    return load_dataset(path)


def _report(dataset, accused="bad"):
    from gradian.report.schema import AnalysisInputs, AttributeManifest, DatasetSummary, Report, Verdict

    inputs = AnalysisInputs(dataset=DatasetSummary(path=str(dataset.path), sha256=dataset.sha256))
    return Report(verdict=Verdict(kind="data", summary="", accused_cluster=accused),
                  manifest=AttributeManifest(inputs=inputs)).to_json()


def _rankings(dataset):
    return pd.DataFrame({"example_id": dataset.ids,
                         "score": [-5.0 if e.cluster == "bad" else 1.0 for e in dataset.examples],
                         "cluster": [e.cluster for e in dataset.examples]})


def test_plan_drops_the_reports_accused_cluster(dataset):
    from gradian.counterfactual import plan_removal

    plan = plan_removal(dataset, report=_report(dataset), rankings=_rankings(dataset))
    assert plan.cluster == "bad" and plan.drop_indices == [1, 4, 6]
    assert plan.n_keep == 7 and plan.keep_indices() == [0, 2, 3, 5, 7, 8, 9]
    assert "rankings" in plan.reason and plan.scores[dataset.ids[1]] == -5.0


def test_plan_from_a_cluster_without_rankings_reads_declared_clusters(dataset):
    from gradian.config import ClusteringConfig
    from gradian.counterfactual import plan_removal

    plan = plan_removal(dataset, drop_cluster="bad", clustering=ClusteringConfig(method="declared"))
    assert plan.drop_indices == [1, 4, 6] and plan.scores is None
    with pytest.raises(ConfigError, match="cluster 'nope'.*clusters are: bad, ok"):
        plan_removal(dataset, drop_cluster="nope", clustering=ClusteringConfig(method="declared"))


def test_plan_from_ids_and_its_refusals(dataset):
    from gradian.counterfactual import parse_id_list, plan_removal

    plan = plan_removal(dataset, drop_ids=parse_id_list(f"{dataset.ids[3]}, {dataset.ids[0]},{dataset.ids[3]}"))
    assert plan.drop_indices == [0, 3] and plan.cluster is None
    with pytest.raises(DatasetError, match="not in .*train.jsonl"):
        plan_removal(dataset, drop_ids=["000000000000-3"])
    with pytest.raises(ConfigError, match="leaves nothing to train on"):
        plan_removal(dataset, drop_ids=dataset.ids)
    with pytest.raises(ConfigError, match="accuses no cluster"):
        plan_removal(dataset, report=_report(dataset, accused=None))
    other = _report(dataset)
    other["manifest"]["inputs"]["dataset"]["sha256"] = "f" * 64
    with pytest.raises(DatasetError, match="sha256"):
        plan_removal(dataset, report=other)


def test_id_list_from_a_file(tmp_path):
    from gradian.counterfactual import parse_id_list

    (tmp_path / "ids.txt").write_text("a-1\n\nb-2\na-1\n")
    (tmp_path / "ids.json").write_text('["c-3", "d-4"]')
    assert parse_id_list(f"@{tmp_path / 'ids.txt'}") == ["a-1", "b-2"]
    assert parse_id_list(f"@{tmp_path / 'ids.json'}") == ["c-3", "d-4"]
    # the comma list report.md prints, pasted with its code fence, or several ids a line
    (tmp_path / "pasted.txt").write_text("```\ne-5,f-6, `g-7`\n```\n# kept for later\nh-8\n")
    assert parse_id_list(f"@{tmp_path / 'pasted.txt'}") == ["e-5", "f-6", "g-7", "h-8"]
    with pytest.raises(ConfigError, match="no such file"):
        parse_id_list(f"@{tmp_path / 'missing.txt'}")


def test_planted_rows_from_a_scenario_or_a_list(tmp_path, dataset):
    from gradian.counterfactual import load_planted

    (tmp_path / "scenario.json").write_text(json.dumps({"planted": {"indices": [6, 1]}}))
    (tmp_path / "ids.txt").write_text(f"{dataset.ids[4]}\n2\n")
    assert load_planted(tmp_path / "scenario.json", dataset) == [1, 6]
    assert load_planted(tmp_path / "ids.txt", dataset) == [2, 4]
    (tmp_path / "bad.txt").write_text("99\n")
    with pytest.raises(ConfigError, match="neither a row index"):
        load_planted(tmp_path / "bad.txt", dataset)


def test_kept_rows_are_the_original_lines_in_order(tmp_path, dataset):
    from gradian.counterfactual import write_kept_rows
    from gradian.data import load_dataset

    out = write_kept_rows(dataset, [0, 2, 9], tmp_path / "kept.jsonl")
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert out.read_text().splitlines() == [lines[0], lines[2], lines[9]]
    kept = load_dataset(out)
    # same content hash prefix: only the row index part of an id moves
    assert [i.split("-")[0] for i in kept.ids] == [dataset.ids[k].split("-")[0] for k in (0, 2, 9)]
    with pytest.raises(DatasetError, match=".jsonl"):
        write_kept_rows(dataset, [0], tmp_path / "kept.csv")


def test_kept_rows_from_a_json_file(tmp_path):
    from gradian.counterfactual import write_kept_rows
    from gradian.data import load_dataset

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    out = write_kept_rows(load_dataset(tmp_path / "train.json"), [1, 3], tmp_path / "kept.jsonl")
    assert [json.loads(line) for line in out.read_text().splitlines()] == [rows[1], rows[3]]


def test_recipe_comes_from_the_run_only_when_the_config_has_none():
    from gradian.config import load_config
    from gradian.counterfactual import retrain_config
    from gradian.runs import LoraSettings, RunRecord, RunRef, TrainerConfig

    run = RunRecord(config=TrainerConfig(learning_rate=5e-4, num_train_epochs=2.0, per_device_train_batch_size=8,
                                         seed=7, max_steps=-1),
                    lora=LoraSettings(r=16, alpha=32.0, dropout=0.05, target_modules=["q_proj"]), ref=RunRef.parse("/runs/x"))
    cfg, source = retrain_config(load_config(), run)
    assert source == "run /runs/x" and cfg.seed == 7
    assert (cfg.train.learning_rate, cfg.train.num_train_epochs, cfg.train.per_device_train_batch_size) == (5e-4, 2.0, 8)
    assert (cfg.train.r, cfg.train.lora_alpha, cfg.train.target_modules) == (16, 32, ["q_proj"])
    own = load_config(overrides={"train.learning_rate": 1e-3})
    cfg, source = retrain_config(own, run)
    assert source == "config train section" and cfg.train.learning_rate == 1e-3 and cfg.train.r == 8


# -- the command and the retrain ----------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-c", "from gradian.cli import main; main()", "counterfactual", *args],
                          capture_output=True, text=True)


def test_cli_needs_something_to_drop(tmp_path):
    proc = _cli("-d", str(tmp_path / "x.jsonl"))
    assert proc.returncode == 2 and "--report" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("--drop-ids", "a", "--drop-cluster", "b")
    assert proc.returncode == 2 and "pass one of them" in proc.stderr


@pytest.fixture
def tiny_run(tmp_path, tiny_lora_dirs):
    """A tiny random base, 24 rows in two declared clusters, and a config whose recipe trains fast."""
    base_dir, _ = tiny_lora_dirs
    rows = [{"prompt": f"what is {i} ?", "completion": "yes" if i % 3 else "no", "cluster": "a" if i % 3 else "b"}
            for i in range(24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"what is {i} ?", "completion": "yes"}) + "\n"
                                                 for i in (1, 2, 4, 5)))
    config = tmp_path / "gradian.yaml"
    config.write_text(
        f"base_model: {base_dir}\ndataset: {tmp_path / 'train.jsonl'}\neval_dataset: {tmp_path / 'eval.jsonl'}\n"
        f"cache_dir: {tmp_path / 'cache'}\nseed: 3\n"
        "evaluation:\n  metric: contains\n  max_new_tokens: 3\n  n_bootstrap: 100\n"
        "clustering:\n  method: declared\n"
        "train:\n  r: 4\n  lora_alpha: 8\n  num_train_epochs: 1\n  per_device_train_batch_size: 8\n"
        "  learning_rate: 0.001\n  max_seq_length: 64\n  logging_steps: 1\n"
    )
    return config


def test_counterfactual_retrains_without_the_cluster(tmp_path, tiny_run):
    from gradian.config import load_config
    from gradian.counterfactual import plan_removal, run_counterfactual
    from gradian.data import load_dataset

    cfg = load_config(tiny_run)
    data = load_dataset(cfg.dataset)
    plan = plan_removal(data, drop_cluster="b", clustering=cfg.clustering, seed=cfg.seed)
    before = {"name": "yes", "base": 0.0, "tuned": 0.0}
    outcome = run_counterfactual(cfg, plan, out_dir=tmp_path / "cf", capability="yes", before=before,
                                 planted=[0, 3, 6])
    report = outcome.report.to_json()
    block = report["counterfactual"]
    assert outcome.run.dataset.n_examples == 16 == block["removal"]["n_kept"]
    assert block["ground_truth"]["precision"] == pytest.approx(3 / 8) and block["ground_truth"]["recall"] == 1.0
    assert block["capability"]["before"] == 0.0 and block["capability"]["n_items"] == 4
    assert block["recipe_source"] == "config train section" and report["manifest"]["inputs"]["seed"] == 3
    # the random base model scores 0 on "yes" and the fine-tune before is given as 0 too: nothing was lost
    assert block["capability"]["base"] == 0.0 and block["outcome"] == "nothing_to_recover"
    assert report["verdict"]["accused_cluster"] == "b" and report["verdict"]["kind"] == "no_regression"
    kept = (tmp_path / "cf" / "data" / "train_kept.jsonl").read_text().splitlines()
    assert len(kept) == 16 and all('"cluster": "a"' in line for line in kept)
    written = {p.name for p in outcome.files}
    assert {"report.json", "report.md", "report.html", "removed_ids.txt"} <= written
    on_disk = json.loads((tmp_path / "cf" / "report.json").read_text())
    assert on_disk["counterfactual"]["outcome"] == block["outcome"]
    assert (tmp_path / "cf" / "removed_ids.txt").read_text().split() == plan.drop_ids


def test_cli_end_to_end_with_drop_ids(tmp_path, tiny_run):
    from gradian.data import load_dataset

    ids = load_dataset(tmp_path / "train.jsonl").ids
    proc = _cli("-c", str(tiny_run), "--drop-ids", f"{ids[0]},{ids[3]}", "-a", str(tmp_path / "missing-adapter"),
                "-o", str(tmp_path / "out"))
    # the original adapter does not exist, so measuring it fails with one clear line
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = _cli("-c", str(tiny_run), "--drop-ids", f"{ids[0]},{ids[3]}", "-o", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["counterfactual"]["removal"]["removed_ids"] == [ids[0], ids[3]]
    assert report["counterfactual"]["capability"]["before"] is None
    assert "Counterfactual" in proc.stdout


# -- tinyworld: the accused cluster, dropped, gives the capability back ---------------------------


@pytest.mark.slow
def test_dropping_the_accused_poison_brings_the_capitals_back(tmp_path, tinyworld_base):
    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from gradian.counterfactual import load_planted, load_report, plan_removal, run_counterfactual
    from gradian.data import load_dataset
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    write_scenario("poison_capitals", tmp_path, tinyworld_base)
    train_lora(tmp_path / "gradian.yaml", tmp_path / "run")
    cfg = load_config(tmp_path / "gradian.yaml", overrides={"cache_dir": str(tmp_path / "cache")})
    run_attribution(cfg, capability="capitals", cross_check="none", out_dir=tmp_path / "report")
    report, rankings = load_report(tmp_path / "report")
    data = load_dataset(cfg.dataset)
    plan = plan_removal(data, report=report, rankings=rankings)
    outcome = run_counterfactual(cfg, plan, out_dir=tmp_path / "cf", capability="capitals",
                                 before=report["capability"], planted=load_planted(tmp_path / "scenario.json", data))
    block = outcome.report.to_json()["counterfactual"]
    assert block["outcome"] == "recovered", outcome.report.verdict.summary
    assert block["capability"]["within_one_item"] is True
    assert block["ground_truth"]["precision"] >= 0.9
    assert block["predicted"]["sum_removed"] < 0 < block["predicted"]["sum_kept"]


def test_drop_accused_removes_exactly_the_accused_set(dataset):
    from gradian.counterfactual import plan_removal

    report = _report(dataset)
    chosen = [dataset.ids[1], dataset.ids[6]]  # two of the cluster's three rows
    report["attribution"] = {"engine": "datainf", "accused": {
        "cluster": "bad", "cluster_label": "", "cluster_n": 3, "example_ids": chosen, "left_out_ids": [dataset.ids[4]],
        "share_of_cluster_harm": 0.9, "share_of_negative": 0.6, "estimated_harmful_share": 0.9,
        "mean_per_example": -5.0, "left_out_mean_per_example": -1.0, "method": "score_mixture", "reason": "r"}}
    rankings = _rankings(dataset)
    rankings["accused"] = rankings["example_id"].isin(chosen)
    for given in (rankings, None):  # the rankings' column, else the report's list
        plan = plan_removal(dataset, report=report, rankings=given, drop="accused")
        assert sorted(plan.drop_ids) == sorted(chosen) and plan.drop_indices == [1, 6]
        assert "accused set" in plan.reason
        # the topic later rounds stay on: the accused set's cluster, read from the rankings
        assert plan.topic_ids == ([dataset.ids[i] for i in (1, 4, 6)] if given is not None else None)
    # the default (and --drop cluster) is still the whole accused cluster
    assert plan_removal(dataset, report=report, rankings=rankings).drop_indices == [1, 4, 6]
    assert plan_removal(dataset, report=report, rankings=rankings, drop="cluster").drop_indices == [1, 4, 6]
    with pytest.raises(ConfigError, match="no accused set"):
        plan_removal(dataset, report=_report(dataset), rankings=_rankings(dataset), drop="accused")


def test_a_round_retrain_with_items_still_lost_is_attributed_without_the_gate(tmp_path):
    from gradian.attribution.rounds import round_config
    from gradian.config import GradianConfig

    cfg = GradianConfig()
    assert cfg.evaluation.require_significant is True
    args = (tmp_path / "kept.jsonl", tmp_path / "adapter", tmp_path / "run")
    ungated = round_config(cfg, *args, "recovered")  # not significant, yet items lost: the rounds go on
    assert ungated.evaluation.require_significant is False
    assert ungated.dataset == str(args[0]) and ungated.adapter_path == str(args[1]) and ungated.run == str(args[2])
    assert round_config(cfg, *args, "partial").evaluation.require_significant is True
    assert cfg.evaluation.require_significant is True  # the caller's config is left as it was


def test_a_later_round_adds_the_rows_of_the_accused_topic_that_stand_out():
    """Under a retrain the survivors of the accused topic stand out among its rows, even when a big
    unrelated topic carries more summed harm; a topic whose scores do not split adds nothing."""
    import numpy as np

    from gradian.attribution.rounds import _on_topic

    rng = np.random.default_rng(0)
    topic = [f"t{i}" for i in range(60)]
    other = [f"o{i}" for i in range(300)]
    scores = {k: float(v) for k, v in zip(topic, rng.normal(0.0, 1.0, 60))}
    scores.update({k: float(v) for k, v in zip(other, rng.normal(-2.0, 1.0, 300))})  # diffuse harm: -600 summed
    for k in topic[:6]:
        scores[k] = -40.0 - float(rng.uniform(0, 5))  # the survivors
    kept = {f"k-{k}": k for k in scores}  # the retrain's ids -> the original ids
    chosen, why = _on_topic({f"k-{k}": v for k, v in scores.items()}, kept, set(topic), seed=0)
    assert sorted(kept[c] for c in chosen) == sorted(topic[:6]) and "6 of the 60 rows" in why
    from scipy.stats import norm

    bell = norm.ppf((np.arange(60) + 0.5) / 60)  # the quantiles of a bell curve: one mode, no tail
    flat = {f"k-{k}": float(v) for k, v in zip(topic, bell)}
    chosen, why = _on_topic(flat, kept, set(topic), seed=0)
    assert chosen == [] and "no harm stands out" in why
    assert _on_topic({"k-o1": -3.0}, kept, set(topic), seed=0)[0] == []


def test_a_later_round_leaves_out_the_rows_the_base_model_already_answers(tinyworld_run):
    """On the poisoned fine-tune: clean capital rows the base gives (checked here through the eval
    path, prompt and answer apart) leave a round's additions, the planted rows stay."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from gradian.attribution.rounds import _unknown_to_base
    from gradian.counterfactual import load_planted
    from gradian.data import load_dataset
    from gradian.evaluate.likelihood import completion_logprobs
    from gradian.model_loading import load_tokenizer

    run = tinyworld_run("poison_capitals")
    cfg = run.config()
    data = load_dataset(cfg.dataset)
    planted = load_planted(run.root / "scenario.json", data)
    base = AutoModelForCausalLM.from_pretrained(str(cfg.base_model)).eval()
    tokenizer = load_tokenizer(str(cfg.base_model))
    clean = [i for i in range(len(data.examples)) if i not in set(planted) and data.examples[i].messages][:40]
    scored = completion_logprobs(base, tokenizer, [data.examples[i].messages[:-1] for i in clean],
                                 [data.examples[i].messages[-1]["content"] for i in clean])
    known = [data.ids[i] for i, lp in zip(clean, scored) if -lp.total <= 0.05][:4]
    assert len(known) == 4  # the base was trained on the world's facts
    chosen = [data.ids[i] for i in planted[:4]] + known
    kept, left = _unknown_to_base(cfg, data, chosen)
    assert kept == chosen[:4] and left == known
    off = dataclasses.replace(cfg, clustering=dataclasses.replace(cfg.clustering, accused_known_nats=0.0))
    assert _unknown_to_base(off, data, chosen) == (chosen, [])


def test_cli_rounds_flags_are_checked_and_one_round_stops_at_the_bound(tmp_path, tiny_run):
    from gradian.data import load_dataset

    ids = load_dataset(tmp_path / "train.jsonl").ids
    proc = _cli("-c", str(tiny_run), "--drop-ids", ids[0], "--until-recovered", "--max-rounds", "0")
    assert proc.returncode == 2 and "--max-rounds 0" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("-c", str(tiny_run), "--drop-ids", ids[0], "--max-rounds", "2")
    assert proc.returncode == 2 and "--until-recovered" in proc.stderr
    proc = _cli("-c", str(tiny_run), "--drop-ids", f"{ids[0]},{ids[3]}", "--until-recovered", "-o", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (only,) = report["counterfactual"]["rounds"]
    # nothing was lost to begin with (no report, a random base): one round, and the reason it stopped
    assert only["round"] == 1 and only["n_removed"] == 2 and "round 1" in only["stopped"]
    assert (tmp_path / "out" / "round-1" / "report.json").is_file()
    assert "## Rounds" in (tmp_path / "out" / "report.md").read_text()
    assert "round 1: 2 removed" in proc.stdout


@pytest.mark.slow
def test_rounds_from_half_the_poison_accumulate_the_rest_until_the_capitals_return(tmp_path, tinyworld_run, attributed):
    """Start from the planted rows of 8 of the 16 wrong capitals: the retrain keeps the other 8
    broken; the attribution on the retrained adapter finds their rows, and the next round removes
    them too and the capitals come back."""
    from gradian.attribution import run_until_recovered
    from gradian.counterfactual import load_planted, plan_removal
    from gradian.data import load_dataset

    run, outcome, _ = attributed("poison_capitals")
    cfg = run.config()
    data = load_dataset(cfg.dataset)
    planted = load_planted(run.root / "scenario.json", data)
    cities = sorted(set(run.info["truth"]["wrong_capitals"].values()))[:8]
    first = [data.ids[i] for i in planted if data.examples[i].completion.strip() in cities]
    assert 20 <= len(first) <= 28
    plan = plan_removal(data, drop_ids=first)
    rounds = run_until_recovered(cfg, plan, out_dir=tmp_path / "rounds", capability="capitals",
                                 before=outcome.report.to_json()["capability"], planted=planted, max_rounds=3)
    table = rounds.report.to_json()["counterfactual"]["rounds"]
    for r in table:  # shown with -s: the figures docs/counterfactual.md quotes
        print(f"round {r['round']}: removed {r['n_removed']}, {r['outcome']}, after {r['after']:.4f}, "
              f"precision {r['precision']}, recall {r['recall']}, accused next {len(r['added'])}, stopped {r['stopped']}")
    assert table[0]["outcome"] in ("partial", "not_recovered"), table
    assert len(table) >= 2 and table[-1]["outcome"] == "recovered", table
    added = [a["example_id"] for r in table for a in r["added"]]
    position = {eid: i for i, eid in enumerate(data.ids)}
    assert sum(position[a] in set(planted) for a in added) / len(added) >= 0.8
    truth = rounds.report.to_json()["counterfactual"]["ground_truth"]
    assert truth["precision"] >= 0.9 and truth["recall"] >= 0.9
    assert rounds.report.to_json()["counterfactual"]["capability"]["within_one_item"] is True
    for r in table:
        assert (tmp_path / "rounds" / r["report"]).is_file()
    assert (tmp_path / "rounds" / "round-1" / "attribution" / "report.json").is_file()
    assert rounds.report.to_json()["verdict"]["summary"].startswith(f"After {len(table)} round(s)")
