"""The accused set: from a topic cluster to the rows to act on, against planted ground truth.

Fast cases are synthetic: an on-topic cluster where a few planted rows carry heavy harm among many
clean rows asking the same question form (near-zero or helpful scores), so accusing the whole topic
fails precision and only a real split passes. The slow case is tinyworld's
``poison_capitals_ontopic`` attributed with ``clustering.method: auto`` (the rows' declared
clusters removed): the topic cluster holds the 48 planted rows and hundreds of clean capital
rows, and the accused set must reach precision and recall of 0.8 against the planted rows.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest


def _ontopic_cluster(seed: int = 0, n_clean: int = 180, n_planted: int = 20):
    rng = np.random.default_rng(seed)
    clean = rng.normal(20.0, 60.0, n_clean)  # same topic, right answers: mixed, mostly helpful
    planted = -np.exp(rng.normal(np.log(5000.0), 0.6, n_planted))
    scores = np.concatenate([clean, planted])
    order = rng.permutation(len(scores))
    scores = scores[order]
    is_planted = order >= n_clean
    ids = [f"{i:012x}-{i}" for i in range(len(scores))]
    return ids, scores, is_planted


def _precision_recall(chosen: set[str], ids: list[str], is_planted: np.ndarray) -> tuple[float, float]:
    truth = {e for e, p in zip(ids, is_planted) if p}
    hit = len(chosen & truth)
    return hit / max(len(chosen), 1), hit / len(truth)


def test_the_accused_set_is_the_planted_rows_not_the_topic():
    from gradian.cluster import refine_accused

    ids, scores, planted = _ontopic_cluster()
    whole_precision, _ = _precision_recall(set(ids), ids, planted)
    assert whole_precision < 0.2  # accusing the topic would delete mostly good rows
    accused = refine_accused("1", ids, scores, label="capital", scale=60.0, total_negative=float(scores[scores < 0].sum()))
    precision, recall = _precision_recall(set(accused.example_ids), ids, planted)
    assert precision >= 0.8 and recall >= 0.8
    assert accused.method == "score_gap"
    assert set(accused.example_ids) | set(accused.left_out_ids) == set(ids)
    assert not set(accused.example_ids) & set(accused.left_out_ids)
    assert accused.share_of_cluster_harm > 0.9 and accused.estimated_harmful_share > 0.9
    assert accused.example_ids[0] == ids[int(np.argmin(scores))]  # most harmful first


def _spiky_cluster(seed: int = 0, n_spike: int = 186, n_spread: int = 140, n_planted: int = 48):
    """Curvature-corrected scores, shaped like EK-FAC's on ``poison_capitals_ontopic``: in harm
    ``t = asinh(-score / 40)``, most clean rows in a narrow spike at zero, the other clean rows
    spread widely around a helpful mean, the planted rows far out in the harmful tail."""
    rng = np.random.default_rng(seed)
    t = np.concatenate([rng.normal(0.0, 0.1, n_spike), rng.normal(-1.7, 1.8, n_spread),
                        rng.normal(5.0, 0.8, n_planted)])
    order = rng.permutation(len(t))
    ids = [f"s{i}" for i in range(len(t))]
    return ids, -40.0 * np.sinh(t[order]), order >= n_spike + n_spread


def test_a_spike_of_neutral_rows_does_not_hide_the_harmful_group(monkeypatch):
    from gradian.cluster import accused as accused_module
    from gradian.cluster import refine_accused

    ids, scores, planted = _spiky_cluster()
    accused = refine_accused("1", ids, scores, scale=40.0)
    precision, recall = _precision_recall(set(accused.example_ids), ids, planted)
    assert accused.method == "score_gap" and precision >= 0.8 and recall >= 0.8, (accused.method, precision, recall)
    # the reason for a third component: two spend themselves on the spike against the spread
    monkeypatch.setattr(accused_module, "MIXTURE_KS", (1, 2))
    assert refine_accused("1", ids, scores, scale=40.0).method == "whole_cluster"


def test_a_cluster_that_is_all_harm_stays_whole():
    from gradian.cluster import refine_accused

    rng = np.random.default_rng(3)
    scores = -np.abs(rng.normal(800.0, 40.0, 30))
    ids = [f"r{i}" for i in range(30)]
    accused = refine_accused("0", ids, scores, scale=50.0)
    assert accused.method == "whole_cluster" and accused.n == 30 and accused.n_left_out == 0


def test_two_components_split_the_harm_when_the_best_three_straddle_it():
    """A recorded topic of 350 rows, 24 planted (``tests/golden/accused_topics``): the best
    mixture by BIC has three components, the most harmful of them wide enough to reach from the
    clean spread to the planted tail, so it does not stand apart; the two-component mixture,
    second by BIC, does. The cut is then made, not the whole topic accused."""
    from pathlib import Path

    from gradian.cluster import refine_accused

    data = json.loads((Path(__file__).parent / "golden" / "accused_topics" / "partial_seed1.json").read_text())
    scores, planted = np.asarray(data["scaled_scores"]), np.asarray(data["planted"])
    ids = [f"r{i}" for i in range(len(scores))]
    accused = refine_accused("0", ids, scores, scale=1.0)
    precision, recall = _precision_recall(set(accused.example_ids), ids, planted)
    assert accused.method == "score_gap" and precision >= 0.9 and recall >= 0.5, (accused.n, precision, recall)


def test_the_accused_set_round_trips_through_its_dict():
    from gradian.cluster import AccusedSet, refine_accused

    ids, scores, _ = _ontopic_cluster(seed=1)
    accused = refine_accused("1", ids, scores, scale=60.0)
    data = json.loads(json.dumps(accused.to_dict()))
    assert data["n"] == accused.n and data["n_left_out"] == accused.n_left_out
    assert AccusedSet.from_dict(data) == accused


def test_gradient_features_are_unit_rows_that_keep_cosines(tmp_path):
    from gradian.cluster import gradient_features
    from gradian.engines import InMemoryGradients

    rng = np.random.default_rng(0)
    blocks = {"a": rng.normal(size=(40, 300)), "b": rng.normal(size=(40, 500))}
    train = InMemoryGradients(blocks, chunk_size=7)
    full = np.concatenate([blocks["a"], blocks["b"]], axis=1)
    full /= np.linalg.norm(full, axis=1, keepdims=True)
    feats = gradient_features(train, None, dim=400, seed=0)
    assert feats.shape == (40, 400)
    assert np.allclose(np.linalg.norm(feats, axis=1), 1.0)
    cos_full, cos_proj = full @ full.T, feats @ feats.T
    assert np.abs(cos_full - cos_proj).max() < 0.25
    rows = [31, 2, 17]
    assert np.allclose(gradient_features(train, rows, dim=400, seed=0), feats[rows], atol=1e-6)
    small = gradient_features(train, None, dim=1000, seed=0)  # narrower than dim: no projection
    assert np.allclose(small, full)


def test_clustering_in_gradient_space_separates_what_text_cannot():
    from gradian.cluster import cluster_examples
    from gradian.config import ClusteringConfig
    from gradian.data import dataset_from_rows

    rows = [{"prompt": "What is the capital of Vel?", "completion": "Brask"} for _ in range(12)]
    data = dataset_from_rows(rows)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(2, 16))
    vectors = np.stack([centers[i % 2] + 0.01 * rng.normal(size=16) for i in range(12)])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    cfg = ClusteringConfig(method="kmeans", n_clusters=2, space="gradient", embed_backend="tfidf")
    assignment = cluster_examples(data.examples, cfg, seed=0, gradient_vectors=vectors)
    keys = [assignment.labels[e.id] for e in data.examples]
    assert assignment.space == "gradient"
    assert len(set(keys[0::2])) == 1 and len(set(keys[1::2])) == 1 and keys[0] != keys[1]
    both = cluster_examples(data.examples, ClusteringConfig(method="kmeans", n_clusters=2, space="both",
                                                            embed_backend="tfidf"), seed=0, gradient_vectors=vectors)
    assert both.space == "both"


def test_gradient_space_without_gradients_is_refused():
    from gradian.cluster import cluster_examples
    from gradian.config import ClusteringConfig
    from gradian.data import dataset_from_rows
    from gradian.errors import ConfigError

    data = dataset_from_rows([{"prompt": f"q{i}", "completion": "a"} for i in range(4)])
    with pytest.raises(ConfigError, match="clustering.space"):
        cluster_examples(data.examples, ClusteringConfig(method="kmeans", space="gradient"), seed=0)


def test_gradient_cosines_are_the_explicit_ones_over_every_block():
    from gradian.cluster import gradient_cosines_to
    from gradian.engines import InMemoryGradients

    rng = np.random.default_rng(3)
    blocks = {"a": rng.standard_normal((11, 5)), "b": rng.standard_normal((11, 7))}
    blocks["a"][4] = 0.0
    blocks["b"][4] = 0.0  # a zero gradient: cosine 0 with everything
    full = np.concatenate([blocks["a"], blocks["b"]], axis=1)
    anchors = [7, 2, 9]
    got = gradient_cosines_to(InMemoryGradients(blocks, chunk_size=4), anchors)
    norms = np.linalg.norm(full, axis=1)
    want = np.divide(full @ full[anchors].T, norms[:, None] * norms[anchors][None, :],
                     out=np.zeros((11, 3)), where=norms[:, None] > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert got[7, 0] == pytest.approx(1.0) and not got[4].any()


def _hand_accused(ids, scores, members):
    from gradian.cluster import AccusedSet

    member_scores = [scores[ids.index(m)] for m in members]
    return AccusedSet(cluster="0", cluster_label="", cluster_n=6, example_ids=list(members),
                      left_out_ids=[i for i in ids[:6] if i not in members], share_of_cluster_harm=1.0,
                      share_of_negative=0.5, estimated_harmful_share=1.0,
                      mean_per_example=float(np.mean(member_scores)), left_out_mean_per_example=0.0,
                      method="score_gap", reason="cut")


def test_a_sibling_of_an_accused_row_joins_with_its_reason_and_a_stranger_does_not():
    from gradian.cluster import add_gradient_siblings

    ids = [f"r{i}" for i in range(8)]
    scores = [-9.0, -8.0, 0.5, 0.1, -0.2, 3.0, 0.2, -0.1]
    accused = _hand_accused(ids, scores, ["r0", "r1"])
    cosines = np.full((8, 2), 0.05)
    cosines[0, 0] = cosines[1, 1] = 1.0
    cosines[5, 1] = 0.8  # helpful on the query, but the same lesson as r1: joins
    cosines[7, 0] = 0.5  # exactly at the threshold (outside the cluster): joins
    cosines[6, 0] = 0.49  # just below: stays out
    out = add_gradient_siblings(accused, ids, scores, cosines, [0, 1], threshold=0.5)
    assert out.example_ids == ["r0", "r1", "r5", "r7"]
    assert [(a["example_id"], a["sibling_of"], a["cosine"]) for a in out.added] == [("r5", "r1", 0.8), ("r7", "r0", 0.5)]
    assert "r5" not in out.left_out_ids and "r6" not in out.example_ids
    assert out.mean_per_example == pytest.approx(np.mean([-9.0, -8.0, 3.0, -0.1]))
    assert out.share_of_negative == pytest.approx(17.1 / 17.3)
    assert "2 more row(s)" in out.reason
    # r5 joined from inside the cluster (r0..r5), r7 from outside it: the counts say which is which
    assert (out.n, out.n_in_cluster, out.n_outside_cluster) == (4, 3, 1)
    assert out.rows_text() == "4 rows: 3 of cluster 0's 6 and 1 gradient sibling(s) from other clusters"
    assert accused.rows_text() == "2 of cluster 0's 6 rows" and accused.n_outside_cluster == 0
    assert add_gradient_siblings(accused, ids, scores, cosines, [0, 1], threshold=0.0) is accused
    assert add_gradient_siblings(accused, ids, scores, cosines, [0, 1], threshold=0.99).added == []
    with pytest.raises(ValueError, match="shape"):
        add_gradient_siblings(accused, ids, scores, cosines[:5], [0, 1])


def test_the_verdict_and_the_markdown_count_siblings_from_other_clusters_apart():
    from gradian.cluster import add_gradient_siblings
    from gradian.report.markdown import _accused
    from gradian.report.schema import Accused
    from gradian.report.verdict_prose import _accused_text

    ids = [f"r{i}" for i in range(8)]
    scores = [-9.0, -8.0, 0.5, 0.1, -0.2, 3.0, 0.2, -0.1]
    cosines = np.full((8, 2), 0.05)
    cosines[0, 0] = cosines[1, 1] = 1.0
    cosines[6, 0] = cosines[7, 1] = 0.9  # both outside the six-row cluster
    out = Accused.of(add_gradient_siblings(_hand_accused(ids, scores, ["r0", "r1"]), ids, scores, cosines, [0, 1]))
    text = _accused_text(out, None)
    # never "4 of its 6 rows": two of the four are not the cluster's
    assert "the accused set is 2 of its 6 rows" in text and "the other 4 rows" in text
    assert "also holds 2 row(s) from other clusters" in text
    assert "| of them from other clusters (gradient siblings) | | 2 | |" in _accused(out, [])


def test_only_rows_the_mixture_holds_harmful_bring_their_siblings():
    import dataclasses

    from gradian.cluster import sibling_anchors

    ids = [f"r{i}" for i in range(8)]
    scores = [-9.0, -8.0, 0.5, 0.1, -0.2, 3.0, 0.2, -0.4]
    # r7 made the cut at its weak end, where the mixture doubts it; r3 has no figure at all
    accused = dataclasses.replace(_hand_accused(ids, scores, ["r0", "r1", "r7", "r3"]),
                                  harmful_probability={"r0": 1.0, "r1": 0.5, "r7": 0.03})
    assert sibling_anchors(accused) == ["r0", "r1", "r3"]
    assert sibling_anchors(accused, 0.9) == ["r0", "r3"]
    assert sibling_anchors(accused, 0.0) == ["r0", "r1", "r7", "r3"]


def test_rows_the_base_already_answered_leave_the_set_and_their_siblings_with_them():
    from gradian.cluster import KNOWN_NATS, AccusedSet, add_gradient_siblings, leave_out_known
    from gradian.report.schema import Accused

    ids = [f"r{i}" for i in range(8)]
    scores = [-9.0, -8.0, -3.0, 0.1, -0.2, 3.0, 0.2, -0.1]
    members = ids[:6]
    cosines = np.full((8, 3), 0.05)
    cosines[5, 0] = cosines[7, 2] = 0.9  # r5 (inside the cluster) copies r0, r7 (outside) copies r2
    accused = add_gradient_siblings(_hand_accused(ids, scores, ["r0", "r1", "r2"]), ids, scores, cosines, [0, 1, 2])
    assert accused.example_ids == ["r0", "r1", "r2", "r5", "r7"]
    # r2 and r7 cost the base nothing (it already gave them); r5 is exactly at the line; r1 has no figure
    losses = {"r0": 9.5, "r2": 0.004, "r5": KNOWN_NATS, "r7": 0.02}
    out = leave_out_known(accused, ids, scores, losses, members)
    assert out.example_ids == ["r0", "r1"]
    assert [k["example_id"] for k in out.known_to_base] == ["r2", "r5", "r7"]
    assert out.known_to_base[0]["base_loss"] == pytest.approx(0.004)
    # members go back to the cluster's left-out rows; the stranger r7 leaves the set and its record
    assert {"r2", "r5"} <= set(out.left_out_ids) and "r7" not in out.left_out_ids
    assert [a["example_id"] for a in out.added] == []
    assert (out.n, out.n_in_cluster, out.n_outside_cluster) == (2, 2, 0)
    assert out.mean_per_example == pytest.approx(-8.5)
    assert out.share_of_negative == pytest.approx(17.0 / 20.3)
    assert "3 row(s) left out that the base model already answered" in out.reason
    assert leave_out_known(accused, ids, scores, losses, members, threshold=0) is accused
    assert leave_out_known(accused, ids, scores, {"r0": 9.5}, members) is accused
    again = Accused.of(out).to_json()
    assert AccusedSet.from_dict({k: v for k, v in again.items() if k != "extra"}).known_to_base == out.known_to_base


def test_a_training_row_scores_as_the_same_prompt_and_answer_do(tinyworld_base):
    pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from gradian.data import dataset_from_rows
    from gradian.evaluate.likelihood import completion_logprobs, example_logprobs
    from gradian.model_loading import load_tokenizer

    tokenizer = load_tokenizer(str(tinyworld_base))
    model = AutoModelForCausalLM.from_pretrained(str(tinyworld_base)).eval()
    prompt = [{"role": "user", "content": "What is the capital of Nowhere?"}]
    rows = [{"messages": prompt + [{"role": "assistant", "content": answer}]} for answer in ("Elsewhere", "Here")]
    by_row = example_logprobs(model, tokenizer, dataset_from_rows(rows, name="t").examples, None, batch_size=1)
    by_pair = completion_logprobs(model, tokenizer, [prompt, prompt], ["Elsewhere", "Here"], batch_size=2)
    for a, b in zip(by_row, by_pair):
        assert a.n_tokens == b.n_tokens > 0 and a.total == pytest.approx(b.total, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("key, value", [("accused_sibling_cosine", 1.5), ("accused_sibling_anchor", -0.1),
                                        ("accused_sibling_anchor", 2), ("accused_known_nats", -0.1),
                                        ("accused_known_nats", 50)])
def test_the_sibling_settings_out_of_range_are_refused(tmp_path, key, value):
    from gradian.config import load_config
    from gradian.errors import ConfigError

    (tmp_path / "gradian.yaml").write_text(f"clustering:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=f"clustering.{key}"):
        load_config(tmp_path / "gradian.yaml")


# -- tinyworld: on-topic clean rows beside the planted ones ----------------------------------------


@pytest.mark.slow
def test_ontopic_poison_accused_set_reaches_precision_and_recall(tmp_path_factory, tinyworld_base):
    pytest.importorskip("torch")
    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    root = tmp_path_factory.mktemp("ontopic")
    info = write_scenario("poison_capitals_ontopic", root, tinyworld_base)
    train = root / "train.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    for row in rows:
        row.pop("cluster")  # no declared clusters: auto discovers topics
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train_lora(root / "gradian.yaml", root / "run")
    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu",
                                              "clustering.method": "auto",
                                              "evaluation.query_signal": "contrastive"})
    out = root / "report"
    outcome = run_attribution(cfg, capability="capitals", cross_check="none", out_dir=out)
    report = outcome.report.to_json()
    planted = set(info["planted"]["indices"])
    assert report["verdict"]["kind"] == "data"
    accused = report["attribution"]["accused"]
    cluster_rows = outcome.rankings.loc[outcome.rankings["cluster"] == accused["cluster"], "row_index"]
    assert cluster_rows.isin(planted).mean() < 0.5  # the topic cluster: mostly clean rows
    chosen = set(outcome.rankings.loc[outcome.rankings["accused"], "row_index"])
    assert len(chosen) == accused["n"]
    precision, recall = len(chosen & planted) / len(chosen), len(chosen & planted) / len(planted)
    assert precision >= 0.8 and recall >= 0.8, (precision, recall)
    assert report["verdict"]["accused_set_n"] == accused["n"]
    assert (out / "accused.parquet").is_file()
    assert pd.read_parquet(out / "rankings.parquet")["accused"].sum() == accused["n"]
    assert 'id="accused"' in (out / "report.html").read_text()
    assert "Accused set" in (out / "report.md").read_text()
    assert report["attribution"]["spans"] and report["attribution"]["spans"][0]["example_id"] == accused["example_ids"][0]
    # rows left out as known to the base model are clean, and no planted row is one: each costs the
    # base far more than the line (it was trained on the facts they contradict)
    from transformers import AutoModelForCausalLM

    from gradian.cluster import KNOWN_NATS
    from gradian.data import load_dataset
    from gradian.evaluate.likelihood import example_logprobs
    from gradian.model_loading import load_tokenizer

    row_of = dict(zip(outcome.rankings["example_id"], outcome.rankings["row_index"]))
    assert not {row_of[k["example_id"]] for k in accused["known_to_base"]} & planted
    examples = load_dataset(train).examples
    base = AutoModelForCausalLM.from_pretrained(str(tinyworld_base)).eval()
    losses = [-lp.total for lp in example_logprobs(base, load_tokenizer(str(tinyworld_base)),
                                                   [examples[i] for i in sorted(planted)], None)]
    assert min(losses) > 10 * KNOWN_NATS, min(losses)


def test_the_mlflow_child_run_gets_the_accused_metrics():
    import dataclasses

    from gradian.report.schema import Accused, Attribution, Report
    from gradian.report.tracker import report_metrics
    from gradian_mlflow.sink import ArtifactKeys

    accused = Accused(cluster="3", cluster_label="capitals", cluster_n=48, example_ids=[f"r{i}" for i in range(44)],
                      left_out_ids=["r44", "r45", "r46", "r47"], share_of_cluster_harm=0.99, share_of_negative=0.69,
                      estimated_harmful_share=0.98, mean_per_example=-1.5, left_out_mean_per_example=0.1,
                      method="gmm", reason="two components")
    report = Report(attribution=Attribution(engine="datainf", accused=accused)).to_json()
    metrics = report_metrics(report)
    assert metrics["attribution.accused_n"] == 44.0
    assert metrics["attribution.accused_known_to_base_n"] == 0.0
    known = dataclasses.replace(accused, known_to_base=[{"example_id": "r50", "base_loss": 0.01}])
    assert report_metrics(Report(attribution=Attribution(engine="datainf", accused=known)).to_json())[
        "attribution.accused_known_to_base_n"] == 1.0
    assert metrics["attribution.accused_share_of_negative"] == 0.69
    assert ArtifactKeys.ACCUSED == "gradian/accused.parquet"


@pytest.mark.slow
def test_retraining_without_the_accused_set_recovers_with_precision(tmp_path_factory, tinyworld_base):
    """``--drop accused`` on the on-topic poison: the capitals come back, and most dropped rows were planted."""
    pytest.importorskip("torch")
    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from gradian.counterfactual import load_planted, load_report, plan_removal, run_counterfactual
    from gradian.data import load_dataset
    from gradian.tinyworld import write_scenario
    from gradian.train import train_lora

    root = tmp_path_factory.mktemp("ontopic-cf")
    write_scenario("poison_capitals_ontopic", root, tinyworld_base)
    train = root / "train.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    for row in rows:
        row.pop("cluster")
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    train_lora(root / "gradian.yaml", root / "run")
    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu",
                                              "clustering.method": "auto", "clustering.explain_top_accused": 0})
    run_attribution(cfg, capability="capitals", cross_check="none", out_dir=root / "report")
    report, rankings = load_report(root / "report")
    data = load_dataset(cfg.dataset)
    planted = load_planted(root / "scenario.json", data)
    whole = plan_removal(data, report=report, rankings=rankings, drop="cluster")
    assert len(set(whole.drop_indices) & set(planted)) / whole.n_drop < 0.5
    plan = plan_removal(data, report=report, rankings=rankings, drop="accused")
    assert plan.n_drop == report["attribution"]["accused"]["n"]
    outcome = run_counterfactual(cfg, plan, out_dir=root / "cf", capability="capitals",
                                 before=report["capability"], planted=planted)
    block = outcome.report.to_json()["counterfactual"]
    assert block["outcome"] == "recovered", outcome.report.verdict.summary
    assert block["ground_truth"]["precision"] >= 0.8 and block["ground_truth"]["recall"] >= 0.8
