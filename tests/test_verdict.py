"""The verdict on synthetic scores whose right answer is known: the decision asserted as data
(``decide_verdict`` -> ``VerdictDecision``), its wording (``render_verdict``, ``render_hedge``)
tested apart."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gradian.findings import Finding
from gradian.report import (
    VerdictThresholds,
    assemble_report,
    assess_lumpiness,
    cluster_table,
    decide_verdict,
    render_verdict,
    synthesize_verdict,
    top_examples,
)
from gradian.report.schema import Accused, Attribution, Capability, ClusterRow, ExampleRow, Harm, Lumpiness
from gradian.report.decision import CapabilityFigures, EngineAgreement, Hedge, VerdictDecision, lumpiness_of
from gradian.report.verdict_prose import render_hedge


def capability(status: str = "regressed", **extra) -> dict:
    """The capability block as report.json holds it."""
    block = {"name": "capitals", "metric": "contains", "base": 0.9375, "tuned": 0.4375, "delta": -0.5,
             "ci": [-0.75, -0.25], "n_items": 16, "n_flipped": 8, "n_base_failing": 0, "status": status,
             "proxy_used": False}
    if status == "not_significant":
        block.update(tuned=0.875, delta=-0.0625, ci=[-0.1875, 0.0625], n_flipped=1)
    block.update(extra)
    return Capability(**block).to_json()


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
    """The attribution block as report.json holds it."""
    return Attribution(
        engine="datainf", cross_check="graddot", engine_agreement_spearman=spearman,
        query_signal="contrastive", gated=gated, n_examples=len(ids),
        clusters=[ClusterRow.from_json(c) for c in cluster_table(scores, ids, clusters, None, 5)],
        top_harmful=[ExampleRow.from_json(r) for r in top_examples(scores, ids, clusters, None, 10, harmful=True)],
        top_helpful=[ExampleRow.from_json(r) for r in top_examples(scores, ids, clusters, None, 10, harmful=False)],
    ).to_json()


def cluster_row(cluster: str, n: int, signed_influence: float, share_of_negative: float) -> ClusterRow:
    return ClusterRow(cluster=cluster, label="", n=n, signed_influence=signed_influence,
                      share_of_negative=share_of_negative, mean_per_example=signed_influence / n)


def lr_finding(severity: str = "high") -> Finding:
    return Finding(id="config.lr_too_high", category="config", severity=severity,
                   title="Effective LoRA learning rate is high", message="lr x alpha/r = 0.004",
                   evidence={"effective_lr": 0.004}, fix="Lower the learning rate to 2e-4.")



def gate_finding() -> Finding:
    """The evaluate lane's finding for scores computed past a failed gate (``gate_attribution``)."""
    return Finding(id="attribution.gate_failed", category="attribution", severity="high",
                   title="No significant regression in 'capitals'; attribution is not a diagnosis", message="m")


def codes(decision: VerdictDecision) -> set[str]:
    return {h.code for h in decision.hedges}


# -- the decision, as data ----------------------------------------------------------------------


def test_concentrated_harm_is_a_data_verdict_naming_the_cluster():
    scores, ids, clusters = planted_scores()
    d = decide_verdict(capability(), [], attribution(scores, ids, clusters))
    assert (d.kind, d.rule, d.accused_cluster, d.offer_deletions) == ("data", "lumpy", "0", True)
    assert d.attributed and d.attribution_ran
    assert d.engine_agreement == EngineAgreement("datainf", "graddot", 0.91)
    assert d.lumpiness is not None and d.lumpiness.share > 0.8 and d.lumpiness.rate_ratio > 5
    assert d.capability == CapabilityFigures("capitals", "contains", 0.9375, 0.4375, -0.5, (-0.75, -0.25), 16, 8,
                                             False, "regressed")
    assert d.hedges == ()


def test_a_topic_net_helpful_in_loss_units_is_judged_again_in_the_rankings_units():
    """Refusals planted in a topic whose clean rows help the query far more in loss units (a few
    rows with large gradients): flat there, lumpy in the ranking's units, so the verdict reads data
    and names the topic; the harm in nats stays the loss-unit share. Without a ranked table, or
    when it is flat too, the verdict is what the loss units say."""
    import dataclasses

    ids = [f"{i:012x}-{i}" for i in range(300)]
    labels = {eid: ("topic" if i < 120 else "drills") for i, eid in enumerate(ids)}
    loss = np.concatenate([np.full(40, -50.0), np.full(20, 200.0), np.zeros(60), np.full(180, -0.2)])
    rank = np.concatenate([np.full(40, -5.0), np.full(20, 0.5), np.zeros(60), np.full(180, -0.05)])
    block = Attribution.from_json(attribution(loss, ids, labels))
    flat = decide_verdict(capability(), [lr_finding("medium")], block)
    assert (flat.kind, flat.accused_cluster) == ("config", None)
    ranked = dataclasses.replace(block, ranked_clusters=[ClusterRow.from_json(c)
                                                         for c in cluster_table(rank, ids, labels, None, 5)])
    d = decide_verdict(capability(), [lr_finding("medium")], ranked)
    assert (d.kind, d.rule, d.accused_cluster, d.offer_deletions) == ("data", "lumpy", "topic", True)
    assert d.lumpiness.reason.startswith("in the ranking's units") and "in loss units" in d.lumpiness.reason
    loss_row = next(c for c in block.clusters if c.cluster == "topic")
    assert d.lumpiness.share_of_negative == pytest.approx(loss_row.share_of_negative)
    flat_rank = dataclasses.replace(block, ranked_clusters=[ClusterRow.from_json(c) for c in cluster_table(
        np.full(300, -1.0), ids, labels, None, 5)])
    assert decide_verdict(capability(), [lr_finding("medium")], flat_rank).kind == "config"


def test_decision_is_frozen_and_repeatable():
    scores, ids, clusters = planted_scores()
    args = (capability(), [lr_finding()], attribution(scores, ids, clusters))
    d = decide_verdict(*args)
    assert decide_verdict(*args) == d
    # the typed blocks decide as their report.json dicts do
    assert decide_verdict(Capability.from_json(args[0]), [lr_finding().to_dict()], Attribution.from_json(args[2])) == d
    with pytest.raises(AttributeError):
        d.kind = "data"  # type: ignore[misc]


def test_flat_harm_with_a_config_finding_is_a_config_verdict_without_deletions():
    for n_clusters in (1, 6):  # one cluster holding the dataset, or several at the same rate
        scores, ids, clusters = flat_scores(n_clusters=n_clusters)
        d = decide_verdict(capability(), [lr_finding()], attribution(scores, ids, clusters))
        assert (d.kind, d.rule, d.accused_cluster, d.offer_deletions) == ("config", "flat_config", None, False)
        assert d.config_ids == ("config.lr_too_high",) and d.lead_config_title == lr_finding().title


def test_config_causes_are_led_by_the_most_severe():
    scores, ids, clusters = flat_scores(n_clusters=4)
    medium = Finding(id="config.overtraining", category="config", severity="medium", title="t", message="m")
    d = decide_verdict(capability(), [medium, lr_finding()], attribution(scores, ids, clusters))
    assert d.rule == "flat_config" and d.config_ids == ("config.lr_too_high", "config.overtraining")


def test_flat_harm_withholds_deletions_in_the_report():
    scores, ids, clusters = flat_scores(n_clusters=6)
    report = assemble_report(capability(), [lr_finding()], attribution(scores, ids, clusters))
    assert report["verdict"]["kind"] == "config" and report["verdict"]["accused_cluster"] is None
    assert report["attribution"]["top_harmful"] == []
    assert report["attribution"]["deletions_withheld"]
    assert all(c["top_examples"] == [] for c in report["attribution"]["clusters"])


def test_critical_findings_lead_and_must_be_fixed_first():
    scores, ids, clusters = flat_scores()
    medium = Finding(id="config.overtraining", category="config", severity="medium", title="t", message="m")
    d = decide_verdict(capability(), [medium, lr_finding("critical")], attribution(scores, ids, clusters))
    assert (d.kind, d.rule, d.critical_ids, d.offer_deletions) == ("config", "critical", ("config.lr_too_high",), False)
    report = assemble_report(capability(), [medium, lr_finding("critical")], attribution(scores, ids, clusters))
    assert report["findings"][0]["severity"] == "critical"
    assert report["attribution"]["top_harmful"] == []


def test_critical_data_finding_beside_a_planted_cluster():
    scores, ids, clusters = planted_scores()
    crit = Finding(id="data.train_eval_contamination", category="data", severity="critical", title="t", message="m")
    d = decide_verdict(capability(), [crit], attribution(scores, ids, clusters))
    assert (d.kind, d.rule, d.accused_cluster) == ("data", "critical", "0")


def test_critical_config_finding_beside_a_planted_cluster_is_mixed():
    scores, ids, clusters = planted_scores()
    d = decide_verdict(capability(), [lr_finding("critical")], attribution(scores, ids, clusters))
    assert (d.kind, d.rule, d.accused_cluster) == ("mixed", "critical", "0")


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


def test_rows_that_teach_the_eval_another_answer_are_counted_in_the_accused_set():
    from gradian.cluster import refine_accused
    from gradian.findings import EVAL_CONFLICT_ID

    scores, ids, clusters = planted_scores()
    members = [i for i, eid in enumerate(ids) if clusters[eid] == "0"]
    accused = refine_accused("0", [ids[i] for i in members], scores[members])
    block = attribution(scores, ids, clusters)
    block["accused"] = Accused.of(accused).to_json()
    held = accused.example_ids[:30]
    conflict = Finding(id=EVAL_CONFLICT_ID, category="data", severity="high", title="t", message="m.",
                       evidence={"row_ids": held + ids[-5:]}, example_ids=held[:3])
    report = assemble_report(capability(), [conflict], block, assignment=clusters)
    joined = next(f for f in report["findings"] if f["id"] == EVAL_CONFLICT_ID)
    assert joined["evidence"]["in_accused_set"] == 30
    assert f"holds 30 of these 35 rows (30 of its {accused.n})" in joined["message"]
    acc = report["attribution"]["accused"]
    assert (acc["eval_conflict_rows"], acc["eval_conflict_in_set"]) == (35, 30)
    # no accused set (flat harm): the finding stands as the audit wrote it
    flat, flat_ids, flat_clusters = flat_scores()
    plain = assemble_report(capability(), [conflict], attribution(flat, flat_ids, flat_clusters), assignment=flat_clusters)
    assert next(f for f in plain["findings"] if f["id"] == EVAL_CONFLICT_ID)["message"] == "m."


def test_no_overlap_no_defect_finding():
    scores, ids, clusters = planted_scores()
    other = Finding(id="data.duplicates", category="data", severity="medium", title="t", message="m",
                    example_ids=[ids[-1], ids[-2]])
    syn = synthesize_verdict(capability(), [other], attribution(scores, ids, clusters), assignment=clusters)
    assert not any(f.id == "attribution.cluster_matches_data_defect" for f in syn.findings)


def test_no_significant_regression_is_not_attributed():
    d = decide_verdict(capability("not_significant"), [], None)
    assert (d.kind, d.rule, d.accused_cluster, d.attribution_ran) == ("no_regression", "no_regression", None, False)
    improved = decide_verdict(capability("improved", tuned=0.99, delta=0.05, ci=[0.01, 0.1]), [lr_finding()], None)
    assert (improved.kind, improved.serious_ids) == ("no_regression", ("config.lr_too_high",))


def test_ungated_scores_on_a_non_regression_are_hedged_not_blamed():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability("not_significant"), [gate_finding()],
                             attribution(scores, ids, clusters, gated=True))
    d = syn.decision
    assert (d.kind, d.accused_cluster, d.offer_deletions, d.attributed) == ("no_regression", None, False, False)
    assert codes(d) == {"gated"}
    # the gate's finding is the evaluate lane's: the verdict does not build a second one
    assert not any(f.id == "attribution.gate_failed" for f in syn.findings)


def test_gated_scores_on_a_regression_never_accuse_a_cluster():
    scores, ids, clusters = planted_scores()  # lumpy, but the gate failed (e.g. too few items)
    d = decide_verdict(capability(), [gate_finding()], attribution(scores, ids, clusters, gated=True))
    assert (d.kind, d.rule, d.accused_cluster, d.offer_deletions) == ("inconclusive", "unexplained", None, False)


def test_regression_without_attribution_falls_back_to_the_audit():
    d = decide_verdict(capability(), [lr_finding(), gate_finding()], None)
    assert (d.kind, d.rule, d.gate_title) == ("config", "not_attributed", gate_finding().title)
    assert decide_verdict(capability(), [], None).kind == "inconclusive"


def test_untargeted_run_is_a_smoke_test():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(None, [], attribution(scores, ids, clusters))
    assert (syn.decision.kind, syn.decision.rule, syn.offer_deletions) == ("inconclusive", "no_target", False)
    assert any(f.id == "attribution.no_capability_target" for f in syn.findings)
    assert codes(syn.decision) == {"no_target"}


def test_flat_harm_and_no_finding_is_inconclusive():
    scores, ids, clusters = flat_scores(n_clusters=4)
    d = decide_verdict(capability(), [], attribution(scores, ids, clusters))
    assert (d.kind, d.rule) == ("inconclusive", "unexplained")


def test_flat_harm_beside_a_high_data_finding_is_data_without_a_cluster():
    scores, ids, clusters = flat_scores(n_clusters=4)
    bad = Finding(id="data.empty_completions", category="data", severity="high", title="t", message="m")
    d = decide_verdict(capability(), [bad], attribution(scores, ids, clusters))
    assert (d.kind, d.rule, d.accused_cluster, d.data_high_ids) == ("data", "flat_data", None,
                                                                    ("data.empty_completions",))


def test_lumpy_harm_beside_a_high_config_finding_is_mixed():
    scores, ids, clusters = planted_scores()
    d = decide_verdict(capability(), [lr_finding()], attribution(scores, ids, clusters))
    assert (d.kind, d.rule, d.accused_cluster, d.high_config_ids) == ("mixed", "lumpy", "0", ("config.lr_too_high",))


def test_audit_alone_uses_the_same_decision():
    from gradian.audit import AuditResult, SkippedCheck, audit_verdict

    data = Finding(id="data.duplicates", category="data", severity="high", title="t", message="m")
    result = AuditResult(findings=[lr_finding("critical"), data], ran=["a", "b"],
                         skipped=[SkippedCheck("c", "data", "no tokenizer")])
    verdict = audit_verdict(result)
    expected = decide_verdict(None, result.findings, None)
    assert (expected.kind, expected.rule) == ("config", "critical")  # the critical finding leads
    assert verdict["kind"] == "config" and verdict["summary"] == render_verdict(expected)
    assert verdict["hedges"] == [render_hedge(Hedge("checks_skipped", {"n_skipped": 1, "n_checks": 3}))]
    assert audit_verdict(AuditResult(findings=[data]))["kind"] == "data"
    assert audit_verdict(AuditResult(findings=[lr_finding(), data]))["kind"] == "mixed"
    assert audit_verdict(AuditResult())["kind"] == "inconclusive"


@pytest.mark.parametrize("rho,severity", [(0.3, "high"), (0.791, "medium"), (0.95, None)])
def test_engine_disagreement(rho, severity):
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability(), [], attribution(scores, ids, clusters, spearman=rho))
    found = [f for f in syn.findings if f.id == "attribution.engine_disagreement"]
    if severity is None:
        assert not found and syn.decision.hedges == ()
    else:
        assert found[0].severity == severity and found[0].evidence["spearman"] == rho
        assert syn.decision.hedges == (Hedge("engine_disagreement", {"spearman": rho}),)


def test_missing_cross_check_is_hedged():
    scores, ids, clusters = planted_scores()
    d = decide_verdict(capability(), [], attribution(scores, ids, clusters, spearman=None))
    assert codes(d) == {"no_cross_check"} and d.engine_agreement is None


def test_capability_hedges_from_the_evaluate_lane():
    cap = capability(n_base_failing=1, n_weakly_held=2, mean_base_margin=0.53, low_base_score=False)
    assert decide_verdict(cap, [], None).hedges == (
        Hedge("base_failing", {"n_base_failing": 1, "n_items": 16}),
        Hedge("weakly_held", {"n_weakly_held": 2, "n_flipped": 8, "mean_base_margin": 0.53}))
    proxy = capability(metric="loglik", proxy_used=True, base=-5.05, tuned=-6.9, delta=-1.84,
                       ci=[-2.5, -1.1], low_base_score=True)
    scores, ids, clusters = flat_scores()
    syn = synthesize_verdict(proxy, [lr_finding()], attribution(scores, ids, clusters))
    assert codes(syn.decision) == {"low_base", "proxy_metric"} and syn.decision.low_base
    assert any(f.id == "attribution.low_base_score" for f in syn.findings)


def test_low_base_is_the_capability_flag_not_recomputed():
    # 0.3 is below the evaluate lane's LOW_BASE_SCORE, but the lane (with its own threshold) did not
    # flag it: the verdict follows the flag
    d = decide_verdict(capability(base=0.3, low_base_score=False), [], None)
    assert not d.low_base and "low_base" not in codes(d)


def test_capability_result_object_is_accepted():
    from gradian.evaluate import CapabilityResult, ItemResult

    items = [ItemResult(example_id=f"e{i}", index=i, prompt="p", wanted="w", base_score=1.0, tuned_score=0.0,
                        base_correct=True, tuned_correct=False, flipped=True, base_margin=0.2, weakly_held=True)
             for i in range(2)]
    result = CapabilityResult(name="c", metric="contains", base=1.0, tuned=0.0, delta=-1.0, ci=(-1.0, -1.0),
                              n_items=2, n_flipped=2, n_base_failing=0, status="regressed", proxy_used=False,
                              items=items)
    d = decide_verdict(result, [], None)
    assert (d.kind, d.rule) == ("inconclusive", "not_attributed")
    assert d.hedges == (Hedge("weakly_held", {"n_weakly_held": 2, "n_flipped": 2, "mean_base_margin": 0.2}),)


# -- the words ------------------------------------------------------------------------------------


def test_verdict_block_words_the_decision():
    scores, ids, clusters = planted_scores()
    syn = synthesize_verdict(capability(), [], attribution(scores, ids, clusters, spearman=0.3))
    assert syn.verdict == {"kind": "data", "summary": render_verdict(syn.decision),
                           "hedges": [render_hedge(h) for h in syn.decision.hedges],
                           "accused_cluster": "0", "accused_set_n": None, "harm": None}


def _decision(**fields) -> VerdictDecision:
    cap = CapabilityFigures("capitals", "contains", 0.9375, 0.4375, -0.5, (-0.75, -0.25), 16, 8, False, "regressed")
    return VerdictDecision(**{"capability": cap, **fields})


def lumpiness(reason: str, **figures) -> Lumpiness:
    return Lumpiness(**{"lumpy": False, "cluster": None, "n_clusters": 4, "n_examples": 400, "reason": reason,
                        **figures})


def test_prose_of_a_lumpy_decision():
    lump = lumpiness("r", lumpy=True, cluster="0", label="planted", n=40, mean_per_example=-100.0,
                     rest_mean_per_example=-0.5, share_of_negative=0.8, net_harm_share=0.8, rate_ratio=200.0)
    accused = Accused(cluster="0", cluster_label="planted", cluster_n=40, example_ids=[f"a{i}" for i in range(30)],
                      left_out_ids=[f"b{i}" for i in range(10)], share_of_cluster_harm=0.9, share_of_negative=0.7,
                      estimated_harmful_share=0.75, mean_per_example=-120.0, left_out_mean_per_example=-40.0,
                      method="gmm", reason="r")
    text = render_verdict(_decision(kind="data", rule="lumpy", accused_cluster="0", lumpiness=lump,
                                    accused_set=accused, engine_agreement=EngineAgreement("datainf", "graddot", 0.91)))
    assert text == (
        "'capitals' (contains) went 0.9375 -> 0.4375 (delta -0.5000, 95% CI [-0.7500, -0.2500]) over 16 items; "
        "8 flipped from right to wrong. Cluster 0 (planted) carries 80% of the negative influence: 40 examples, "
        "each 200x as harmful as the rest on average. Inside it, the accused set is 30 of its 40 rows: they carry "
        "90% of the cluster's harm, an estimated 75% of them harmful; the other 10 rows (their mean score -40 "
        "against -120 for the set) are left out. Engine agreement (Spearman, datainf vs graddot): 0.910.")
    assert "per example" not in text  # raw influence per row is not a unit a reader can act on

    # with the query loss measured, the harm is stated in its units
    harm = Harm(unit="nats per token", rise=2.0, cluster_share=0.8, cluster_loss=1.6, accused_share=0.7,
                accused_loss=1.4, accused_first_order=-30.0)
    text = render_verdict(_decision(kind="data", rule="lumpy", accused_cluster="0", lumpiness=lump,
                                    accused_set=accused, harm=harm))
    assert ("The regressed items' query loss rose 2 nats per token from base to tuned; by its share, about 1.6 "
            "nats per token of that is this cluster's.") in text
    assert ("Removing the accused set should lower that loss by about 1.4 nats per token (its 70% share of the "
            "rise); the first-order estimate, 30 nats per token, is 21x that, as a linear estimate of removing "
            "many rows at once overshoots.") in text
    close = render_verdict(_decision(kind="data", rule="lumpy", accused_cluster="0", lumpiness=lump,
                                     accused_set=accused, harm=dataclasses.replace(harm, accused_first_order=-1.2)))
    assert "the first-order estimate, 1.2 nats per token, agrees." in close


def test_harm_applies_the_shares_to_the_measured_rise_of_the_query_loss():
    from gradian.report.decision import harm_of
    from gradian.report.schema import QueryLoss

    lump = lumpiness("r", lumpy=True, cluster="0", n=40, share_of_negative=0.8)
    accused = Accused(cluster="0", cluster_label="planted", cluster_n=40, example_ids=[f"a{i}" for i in range(30)],
                      left_out_ids=[], share_of_cluster_harm=0.9, share_of_negative=0.7, estimated_harmful_share=0.75,
                      mean_per_example=-120.0, left_out_mean_per_example=None, method="gmm", reason="r")
    attr = Attribution(engine="ekfac", n_examples=400,
                       query_loss=QueryLoss(signal="contrastive", unit="nats per token", base=-1.0, tuned=1.5,
                                            rise=2.5, n_items=8))
    harm = harm_of(attr, lump, accused)
    assert harm is not None and harm.unit == "nats per token" and harm.rise == 2.5
    assert harm.cluster_loss == pytest.approx(2.0) and harm.accused_loss == pytest.approx(1.75)
    assert harm.accused_first_order == pytest.approx(-120.0 * 30 / 400)
    assert harm_of(Attribution(engine="ekfac", n_examples=400), lump, accused) is None  # nothing measured
    fell = dataclasses.replace(attr, query_loss=dataclasses.replace(attr.query_loss, tuned=-2.0, rise=-1.0))
    assert harm_of(fell, lump, accused) is None  # the query loss did not rise: no share of a rise to state


def test_prose_of_a_critical_decision():
    text = render_verdict(_decision(kind="config", rule="critical", critical_ids=("config.lr_too_high",),
                                    attributed=True))
    assert text.startswith("1 critical issue(s) invalidate or dominate this run and must be fixed before anything "
                           "else is read: config.lr_too_high. 'capitals' (contains) went")
    assert text.endswith("No cluster stands out in the influence scores; nothing is offered for deletion.")


def test_prose_of_a_flat_config_decision():
    text = render_verdict(_decision(kind="config", rule="flat_config", lumpiness=lumpiness("flat"),
                                    config_ids=("config.lr_too_high", "config.overtraining"),
                                    lead_config_title="LR high"))
    assert "spread flatly over the data (flat)" in text and "no examples are offered for deletion" in text
    assert text.endswith("The audit names the cause: config.lr_too_high (LR high), with config.overtraining.")


def test_prose_of_the_other_rules():
    improved = CapabilityFigures("c", "contains", 0.9, 0.99, 0.09, (0.01, 0.1), 16, 0, False, "improved")
    no_reg = render_verdict(_decision(kind="no_regression", rule="no_regression",
                                      serious_ids=("config.lr_too_high",), capability=improved))
    assert no_reg.startswith("'c' improved: ")
    assert no_reg.endswith("There is no regression to attribute. The audit still raised: config.lr_too_high.")
    gate = render_verdict(_decision(kind="inconclusive", rule="not_attributed", gate_title="Only 1 eval item(s)"))
    assert "Attribution did not run (Only 1 eval item(s)); no high or critical audit finding" in gate
    audit_only = VerdictDecision(kind="data", rule="no_target", serious_ids=("data.duplicates",))
    assert render_verdict(audit_only) == "The audit names 1 high-severity cause(s): data.duplicates."
    data = render_verdict(_decision(kind="data", rule="flat_data", data_high_ids=("data.empty_completions",),
                                    lumpiness=lumpiness("r")))
    assert "but the audit found data defects: data.empty_completions. Fix those rows first." in data
    assert "(no clusters) and no audit finding" in render_verdict(_decision(kind="inconclusive", rule="unexplained"))


@pytest.mark.parametrize("hedge,words", [
    (Hedge("base_failing", {"n_base_failing": 1, "n_items": 16}), "1 of 16 eval items fail on the base model"),
    (Hedge("low_base", {"base": -5.05}), "scored only -5.05 before training"),
    (Hedge("weakly_held", {"n_weakly_held": 2, "n_flipped": 8, "mean_base_margin": 0.53}),
     "on 2 of the 8 flipped items, mean margin +0.53 nats"),
    (Hedge("proxy_metric", {"metric": "loglik"}), "'loglik' scores likelihood"),
    (Hedge("engine_disagreement", {"spearman": 0.791}), "agree only at Spearman 0.791"),
    (Hedge("no_cross_check"), "No second engine"),
    (Hedge("gated"), "significance gate"),
    (Hedge("no_target"), "smoke test"),
    (Hedge("checks_skipped", {"n_skipped": 1, "n_checks": 3}), "1 of 3 checks were skipped"),
])
def test_hedge_prose(hedge, words):
    assert words in render_hedge(hedge)


def test_unknown_hedge_code_is_refused():
    with pytest.raises(ValueError, match="bogus"):
        render_hedge(Hedge("bogus"))


# -- lumpiness and thresholds ---------------------------------------------------------------------


def test_lumpiness_reasons():
    t = VerdictThresholds()
    whole = [cluster_row("100", 800, -1000.0, 1.0)]
    assert not lumpiness_of(whole, t).lumpy
    assert "all 800" in lumpiness_of(whole, t).reason
    # harmful cluster beside a net-helpful rest: the rest's negative scores do not hide it
    split = [cluster_row("0", 51, -135.4, 0.39), cluster_row("100", 800, 299.8, 0.61)]
    out = lumpiness_of(split, t)
    assert out.lumpy and out.cluster == "0" and out.net_harm_share == 1.0
    assert not lumpiness_of([], t).lumpy
    # the cluster table's rows, as report.json holds them, give the same dict
    assert assess_lumpiness([c.to_json() for c in split], t) == out.to_json()
    # the only net-harmful cluster, holding a sliver of the harm while the harmful rows sit in a
    # net-helpful cluster (poison_eval_prompts, one fine-tune): all of the net harm, not lumpy
    sliver = [cluster_row("harm-2", 18, -3961.4, 0.016), cluster_row("harm-1", 329, 292810.0, 0.64),
              cluster_row("harm-0", 473, 7047.7, 0.344)]
    out = lumpiness_of(sliver, t)
    assert not out.lumpy and out.net_harm_share == 1.0 and "data_min_negative_share" in out.reason
    assert lumpiness_of(sliver, VerdictThresholds(data_min_negative_share=0.01)).lumpy


def test_thresholds_are_validated():
    with pytest.raises(ValueError, match="data_min_share"):
        VerdictThresholds(data_min_share=1.5)
    with pytest.raises(ValueError, match="rate_ratio"):
        VerdictThresholds(data_min_rate_ratio=0.5)
    with pytest.raises(ValueError, match="data_min_negative_share"):
        VerdictThresholds(data_min_negative_share=-0.1)
    with pytest.raises(ValueError):
        VerdictThresholds(config_min_severity="severe")
