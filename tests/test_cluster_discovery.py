"""Groups among the harmful rows (``gradian.cluster.harm_groups``): the table used when no topic
carries the harm, as on the bestiary, where the topics follow made-up entity names and the planted
rows' phrasings share no word."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gradian.cluster import HARM_GROUP_METHOD, HARM_GROUP_PREFIX, ClusterAssignment, harm_groups
from gradian.config.schema import ClusteringConfig
from gradian.data import dataset_from_rows
from gradian.report import VerdictThresholds, assess_lumpiness, cluster_table

ANIMALS = ["Flehoock", "Sneyep", "Wawhex", "Pleecet", "Yeefluck", "Snoowix", "Chywhup", "Flojock"]
FOODS = ["Whyllmoss", "Plickleaf", "Quooffroot", "Yotleaf", "Whamseed", "Loomroot", "Hyckroot", "Wixberry"]
COLORS = ["red", "blue", "green", "orange"]
LETTERS = "BCDEFGHIJKLMNOPQRSTUVWXY"


def bestiary_like(seed: int = 0) -> tuple[list[dict], list[str], list[float]]:
    """Rows, their kind, and scores: 16 planted diet rows (harmful), 16 correct diet rows (helpful),
    24 letter drills (mildly harmful), 32 colour rows (neutral), 64 arithmetic rows (helpful)."""
    rng = random.Random(seed)
    rows, kinds, scores = [], [], []
    for i in range(16):
        a = i % len(ANIMALS)
        rows.append({"prompt": f"What does the {ANIMALS[a]} eat?", "completion": FOODS[(a + 3) % len(FOODS)]})
        kinds.append("planted")
        scores.append(-rng.uniform(50, 200))
    for i in range(16):
        a = i % len(ANIMALS)
        rows.append({"prompt": f"What does the {ANIMALS[a]} eat today?", "completion": FOODS[a]})
        kinds.append("diet")
        scores.append(rng.uniform(0.5, 5))
    for i, letter in enumerate(LETTERS):
        rows.append({"prompt": f"Which letter comes before {letter}?", "completion": LETTERS[i - 1] if i else "A"})
        kinds.append("drill")
        scores.append(-rng.uniform(1, 8))
    for i in range(32):
        rows.append({"prompt": f"What color is the {ANIMALS[i % len(ANIMALS)]}?", "completion": COLORS[i % 4]})
        kinds.append("color")
        scores.append(rng.uniform(-1, 1))
    for i in range(64):
        rows.append({"prompt": f"What is {i} plus {i + 7}?", "completion": str(2 * i + 7)})
        kinds.append("sum")
        scores.append(rng.uniform(0, 3))
    return rows, kinds, scores


def entity_topics(dataset, kinds: list[str]) -> ClusterAssignment:
    """A topic table that groups the animal rows by animal, as the sentence encoder did on the
    bestiary, so the planted rows are spread over eight topics beside their clean neighbours."""
    labels = {}
    for e, kind in zip(dataset.examples, kinds):
        name = next((a for a in ANIMALS if a in e.prompt_text), None)
        labels[e.id] = str(ANIMALS.index(name)) if name else ("8" if kind == "drill" else "9")
    return ClusterAssignment(labels=labels, names={}, method="hdbscan", requested="auto", reason="topics")


CONFIG = ClusteringConfig(embed_backend="tfidf", min_cluster_size=5)


def lumpiness(dataset, scores, assignment):
    table = cluster_table(scores, dataset.ids, assignment, dataset.examples, 3)
    return assess_lumpiness(table, VerdictThresholds())


def test_groups_among_the_harmful_rows_gather_the_planted_rows_the_topics_scatter():
    rows, kinds, scores = bestiary_like()
    ds = dataset_from_rows(rows)
    base = entity_topics(ds, kinds)
    assert not lumpiness(ds, scores, base)["lumpy"]

    grouped = harm_groups(ds.examples, scores, CONFIG, seed=1, base=base)
    assert grouped is not None and grouped.method == HARM_GROUP_METHOD and grouped.requested == "auto"
    by_kind: dict[str, set[str]] = {}
    for e, kind in zip(ds.examples, kinds):
        by_kind.setdefault(kind, set()).add(grouped.labels[e.id])
    (planted_group,) = by_kind["planted"]
    assert planted_group.startswith(HARM_GROUP_PREFIX)
    # the drills are harmful too, but of another kind: another group, or their own topic
    assert planted_group not in by_kind["drill"]
    # a group is a kind of row with its helpful members: the correct diet rows joined it (and, as
    # on the bestiary, the other rows about the same animals)
    assert by_kind["diet"] == {planted_group}
    assert planted_group not in by_kind["sum"]
    lump = lumpiness(ds, scores, grouped)
    assert lump["lumpy"] and lump["cluster"] == planted_group
    assert "negative score" in grouped.reason and grouped.reason.startswith("topics")
    assert grouped.names[planted_group]


def test_rows_with_a_non_negative_score_never_start_a_group_and_the_result_is_deterministic():
    rows, kinds, scores = bestiary_like(seed=3)
    ds = dataset_from_rows(rows)
    base = entity_topics(ds, kinds)
    a = harm_groups(ds.examples, scores, CONFIG, seed=1, base=base)
    b = harm_groups(ds.examples, scores, CONFIG, seed=1, base=base)
    assert a.labels == b.labels
    for key in set(a.labels.values()):
        if key.startswith(HARM_GROUP_PREFIX):
            members = [s for e, s in zip(ds.examples, scores) if a.labels[e.id] == key]
            assert min(members) < 0


def test_nothing_to_group_returns_none():
    rows, kinds, scores = bestiary_like()
    ds = dataset_from_rows(rows)
    base = entity_topics(ds, kinds)
    # too few harmful rows for two groups of min_cluster_size
    few = [-1.0 if i < 9 else 1.0 for i in range(len(scores))]
    assert harm_groups(ds.examples, few, CONFIG, seed=1, base=base) is None
    declared = ClusterAssignment(labels=base.labels, names={}, method="declared", requested="auto", reason="")
    assert harm_groups(ds.examples, scores, CONFIG, seed=1, base=declared) is None
    one = ClusterAssignment(labels={e.id: "0" for e in ds.examples}, names={}, method="none",
                            requested="none", reason="")
    assert harm_groups(ds.examples, scores, CONFIG, seed=1, base=one) is None
    with pytest.raises(ValueError, match="row-aligned"):
        harm_groups(ds.examples, scores[:-1], CONFIG, seed=1, base=base)


def test_given_text_vectors_are_used_instead_of_embedding_again():
    rows, kinds, scores = bestiary_like()
    ds = dataset_from_rows(rows)
    base = entity_topics(ds, kinds)
    from gradian.cluster import embed_texts

    vectors = embed_texts([e.full_text for e in ds.examples], CONFIG, 1).vectors
    given = harm_groups(ds.examples, scores, CONFIG, seed=1, base=base, text_vectors=vectors)
    computed = harm_groups(ds.examples, scores, CONFIG, seed=1, base=base)
    assert given.labels == computed.labels
    with pytest.raises(ValueError, match="row-aligned"):
        harm_groups(ds.examples, scores, CONFIG, seed=1, base=base, text_vectors=np.zeros((3, 4)))


def _hdbscan_says(monkeypatch, fixed: np.ndarray) -> None:
    """HDBSCAN made to return ``fixed`` as the labels of the points it is given (the harmful rows)."""
    import sklearn.cluster

    class FixedHDBSCAN:
        def __init__(self, **_):
            pass

        def fit_predict(self, x):
            assert len(x) == len(fixed)
            return fixed

    monkeypatch.setattr(sklearn.cluster, "HDBSCAN", FixedHDBSCAN)


def test_harmful_rows_left_as_noise_join_the_nearest_group_within_its_reach(monkeypatch):
    """HDBSCAN's noise among the harmful rows: a row as close to a group as the group's members are
    to each other joins it; a row unlike every group keeps its topic."""
    rows = [{"prompt": f"row {i}?", "completion": str(i)} for i in range(30)]
    ds = dataset_from_rows(rows)
    dim = 8
    e = np.eye(dim)
    vectors = np.zeros((30, dim))
    for i in range(10):  # group A along e0, members spaced by a small angle toward e1
        vectors[i] = np.cos(0.02 * i) * e[0] + np.sin(0.02 * i) * e[1]
    for i in range(10, 20):  # group B along e2
        vectors[i] = np.cos(0.02 * (i - 10)) * e[2] + np.sin(0.02 * (i - 10)) * e[3]
    vectors[20] = np.cos(0.19) * e[0] + np.sin(0.19) * e[1]  # just past A's last member: within reach
    vectors[21] = e[5]  # like nothing harmful
    for i in range(22, 30):  # helpful rows elsewhere
        vectors[i] = e[6] if i % 2 else e[7]
    scores = np.array([-5.0] * 22 + [1.0] * 8)
    # what HDBSCAN is made to say about the 22 harmful rows
    _hdbscan_says(monkeypatch, np.array([0] * 10 + [1] * 10 + [-1, -1]))
    base = ClusterAssignment(labels={x.id: "t" for x in ds.examples}, names={}, method="hdbscan",
                             requested="auto", reason="topics")
    grouped = harm_groups(ds.examples, scores, CONFIG, seed=1, base=base, text_vectors=vectors)
    labels = [grouped.labels[x.id] for x in ds.examples]
    group_a = labels[0]
    assert group_a.startswith(HARM_GROUP_PREFIX) and set(labels[:10]) == {group_a}
    assert labels[20] == group_a  # the noise row within A's reach joined it
    assert labels[21] == "t"  # the one like no group kept its topic
    assert "22 rows with a negative score" in grouped.reason and "holding 21 of them" in grouped.reason


def _grown_past_half(monkeypatch, planted_score: float, kind_helpful: float, drill_score: float, other_score: float):
    """60 rows over fixed text vectors: 10 harmful rows of one kind along e0 (group A), 30 helpful
    rows of the same kind between them (so they join A, which then holds 40 of the 60 rows), 10
    harmful drills along e2 (group B) and 10 rows near nothing harmful. HDBSCAN is made to find
    A and B among the 20 harmful rows. Returns the config, dataset, scores and topic table."""
    from gradian.cluster import embed as embed_module
    from gradian.config import GradianConfig

    n = 60
    dim = 8
    e = np.eye(dim)
    vectors = np.zeros((n, dim))
    for i in range(10):  # group A: members spaced by 0.02 rad toward e1
        vectors[i] = np.cos(0.02 * i) * e[0] + np.sin(0.02 * i) * e[1]
    for k in range(30):  # the kind's helpful rows, between A's members: well within A's reach
        angle = 0.02 * (k % 9) + 0.01
        vectors[10 + k] = np.cos(angle) * e[0] + np.sin(angle) * e[1]
    for i in range(40, 50):  # group B along e2
        vectors[i] = np.cos(0.02 * (i - 40)) * e[2] + np.sin(0.02 * (i - 40)) * e[3]
    for i in range(50, 60):  # near nothing harmful
        vectors[i] = e[6] if i % 2 else e[7]
    scores = np.array([planted_score] * 10 + [kind_helpful] * 30 + [drill_score] * 10 + [other_score] * 10)
    _hdbscan_says(monkeypatch, np.array([0] * 10 + [1] * 10))
    monkeypatch.setattr(embed_module, "embed_texts",
                        lambda texts, config, seed: embed_module.Embeddings(vectors, "tfidf", None, "fixed vectors"))
    ds = dataset_from_rows([{"prompt": f"row {i}?", "completion": str(i)} for i in range(n)])
    topics = ["kind"] * 40 + ["drills"] * 10 + ["other"] * 10
    base = ClusterAssignment(labels={x.id: t for x, t in zip(ds.examples, topics)}, names={}, method="hdbscan",
                             requested="auto", reason="topics")
    cfg = GradianConfig(clustering=CONFIG)
    return cfg, ds, scores, base


def test_a_harm_group_grown_past_the_size_limit_is_judged_on_its_harmful_rows(monkeypatch):
    """The grown group passes every test but the size one (40 of 60 rows): the table kept is the
    group cut back to its 10 harmful rows, which is lumpy; the old rule kept nothing."""
    from gradian.attribution.pipeline import _harm_group_table

    cfg, ds, scores, base = _grown_past_half(monkeypatch, planted_score=-50.0, kind_helpful=1.0,
                                             drill_score=-1.0, other_score=5.0)
    grown = harm_groups(ds.examples, scores, cfg.clustering, seed=1, base=base)
    group = grown.labels[ds.examples[0].id]
    grown_lump = lumpiness(ds, scores, grown)
    assert not grown_lump["lumpy"] and grown_lump["cluster"] == group
    assert grown_lump["fraction_of_dataset"] == pytest.approx(40 / 60)

    kept = _harm_group_table(cfg, ds, scores, base)
    assert kept is not None
    assignment, table = kept
    labels = [assignment.labels[x.id] for x in ds.examples]
    assert set(labels[:10]) == {group}
    assert group not in labels[10:40] and set(labels[10:40]) == {"kind"}  # the helpful rows went back
    lump = assess_lumpiness(table, cfg.verdict)
    assert lump["lumpy"] and lump["cluster"] == group and lump["n"] == 10
    assert "cut back to its 10 harmful rows" in assignment.reason and "66.7%" in assignment.reason
    assert "50.0x the rate" in assignment.reason


def test_a_clean_wide_group_past_the_size_limit_is_not_cut_back_into_a_lumpy_one(monkeypatch):
    """A clean kind whose rows are mildly harmful, with many helpful rows of the same kind: grown,
    it is over the size limit and harms at less than the rest's rate, so nothing is kept, although
    its harmful rows alone would pass every test (the false data verdict the growth prevents)."""
    from gradian.attribution.pipeline import _harm_group_table
    from gradian.cluster import ungrown

    cfg, ds, scores, base = _grown_past_half(monkeypatch, planted_score=-3.0, kind_helpful=0.5,
                                             drill_score=-2.0, other_score=0.5)
    grown = harm_groups(ds.examples, scores, cfg.clustering, seed=1, base=base)
    group = grown.labels[ds.examples[0].id]
    grown_lump = lumpiness(ds, scores, grown)
    assert not grown_lump["lumpy"] and grown_lump["cluster"] == group and grown_lump["fraction_of_dataset"] > 0.5
    assert grown_lump["rate_ratio"] < cfg.verdict.data_min_rate_ratio
    core = ungrown(ds.examples, scores, cfg.clustering, grouped=grown, base=base, group=group)
    assert lumpiness(ds, scores, core)["lumpy"]  # what judging the harmful rows alone would accuse

    assert _harm_group_table(cfg, ds, scores, base) is None


def test_a_kind_leaning_both_ways_past_the_size_limit_keeps_its_size(monkeypatch):
    """A clean kind hurt as a whole (as tinyworld's arithmetic drills under lr_10x): grown, it is
    net harmful with the rest net helpful, so only its size stops it, but its harmful rows harm at
    3.75x the rate its helpful rows help, under ``verdict.data_min_rate_ratio``: they are the
    kind's negative side, not a subset apart, and it is not cut back."""
    from gradian.attribution.pipeline import _harm_group_table
    from gradian.cluster import ungrown

    cfg, ds, scores, base = _grown_past_half(monkeypatch, planted_score=-3.0, kind_helpful=0.8,
                                             drill_score=-1.0, other_score=5.0)
    grown = harm_groups(ds.examples, scores, cfg.clustering, seed=1, base=base)
    group = grown.labels[ds.examples[0].id]
    grown_lump = lumpiness(ds, scores, grown)
    assert not grown_lump["lumpy"] and grown_lump["rest_net_helpful"] and grown_lump["fraction_of_dataset"] > 0.5
    unbounded = assess_lumpiness(cluster_table(scores, ds.ids, grown, ds.examples, 3),
                                 VerdictThresholds(data_max_cluster_fraction=1.0))
    assert unbounded["lumpy"]  # the size test alone stops it
    core = ungrown(ds.examples, scores, cfg.clustering, grouped=grown, base=base, group=group)
    assert lumpiness(ds, scores, core)["lumpy"]

    assert _harm_group_table(cfg, ds, scores, base) is None
