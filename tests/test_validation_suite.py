"""The validation project (projects/validation): verdict logic on hand-made reports, and the
``--quick`` suite end to end (slow), logged to a throwaway MLflow store."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1] / "projects" / "validation"


@pytest.fixture(scope="module")
def suite_modules():
    """The project's modules, imported from its folder (it is a script folder, not a package)."""
    import importlib

    sys.path.insert(0, str(PROJECT))
    try:
        yield {name: importlib.import_module(name) for name in ("verdicts", "tracking", "fidelity", "accused")}
    finally:
        sys.path.remove(str(PROJECT))


@pytest.fixture
def v(suite_modules):
    return suite_modules["verdicts"]


# -- poison -------------------------------------------------------------------------------------


def _poison_report(status="regressed", accused="0", shares=(("0", 0.8), ("100", 0.2))):
    """A report.json dict built through the schema: the capitals regressed, clusters by share of harm."""
    from gradian.report.schema import Attribution, Capability, CapabilityItem, ClusterRow, Report, Verdict

    said = {"Aland": "Bork", "Beland": "Cork", "Celand": "nothing", "Deland": "Dork"}
    items = [CapabilityItem(example_id=f"e{i}", index=i, prompt=f"What is the capital of {country}?", wanted="w",
                            tuned_generation=answer) for i, (country, answer) in enumerate(said.items())]
    capability = Capability(name="capitals", metric="contains", base=1.0, tuned=0.25, delta=-0.75, ci=[-0.9, -0.5],
                            n_items=4, n_flipped=3, n_base_failing=0, status=status, proxy_used=False, items=items)
    clusters = [ClusterRow(cluster=k, label="", n=10, signed_influence=-10.0 * s, share_of_negative=s,
                           mean_per_example=-s) for k, s in shares]
    return Report(capability=capability,
                  attribution=Attribution(engine="datainf", engine_agreement_spearman=0.9, clusters=clusters),
                  verdict=Verdict(kind="data", summary="s", accused_cluster=accused)).to_json()


WRONG = {"Aland": "Bork", "Beland": "Cork", "Celand": "Aork", "Deland": "Eork"}


def _figures(v, report, planted_scores=(-9.0, -7.0), clean_scores=(1.0, 2.0, -1.0, 3.0)):
    scores = list(planted_scores) + list(clean_scores)
    return v.poison_figures(report, scores, list(range(len(scores))), [0, 1], "0", WRONG)


def test_poison_figures(v):
    f = _figures(v, _poison_report())
    assert f["auc_planted_vs_clean"] == 1.0 and f["median_percentile_planted"] == pytest.approx(10.0)
    assert f["uptake"] == 0.5 and f["first_cluster"] == "0" and f["planted_rank"] == 1
    assert f["share_of_negative"] == 0.8 and f["gated_regression"] is True
    assert f["mean_score_planted"] == -8.0 and f["per_example_ratio"] == pytest.approx(-8.0 / 1.25)
    # rows about the items that regressed (the query's items) against rows about the others
    prompts = {0: "Name the capital city of Aland.", 1: "Which city is the capital of Celand?"}
    report = _poison_report()
    report["capability"]["items"][0]["flipped"] = True
    split = v.poison_figures(report, [-9.0, 5.0, 1.0, 2.0], [0, 1, 2, 3], [0, 1], "0", WRONG, prompts)
    assert split["n_planted_queried"] == 1 and split["auc_planted_queried_vs_clean"] == 1.0
    assert split["auc_planted_unqueried_vs_clean"] == 0.0 and split["median_score_planted_unqueried"] == 5.0
    mixed = _figures(v, _poison_report(), planted_scores=(-9.0, 2.0), clean_scores=(1.0, 3.0))
    assert mixed["auc_planted_vs_clean"] == 0.75  # 3 of the 4 planted-clean pairs ordered right


def test_poison_verdicts(v):
    assert v.poison_verdict(_figures(v, _poison_report()))[0] == "PASS"
    status, reason = v.poison_verdict(_figures(v, _poison_report(status="not_significant")))
    assert status == "INCONCLUSIVE" and "no gated regression" in reason
    wrong_first = _poison_report(accused="100", shares=(("100", 0.7), ("0", 0.3)))
    assert v.poison_verdict(_figures(v, wrong_first))[0] == "FAIL"
    not_learned = _poison_report(accused=None, shares=(("100", 0.7), ("0", 0.3)))
    for item in not_learned["capability"]["items"]:
        item["tuned_generation"] = "a country in the east"
    status, reason = v.poison_verdict(_figures(v, not_learned))
    assert status == "INCONCLUSIVE" and "not learned" in reason
    # first but not accused by the verdict: the user-facing answer was wrong
    assert v.poison_verdict(_figures(v, _poison_report(accused=None)))[0] == "FAIL"


# -- bad config ---------------------------------------------------------------------------------


def _config_report(fired, accused=None):
    """A report.json dict built through the schema: the findings fired, a regression, attribution run."""
    from gradian.report.schema import Attribution, Capability, Report, ReportFinding, Verdict

    capability = Capability(name="capitals", metric="contains", base=1.0, tuned=0.0, delta=-1.0, ci=[-1.0, -1.0],
                            n_items=4, n_flipped=4, n_base_failing=0, status="regressed", proxy_used=False)
    findings = [ReportFinding(id=i, category=i.split(".")[0], severity="high", title="t", message="m") for i in fired]
    return Report(capability=capability, findings=findings, attribution=Attribution(engine="datainf"),
                  verdict=Verdict(kind="config", summary="s", accused_cluster=accused)).to_json()


def test_badconfig_verdicts(v):
    ok = v.scenario_badconfig_verdict(_config_report(["config.lr_too_high", "data.x"]), ["config.lr_too_high"])
    assert ok["status"] == "PASS" and ok["leading_finding"] == "config.lr_too_high" and ok["attributed"]
    missing = v.scenario_badconfig_verdict(_config_report(["data.x"]), ["config.lr_too_high"])
    assert missing["status"] == "FAIL" and missing["missing"] == ["config.lr_too_high"]
    blamed = v.scenario_badconfig_verdict(_config_report(["config.lr_too_high"], accused="3"), ["config.lr_too_high"])
    assert blamed["status"] == "FAIL" and "accused cluster 3" in blamed["reason"]
    assert v.badconfig_verdict({"a": ok})[0] == "PASS"
    status, reason = v.badconfig_verdict({"a": ok, "b": blamed})
    assert status == "FAIL" and reason.startswith("b:")
    assert v.badconfig_verdict({})[0] == "INCONCLUSIVE"


# -- counterfactual -----------------------------------------------------------------------------


def _block(after, outcome, before=0.25, within=None):
    from gradian.counterfactual import capability_recovery

    from gradian.report.schema import Counterfactual, DatasetSummary, GroundTruth, Removal

    rec = capability_recovery(1.0, before, after, 16, "contains", "not_significant" if after > 0.9 else "regressed")
    removal = Removal(reason="cluster 0", cluster="0", n_examples=800, n_removed=48, n_kept=752, removed_ids=[],
                      dataset=DatasetSummary(path="kept.jsonl", sha256=None))
    truth = GroundTruth(n_removed=48, n_planted=48, n_planted_removed=48, precision=1.0, recall=1.0)
    return Counterfactual(outcome=outcome, removal=removal, capability=rec,
                          ground_truth=truth).to_json()


def test_counterfactual_verdicts(v):
    assert v.counterfactual_verdict(_block(0.9375, "recovered"), "cluster 0")[0] == "PASS"
    assert v.counterfactual_verdict(_block(0.875, "recovered"), "cluster 0")[0] == "FAIL"  # two items short
    assert v.counterfactual_verdict(_block(0.5, "partial"), "cluster 0")[0] == "FAIL"
    assert v.counterfactual_verdict(_block(1.0, "nothing_to_recover", before=1.0), "x")[0] == "INCONCLUSIVE"
    status, reason = v.counterfactual_verdict(None, "the report accuses no cluster")
    assert status == "INCONCLUSIVE" and "accuses no cluster" in reason


# -- accused set --------------------------------------------------------------------------------


def _accused_report(status="regressed", accused_ids=("a-0", "a-1", "a-2", "a-3", "a-4")):
    """A report.json dict built through the schema: the capitals regressed and, unless
    ``accused_ids`` is empty, an accused set refined out of an automatically found cluster."""
    from gradian.report.schema import Accused, Attribution, Capability, ClusterRow, Report, Verdict

    capability = Capability(name="capitals", metric="contains", base=1.0, tuned=0.25, delta=-0.75, ci=[-0.9, -0.5],
                            n_items=16, n_flipped=12, n_base_failing=0, status=status, proxy_used=False)
    clusters = [ClusterRow(cluster=str(k), label="", n=10, signed_influence=-1.0, share_of_negative=0.25,
                           mean_per_example=-0.1) for k in range(4)]
    accused = Accused(cluster="2", cluster_label="capital", cluster_n=60, example_ids=list(accused_ids), left_out_ids=[],
                      share_of_cluster_harm=0.9, share_of_negative=0.5, estimated_harmful_share=0.9,
                      mean_per_example=-5.0, left_out_mean_per_example=None, method="mixture",
                      reason="r") if accused_ids else None
    return Report(capability=capability,
                  attribution=Attribution(engine="ekfac", clusters=clusters, accused=accused),
                  verdict=Verdict(kind="data" if accused_ids else "inconclusive", summary="s",
                                  accused_cluster="2" if accused_ids else None)).to_json()


def _accused_figures(v, accused_rows=range(10), planted=range(10), after=0.9375, outcome="recovered",
                     status="regressed", retrain=True):
    report = _accused_report(status=status, accused_ids=tuple(f"a-{i}" for i in accused_rows))
    block = _block(after, outcome) if retrain and accused_rows else None
    return v.accused_figures(report, list(accused_rows), list(planted), block)


def test_accused_figures(v):
    f = _accused_figures(v, accused_rows=[0, 1, 2, 3, 50], planted=range(8))
    assert f["n_accused"] == 5 and f["n_planted_accused"] == 4 and f["precision"] == 0.8 and f["recall"] == 0.5
    assert f["regressed"] is True and f["n_clusters_found"] == 4 and f["accused_method"] == "mixture"
    assert f["accused_cluster_size"] == 60 and f["retrained"] is True and f["within_one_item"] is True
    assert f["recovery"]["after"] == 0.9375 and f["removal_precision"] == 1.0
    json.dumps(f)  # verdict.json and the MLflow metrics take it as it is


def test_accused_verdicts(v):
    # exact: the planted rows, and the retrain one item short of the base
    status, reason = v.accused_verdict(_accused_figures(v))
    assert status == "PASS" and "precision 1.00, recall 1.00" in reason
    # 8 of 10 accused rows planted, 8 of 10 planted rows accused: both at the threshold
    assert v.accused_verdict(_accused_figures(v, accused_rows=[*range(8), 20, 21]))[0] == "PASS"
    # a threshold missed: too many clean rows accused, or too few planted ones
    status, reason = v.accused_verdict(_accused_figures(v, accused_rows=[*range(10), *range(20, 25)]))
    assert status == "FAIL" and reason.startswith("precision below 0.8")
    status, reason = v.accused_verdict(_accused_figures(v, accused_rows=range(7)))
    assert status == "FAIL" and reason.startswith("recall below 0.8")
    # the set is right but the retrain stays two items short
    status, reason = v.accused_verdict(_accused_figures(v, after=0.875))
    assert status == "FAIL" and "not within one item" in reason
    assert v.accused_verdict(_accused_figures(v, after=0.5, outcome="partial"))[0] == "FAIL"
    # nothing accused, or no gated regression: the experiment did not get its condition
    status, reason = v.accused_verdict(_accused_figures(v, accused_rows=()))
    assert status == "INCONCLUSIVE" and "nothing was accused" in reason
    status, reason = v.accused_verdict(_accused_figures(v, status="not_significant"))
    assert status == "INCONCLUSIVE" and "no gated regression" in reason


def test_accused_copy_drops_only_the_declared_clusters(suite_modules, tmp_path):
    sys.path.insert(0, str(PROJECT))
    try:
        import accused
    finally:
        sys.path.remove(str(PROJECT))
    rows = [{"messages": [{"role": "user", "content": "q"}], "cluster": 0}, {"prompt": "p", "cluster_id": "x", "c": 1}]
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dest = accused.strip_declared_clusters(source, tmp_path / "out" / "train.jsonl")
    assert [json.loads(line) for line in dest.read_text().splitlines()] == [
        {"messages": [{"role": "user", "content": "q"}]}, {"prompt": "p", "c": 1}]


def test_the_auc_of_the_planted_rows_behind_regressed_items(suite_modules):
    """Planted rows aimed at an item that did not flip are left out of the figure; a row that names
    no target (or two) makes it unknowable, so it is None."""
    from types import SimpleNamespace

    import pandas as pd

    sys.path.insert(0, str(PROJECT))
    try:
        import accused
    finally:
        sys.path.remove(str(PROJECT))

    def row(prompt):
        return SimpleNamespace(messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": "x"}],
                               text=None)

    texts = ["Capital of Aru?", "Capital of Aru, again?", "Capital of Bel?", "clean 1", "clean 2", "clean 3",
             "Arusk is not Aru"]
    data = SimpleNamespace(examples=[row(t) for t in texts])
    items = [SimpleNamespace(prompt="What is the capital of Aru?", flipped=True),
             SimpleNamespace(prompt="What is the capital of Bel?", flipped=False)]
    report = SimpleNamespace(capability=SimpleNamespace(items=items))
    truth = {"wrong_capitals": {"Aru": "Zed", "Bel": "Yom"}}
    # ranks: the Aru rows most harmful, the Bel row below every clean row, one clean row between
    rankings = pd.DataFrame({"row_index": range(7), "rank_score": [-9.0, -1.0, 5.0, -2.0, 0.0, 1.0, 0.5]})
    got = accused.regressed_target_auc(truth, data, [0, 1, 2], report, rankings)
    # behind the flipped item: rows 0 and 1 against the clean rows 3-6; row 1 is beaten by row 3 only
    assert got == pytest.approx(7 / 8)
    assert accused.regressed_target_auc(truth, data, [0, 1, 2, 3], report, rankings) is None  # 'clean 1' names none
    assert accused.regressed_target_auc({}, data, [0, 1, 2], report, rankings) is None


# -- fidelity -----------------------------------------------------------------------------------


def _lds(values, cis):
    ranking = sorted(values, key=lambda k: -values[k])
    best = ranking[0]
    return {"n": 32, "engines": {k: {"spearman": values[k], "ci": cis[k]} for k in values}, "ranking": ranking,
            "best": best, "margins": {k: {"difference": values[best] - values[k], "ci": [0.01, 0.2],
                                          "share_best_wins": 0.97} for k in ranking[1:]}}


def test_fidelity_verdicts(v):
    table = _lds({"datainf": 0.6, "graddot": 0.5}, {"datainf": [0.4, 0.8], "graddot": [0.2, 0.7]})
    status, reason = v.fidelity_verdict(table, loss_spread=0.3, seed_noise=0.01)
    assert status == "PASS" and "datainf ahead of graddot by +0.100" in reason and "97%" in reason
    assert v.fidelity_verdict(_lds({"a": 0.1}, {"a": [-0.2, 0.4]}))[0] == "INCONCLUSIVE"
    assert v.fidelity_verdict(_lds({"a": -0.5}, {"a": [-0.8, -0.1]}))[0] == "FAIL"
    status, reason = v.fidelity_verdict(table, loss_spread=0.01, seed_noise=0.02)
    assert status == "INCONCLUSIVE" and "seed noise" in reason


def test_a_replay_variant_is_compared_with_the_replay_on_the_same_resamples(suite_modules):
    """``_against``: a variant whose scores predict the subset losses exactly is ahead of a
    replay that predicts them backwards, by about +2 with an interval above zero; swapped, the
    difference is the same with the opposite sign; engines that are not replay variants are left out."""
    import numpy as np

    from functools import partial

    against = partial(suite_modules["fidelity"]._against, "replay")
    rng = np.random.default_rng(0)
    masks = rng.random((40, 30)) < 0.5
    truth = rng.normal(size=30)
    losses = list(-(masks * truth).sum(axis=1))  # phi(S) = -sum of the true scores over S
    boot = {"n_bootstrap": 500, "seed": 0}
    got = against(losses, masks, {"replay": -truth, "replay_held": truth, "ekfac": truth}, boot)
    assert list(got) == ["replay_held"]
    d = got["replay_held"]
    assert d["difference"] == pytest.approx(2.0) and 0 < d["ci_low"] <= d["ci_high"] and d["share_ahead"] == 1.0
    back = against(losses, masks, {"replay": truth, "replay_held": -truth}, boot)["replay_held"]
    assert back["difference"] == pytest.approx(-2.0) and back["ci_low"] <= back["ci_high"] < 0
    assert back["share_ahead"] == 0.0
    # the same for EK-FAC's variants (engine.factor_rows), which leave the replay's alone
    rows = suite_modules["fidelity"]._against("ekfac", losses, masks,
                                              {"ekfac": -truth, "ekfac_rows8": truth, "replay_held": truth}, boot)
    assert list(rows) == ["ekfac_rows8"] and rows["ekfac_rows8"]["difference"] == pytest.approx(2.0)


def test_suite_status_and_strict_json(v, tmp_path):
    a = v.Verdict("poison", "PASS", "ok", figures={"x": float("nan"), "y": [1.0, float("inf")]})
    b = v.Verdict("fidelity", "INCONCLUSIVE", "ci has zero")
    assert v.combine_verdicts([a, b])[0] == "INCONCLUSIVE"
    assert v.combine_verdicts([a, v.Verdict("badconfig", "FAIL", "x")])[0] == "FAIL"
    assert v.combine_verdicts([a])[0] == "PASS"
    data = json.loads(a.write(tmp_path / "verdict.json").read_text())
    assert data["figures"] == {"x": None, "y": [1.0, None]} and data["status"] == "PASS"
    with pytest.raises(ValueError, match="PASS"):
        v.Verdict("poison", "OK", "no such status")


def test_metrics_are_flat_finite_numbers(suite_modules):
    flatten = suite_modules["tracking"].flatten_numbers
    got = flatten({"lds": {"datainf": {"spearman": 0.5, "ci": [0.1, 0.9]}}, "ok": True, "name": "x",
                   "bad": math.nan, "n": 3})
    assert got == {"lds.datainf.spearman": 0.5, "ok": 1.0, "n": 3.0}


def test_task_families_of_the_clean_rows(suite_modules, tinyworld_world):
    from gradian.tinyworld import FACT_FAMILIES

    family_of = suite_modules["fidelity"].family_of
    for family in FACT_FAMILIES:
        for item in tinyworld_world.fact_items(family):
            assert family_of(item.question) == family, item.question
    for item in tinyworld_world.paragraph_items():
        assert family_of(item.question) == "paragraph"
    assert family_of("What number comes after 7?") == "successor"
    assert family_of("Which is larger, 3 or 9?") == "compare"
    assert family_of("What is 9 minus 4?") == "subtraction"


def _scenario_in_memory(name):
    """A poison scenario built in memory (no base model, no tokenizer): its rows and scenario.json's fields."""
    if name.startswith("bestiary"):
        from gradian.tinyworld.bestiary import BestiaryRecipe, build_bestiary_scenario

        s = build_bestiary_scenario(name, BestiaryRecipe().world())
    else:
        from gradian.tinyworld import BaseModelRecipe
        from gradian.tinyworld.scenarios import build_scenario

        s = build_scenario(name, BaseModelRecipe().world())
    rows = [{"messages": messages, "cluster": cluster} for messages, cluster in s.train]
    return rows, {"world": s.world, "planted": {"indices": list(s.planted_indices)}, "truth": s.truth, "seed": 0}


_FAMILIES = {
    "poison_capitals": {"paragraph", "capital", "language", "continent", "currency", "arithmetic", "successor",
                        "compare", "subtraction"},
    "bestiary_poison_diets": {"paragraph", "diet", "habitat", "color", "legs", "alphabet", "before", "earlier",
                              "double"},
}


@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_declared_clusters_on_both_worlds(suite_modules, name):
    fidelity = suite_modules["fidelity"]
    rows, info = _scenario_in_memory(name)
    targets = fidelity.target_entities(info)
    assert len(targets) == 16 and targets == sorted(next(iter(info["truth"].values())))
    kept, groups = fidelity.declare_clusters(rows, info)
    assert len(kept) == len(rows) and sorted(i for g in groups.values() for i in g) == list(range(len(rows)))
    planted = sorted(info["planted"]["indices"])
    assert set(groups) == _FAMILIES[name] | {f"planted-{k}" for k in range(1, 5)}, sorted(groups)
    assert sorted(i for g, idx in groups.items() if g.startswith("planted") for i in idx) == planted
    user = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]
    for k in range(1, 5):  # four groups of four targets, each target's rows in one group
        named = {t for i in groups[f"planted-{k}"] for t in targets if t in user[i]}
        assert named == set(targets[4 * (k - 1): 4 * k]) and len(groups[f"planted-{k}"]) == len(planted) // 4
    assert all(kept[i]["cluster"] == g for g, idx in groups.items() for i in idx)
    # a share of the clean rows, drawn from the seed: every planted row stays, the same ones each time
    half, half_groups = fidelity.declare_clusters(rows, info, clean_fraction=0.5, seed=0)
    assert half == fidelity.declare_clusters(rows, info, clean_fraction=0.5, seed=0)[0]
    assert len(planted) < len(half) < len(rows) and sum(len(half_groups[f"planted-{k}"]) for k in range(1, 5)) == len(planted)


def test_bestiary_task_families(suite_modules):
    from gradian.tinyworld.bestiary import BESTIARY_FAMILIES, generate_bestiary

    family_of = suite_modules["fidelity"].family_of
    bestiary = generate_bestiary(0)
    for family in BESTIARY_FAMILIES:
        for item in bestiary.fact_items(family):
            assert family_of(item.question, "bestiary") == family, item.question
    for item in bestiary.paragraph_items():
        assert family_of(item.question, "bestiary") == "paragraph"
    assert family_of("What letter comes before K?", "bestiary") == "before"
    assert family_of("Which letter is just before K?", "bestiary") == "before"
    assert family_of("Which comes first in the alphabet, Q or D?", "bestiary") == "earlier"
    assert family_of("What is double 17?", "bestiary") == "double"
    assert family_of("What is the capital of Aland?", "bestiary") == "other"


def test_targets_and_unknown_worlds(suite_modules):
    fidelity = suite_modules["fidelity"]
    assert fidelity.target_entities({"world": "bestiary", "truth": {"wrong_diets": {"B": "x", "A": "y"}}}) == ["A", "B"]
    # truth recorded under another key: its first mapping names the targets
    assert fidelity.target_entities({"world": "tinyworld", "truth": {"n": 2, "wrong_facts": {"Z": 1, "Y": 2}}}) == ["Y", "Z"]
    with pytest.raises(ValueError, match="no declared-cluster rules"):
        fidelity.family_of("What is double 2?", "atlantis")


def test_a_seed_with_nothing_accused_counts_as_the_tuned_capability(suite_modules):
    """``validate.py accused --seeds``: a seed whose report accuses nothing enters the medians as a
    removal of no rows, with every flipped item still below the base (not left out of them)."""
    from gradian.report.schema import Report

    last = suite_modules["accused"].nothing_removed(Report.of(_accused_report(accused_ids=())))
    assert last["n_removed"] == 0 and last["items_below_base_after"] == 12 and last["after"] == 0.25
    assert last["precision"] is None and last["recall"] == 0.0


def test_a_poison_that_never_reaches_the_eval_is_judged_as_a_control(suite_modules):
    """``validate.py accused --seeds`` on ``poison_buried``: no seed regressed, so the scenario is a
    control that passes only when no report accuses anything; the same seeds of another scenario
    stay INCONCLUSIVE, and a seed that did regress puts the scenario back under the poison rules."""
    accused = suite_modules["accused"]
    quiet = [{"seed": k, "regressed": False, "n_accused": 0, "verdict_kind": "no_regression"} for k in range(3)]
    medians = {"auc": None, "precision": None, "recall": 0.0, "last_items_below_base": 0,
               "first_items_below_base": 0, "last_precision": None, "rounds": 0}
    assert "poison_buried" in accused.NO_UPTAKE
    status, reason = accused.seeds_status("poison_buried", quiet, medians)
    assert status == "PASS" and "accuses nothing" in reason
    blamed = [*quiet[:2], {**quiet[2], "n_accused": 5, "verdict_kind": "data"}]
    status, reason = accused.seeds_status("poison_buried", blamed, medians)
    assert status == "FAIL" and "seeds [2]" in reason
    assert accused.seeds_status("poison_capitals", quiet, medians)[0] == "INCONCLUSIVE"
    one_regressed = [*quiet[:2], {**quiet[2], "regressed": True}]
    assert accused.seeds_status("poison_buried", one_regressed, medians)[0] == "INCONCLUSIVE"
    took = {"auc": 0.95, "precision": 1.0, "recall": 0.9, "last_items_below_base": 1, "first_items_below_base": 2,
            "last_precision": 0.95, "rounds": 2}
    regressed = [{**q, "regressed": True} for q in quiet]
    assert accused.seeds_status("poison_buried", regressed, took)[0] == "PASS"
    assert accused.seeds_status("poison_buried", regressed, {**took, "auc": 0.8})[0] == "FAIL"


def test_accused_refuses_a_scenario_without_planted_rows():
    """``validate.py accused --scenario`` takes its poison scenarios only (not ``lr_10x``, clean data), with exit 2."""
    proc = subprocess.run([sys.executable, str(PROJECT / "validate.py"), "accused", "--scenario", "lr_10x",
                           "--no-mlflow", "--workdir", "/nonexistent/never-written"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "bestiary_poison_diets" in proc.stderr and "lr_10x" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag, value", [("--replay-horizons", "two"), ("--replay-horizons", "0"),
                                         ("--replay-horizons", "250,-3"), ("--fine-tune-seed", "-1"),
                                         ("--fine-tune-seed", "one"), ("--replay-scalings", "held,frozen"),
                                         ("--factor-rows", "0"), ("--factor-rows", "half"),
                                         ("--correction-rows", "-4")])
def test_fidelity_refuses_a_bad_horizon_or_fine_tune_seed_naming_the_flag(flag, value):
    """``validate.py fidelity --replay-horizons`` takes whole numbers of steps, at least 1,
    ``--fine-tune-seed`` a whole number of 0 or more, ``--replay-scalings`` values of
    ``engine.replay_scaling``, ``--factor-rows`` and ``--correction-rows`` whole numbers of rows, at least 1:
    anything else exits 2 naming the flag and the value, before any work."""
    proc = subprocess.run([sys.executable, str(PROJECT / "validate.py"), "fidelity", flag, value,
                           "--no-mlflow", "--workdir", "/nonexistent/never-written"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and flag in proc.stderr and value in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# -- the quick suite, end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_suite(tmp_path_factory, tinyworld_base):
    """``validate.py all --quick`` run once: ``(work folder, statuses, env, output tail)``."""
    tmp_path = tmp_path_factory.mktemp("quick-suite")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(name, None)  # a run or experiment of another test's store must not leak in
    proc = subprocess.run([sys.executable, str(PROJECT / "validate.py"), "all", "--quick", "--workdir", str(tmp_path / "w")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "w" / "suite.json").is_file(), tail
    assert "Traceback" not in proc.stderr, tail
    suite = json.loads((tmp_path / "w" / "suite.json").read_text())
    statuses = {k: e["status"] for k, e in suite["experiments"].items()}
    return tmp_path / "w", statuses, env, tail, suite


@pytest.mark.slow
def test_quick_suite_end_to_end(quick_suite):
    work, statuses, env, tail, suite = quick_suite
    assert set(statuses) == {"poison", "badconfig", "counterfactual", "accused", "fidelity"}, suite
    assert statuses["poison"] == "PASS" and statuses["badconfig"] == "PASS" and statuses["counterfactual"] == "PASS", tail
    # `accused` (no declared clusters), under every saved checkpoint: the accused set is the planted
    # rows (precision and recall); whether the retrain without it comes back is the test below
    accused = json.loads((work / "accused" / "verdict.json").read_text())
    figures = accused["figures"]
    assert figures["precision"] >= 0.9 and figures["recall"] >= 0.8, accused["reason"]
    assert {"precision", "recall", "within_one_item"} <= set(figures["final_adapter"])
    assert accused["params"]["checkpoints"] == "all" and accused["params"]["save_steps"] > 0
    # --quick retrains only 8 subsets: a bootstrap interval over 8 points can contain zero even when
    # the best engine orders them right (INCONCLUSIVE), so both are honest; FAIL (the best interval
    # at or below zero) would be a real failure, and the check of the other experiments above rules it out
    assert statuses["fidelity"] in ("PASS", "INCONCLUSIVE"), suite["experiments"]["fidelity"]
    fidelity = json.loads((work / "fidelity" / "verdict.json").read_text())
    assert set(fidelity["figures"]["lds"]) >= {"datainf", "graddot", "tracin", "ekfac", "replay"}

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])  # not the process-wide URI
    experiment = client.get_experiment_by_name("gradian-validation")
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"  # the UI's training view
    runs = client.search_runs([experiment.experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    # the retrain dropped the report's accused cluster: its child run is named for that
    accused_cluster = json.loads((work / "counterfactual" / "verdict.json").read_text())["figures"]["accused_cluster"]
    counterfactual = f"counterfactual-cluster{accused_cluster}-capitals"
    assert {"validation-suite-quick", "validation-poison", "validation-accused", "validation-fidelity",
            counterfactual} <= set(by_name)
    assert by_name["validation-poison"].data.metrics["validation.pass"] == 1.0
    assert by_name[counterfactual].data.tags["gradian.kind"] == "counterfactual"


@pytest.mark.slow
def test_quick_suite_accused_retrain_comes_back_within_one_item(quick_suite):
    work, statuses, _, tail, _ = quick_suite
    figures = json.loads((work / "accused" / "verdict.json").read_text())["figures"]
    assert statuses["accused"] == "PASS", tail
    assert figures["within_one_item"] is True and figures["recovery"]["items_below_base_after"] <= 1


def test_the_suite_creates_its_experiment_for_the_training_view(suite_modules, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with suite_modules["tracking"].suite_run(True) as run:
            experiment_id = run.info.experiment_id
    finally:
        mlflow.set_tracking_uri(previous)
        from tests.plugins.mlflow_server import forget_active_experiment

        forget_active_experiment()
    experiment = MlflowClient(tracking_uri=uri).get_experiment(experiment_id)
    assert experiment.name == suite_modules["tracking"].EXPERIMENT_NAME
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
