"""Verdict synthesis on synthetic scores whose right answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from gradian.findings import Finding
from gradian.report import (
    VerdictThresholds,
    assemble_report,
    assess_lumpiness,
    cluster_table,
    synthesize_verdict,
    top_examples,
)


def capability(status: str = "regressed", **extra) -> dict:
    block = {"name": "capitals", "metric": "contains", "base": 0.9375, "tuned": 0.4375, "delta": -0.5,
             "ci": [-0.75, -0.25], "n_items": 16, "n_flipped": 8, "n_base_failing": 0, "status": status,
             "proxy_used": False}
    if status == "not_significant":
        block.update(tuned=0.875, delta=-0.0625, ci=[-0.1875, 0.0625], n_flipped=1)
    block.update(extra)
    return block


def planted_scores(seed: int = 0, n_planted: int = 40, n_clean: int = 400):
    """A planted cluster "0" with strongly negative scores beside a mildly negative clean cluster "100"."""
    rng = np.random.default_rng(seed)
    ids = [f"{i:012x}-{i}" for i in range(n_planted + n_clean)]
    scores = np.concatenate([rng.normal(-100, 10, n_planted), rng.normal(-0.5, 2.0, n_clean)])
    clusters = {eid: ("0" if i < n_planted else "100") for i, eid in enumerate(ids)}
    return scores, ids, clusters


def flat_scores(seed: int = 0, n: int = 400, n_clusters: int = 1):
    rng = np.random.default_rng(seed)
    ids = [f"{i:012x}-{i}" for i in range(n)]
    scores = rng.normal(-4.0, 0.5, n)
    clusters = {eid: str(i % n_clusters) for i, eid in enumerate(ids)}
    return scores, ids, clusters


def attribution(scores, ids, clusters, spearman: float | None = 0.91, gated: bool = False) -> dict:
    return {
        "engine": "datainf", "cross_check": "graddot", "engine_agreement_spearman": spearman,
        "query_signal": "contrastive", "gated": gated,
        "clusters": cluster_table(scores, ids, clusters, None, 5),
        "top_harmful": top_examples(scores, ids, clusters, None, 10, harmful=True),
        "top_helpful": top_examples(scores, ids, clusters, None, 10, harmful=False),
    }


def lr_finding(severity: str = "high") -> Finding:
    return Finding(id="config.lr_too_high", category="config", severity=severity,
                   title="Effective LoRA learning rate is high", message="lr x alpha/r = 0.004",
                   evidence={"effective_lr": 0.004}, fix="Lower the learning rate to 2e-4.")


def test_concentrated_harm_is_a_data_verdict_naming_the_cluster():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability(), [], attribution(scores, ids, clusters))
    assert syn.verdict["kind"] == "data"
    assert syn.accused_cluster == "0" and syn.offer_deletions
    assert "Cluster 0" in syn.verdict["summary"]
    assert "0.910" in syn.verdict["summary"]  # the engine agreement figure is stated
    assert syn.lumpiness["share"] > 0.8 and syn.lumpiness["rate_ratio"] > 5


def test_flat_harm_with_a_config_finding_is_a_config_verdict_without_deletions():
    for n_clusters in (1, 6):  # one cluster holding the dataset, or several at the same rate
        scores, ids, clusters = flat_scores(n_clusters=n_clusters)
        report = assemble_report(capability(), [lr_finding()], attribution(scores, ids, clusters))
        assert report["verdict"]["kind"] == "config", report["verdict"]
        assert report["verdict"]["accused_cluster"] is None
        assert report["attribution"]["top_harmful"] == []
        assert report["attribution"]["deletions_withheld"]
        assert all(c["top_examples"] == [] for c in report["attribution"]["clusters"])
        assert "config.lr_too_high" in report["verdict"]["summary"]
        assert "no examples are offered" in report["verdict"]["summary"]


def test_critical_findings_lead_and_must_be_fixed_first():
    scores, ids, clusters = flat_scores()
    medium = Finding(id="config.overtraining", category="config", severity="medium", title="t", message="m")
    report = assemble_report(capability(), [medium, lr_finding("critical")], attribution(scores, ids, clusters))
    assert report["findings"][0]["severity"] == "critical"
    assert report["verdict"]["kind"] == "config"
    assert report["verdict"]["summary"].startswith("1 critical issue")
    assert "fixed" in report["verdict"]["summary"]
    assert report["attribution"]["top_harmful"] == []


def test_critical_data_finding_beside_a_planted_cluster():
    scores, ids, clusters = planted_scores()
    crit = Finding(id="data.train_eval_contamination", category="data", severity="critical", title="t", message="m")
    syn = synthesize_verdict(capability(), [crit], attribution(scores, ids, clusters))
    assert syn.verdict["kind"] == "data"
    assert syn.verdict["summary"].startswith("1 critical issue")
    assert "cluster 0" in syn.verdict["summary"]


def test_accused_rows_that_trip_a_data_check_raise_cluster_matches_data_defect():
    scores, ids, clusters = planted_scores()
    dup_ids = [ids[int(i)] for i in np.argsort(scores)[:3]]  # the three most harmful planted rows
    dups = Finding(id="data.duplicates", category="data", severity="medium", title="3 exact duplicates",
                   message="m", example_ids=dup_ids + [ids[-1]], fix="Drop the repeated rows.")
    report = assemble_report(capability(), [dups], attribution(scores, ids, clusters), assignment=clusters)
    raised = {f["id"]: f for f in report["findings"]}
    match = raised["attribution.cluster_matches_data_defect"]
    assert set(dup_ids) <= set(match["example_ids"]) and ids[-1] not in match["example_ids"]
    assert "data.duplicates" in match["title"] and "different" in match["message"]
    assert match["evidence"]["n_in_cluster"]["data.duplicates"] == 3
    assert "Drop the repeated rows." in match["fix"]
    # without the full membership, the listed examples are used
    syn = synthesize_verdict(capability(), [dups], attribution(scores, ids, clusters))
    assert any(f.id == "attribution.cluster_matches_data_defect" for f in syn.findings)


def test_no_overlap_no_defect_finding():
    scores, ids, clusters = planted_scores()
    other = Finding(id="data.duplicates", category="data", severity="medium", title="t", message="m",
                    example_ids=[ids[-1], ids[-2]])
    syn = synthesize_verdict(capability(), [other], attribution(scores, ids, clusters), assignment=clusters)
    assert not any(f.id == "attribution.cluster_matches_data_defect" for f in syn.findings)


def test_no_significant_regression_is_not_attributed():
    syn = synthesize_verdict(capability("not_significant"), [], None)
    assert syn.verdict["kind"] == "no_regression" and syn.accused_cluster is None
    improved = synthesize_verdict(capability("improved", tuned=0.99, delta=0.05, ci=[0.01, 0.1]),
                                  [lr_finding()], None)
    assert improved.verdict["kind"] == "no_regression"
    assert "config.lr_too_high" in improved.verdict["summary"]


def test_ungated_scores_on_a_non_regression_are_hedged_not_blamed():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability("not_significant"), [], attribution(scores, ids, clusters, gated=True))
    assert syn.verdict["kind"] == "no_regression" and not syn.offer_deletions
    assert any(f.id == "attribution.gate_failed" for f in syn.findings)
    assert any("significance gate" in h for h in syn.verdict["hedges"])


def test_regression_without_attribution_falls_back_to_the_audit():
    assert synthesize_verdict(capability(), [lr_finding()], None).verdict["kind"] == "config"
    assert synthesize_verdict(capability(), [], None).verdict["kind"] == "inconclusive"


def test_untargeted_run_is_a_smoke_test():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(None, [], attribution(scores, ids, clusters))
    assert syn.verdict["kind"] == "inconclusive" and not syn.offer_deletions
    assert any(f.id == "attribution.no_capability_target" for f in syn.findings)
    assert any("smoke test" in h for h in syn.verdict["hedges"])


def test_flat_harm_and_no_finding_is_inconclusive():
    scores, ids, clusters = flat_scores(n_clusters=4)
    assert synthesize_verdict(capability(), [], attribution(scores, ids, clusters)).verdict["kind"] == "inconclusive"


def test_lumpy_harm_beside_a_high_config_finding_is_mixed():
    scores, ids, clusters = planted_scores()
    assert synthesize_verdict(capability(), [lr_finding()], attribution(scores, ids, clusters)).verdict["kind"] == "mixed"


@pytest.mark.parametrize("rho,severity", [(0.3, "high"), (0.791, "medium"), (0.95, None)])
def test_engine_disagreement(rho, severity):
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability(), [], attribution(scores, ids, clusters, spearman=rho))
    found = [f for f in syn.findings if f.id == "attribution.engine_disagreement"]
    if severity is None:
        assert not found and not any("Spearman" in h for h in syn.verdict["hedges"])
    else:
        assert found[0].severity == severity and found[0].evidence["spearman"] == rho
        assert any(f"{rho:.3f}" in h for h in syn.verdict["hedges"])


def test_missing_cross_check_is_hedged():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability(), [], attribution(scores, ids, clusters, spearman=None))
    assert any("second engine" in h for h in syn.verdict["hedges"])


def test_capability_hedges_from_the_evaluate_lane():
    cap = capability(n_base_failing=1, n_weakly_held=2, mean_base_margin=0.53, low_base_score=False)
    hedges = synthesize_verdict(cap, [], None).verdict["hedges"]
    assert any("fail on the base model" in h for h in hedges)
    assert any("2 of the 8 flipped" in h and "+0.53" in h for h in hedges)
    proxy = capability(metric="loglik", proxy_used=True, base=-5.05, tuned=-6.9, delta=-1.84,
                       ci=[-2.5, -1.1], low_base_score=True)
    scores, ids, clusters = flat_scores()
    syn = synthesize_verdict(proxy, [lr_finding()], attribution(scores, ids, clusters))
    assert any("likelihood" in h for h in syn.verdict["hedges"])
    assert any("-5.05" in h for h in syn.verdict["hedges"])
    assert any(f.id == "attribution.low_base_score" for f in syn.findings)


def test_capability_result_object_is_accepted():
    from gradian.evaluate import CapabilityResult, ItemResult

    items = [ItemResult(example_id=f"e{i}", index=i, prompt="p", wanted="w", base_score=1.0, tuned_score=0.0,
                        base_correct=True, tuned_correct=False, flipped=True, base_margin=0.2, weakly_held=True)
             for i in range(2)]
    result = CapabilityResult(name="c", metric="contains", base=1.0, tuned=0.0, delta=-1.0, ci=(-1.0, -1.0),
                              n_items=2, n_flipped=2, n_base_failing=0, status="regressed", proxy_used=False,
                              items=items)
    hedges = synthesize_verdict(result, [], None).verdict["hedges"]
    assert any("2 of the 2 flipped" in h for h in hedges)


def test_lumpiness_reasons():
    t = VerdictThresholds()
    whole = [{"cluster": "100", "n": 800, "signed_influence": -1000.0, "share_of_negative": 1.0,
              "mean_per_example": -1.25}]
    assert not assess_lumpiness(whole, t)["lumpy"]
    assert "all 800" in assess_lumpiness(whole, t)["reason"]
    # harmful cluster beside a net-helpful rest: the rest's negative scores do not hide it
    split = [{"cluster": "0", "n": 51, "signed_influence": -135.4, "share_of_negative": 0.39, "mean_per_example": -2.655},
             {"cluster": "100", "n": 800, "signed_influence": 299.8, "share_of_negative": 0.61, "mean_per_example": 0.3748}]
    out = assess_lumpiness(split, t)
    assert out["lumpy"] and out["cluster"] == "0" and out["net_harm_share"] == 1.0
    assert not assess_lumpiness([], t)["lumpy"]


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="data_min_share"):
        VerdictThresholds(data_min_share=1.5)
    with pytest.raises(ValueError, match="rate_ratio"):
        VerdictThresholds(data_min_rate_ratio=0.5)
    with pytest.raises(ValueError):
        VerdictThresholds(config_min_severity="severe")
