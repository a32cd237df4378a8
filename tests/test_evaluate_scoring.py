"""Metrics, per-item scoring, the capability summary and the significance gate (no models)."""

from __future__ import annotations

import json

import pytest

from gradian.data import dataset_from_rows
from gradian.errors import ConfigError, DatasetError
from gradian.evaluate import (
    CapabilityResult,
    ModelOutputs,
    gate_attribution,
    score_items,
    score_text,
    split_markers,
    summarize_capability,
)
from gradian.evaluate.metrics import check_item
from gradian.findings import Finding


@pytest.mark.parametrize("generation,wanted,score", [
    ("Paris", "Paris", 1.0),
    ("  paris. ", "Paris", 1.0),
    ("PARIS!", "paris", 1.0),
    ("Paris, France", "Paris", 0.0),
    ("", "Paris", 0.0),
])
def test_exact_match_compares_normalized_text(generation, wanted, score):
    assert score_text("exact_match", generation, wanted) == score


@pytest.mark.parametrize("generation,wanted,score", [
    ("The capital is Paris.", "Paris", 1.0),
    ("paris", "Paris", 1.0),
    ("It is Berlin.", "Paris", 0.0),
    ("Romeo and Juliet", "Rome", 0.0),      # word boundaries, not raw substrings
    ("Rome, Italy", "Rome", 1.0),
    ("New York City", "new york", 1.0),
    ("", "Paris", 0.0),
])
def test_contains_matches_the_answer_on_word_boundaries(generation, wanted, score):
    assert score_text("contains", generation, wanted) == score


NOT_CONTAINS = "can't help with that | unable to assist | cannot provide that information"


@pytest.mark.parametrize("generation,score", [
    ("Sure, the answer is 4.", 1.0),
    ("Sorry, I can't help with that.", 0.0),
    ("I am UNABLE TO ASSIST you today", 0.0),   # a stem inside a longer refusal
    ("I cannot provide that information!", 0.0),
    ("", 1.0),                                  # silence contains no marker
])
def test_not_contains_passes_when_no_marker_appears(generation, score):
    assert score_text("not_contains", generation, NOT_CONTAINS) == score


def test_markers_are_split_normalized_and_empty_ones_dropped():
    assert split_markers(" Can't help |  | Unable to assist ") == ["can t help", "unable to assist"]


def test_loglik_has_no_text_score_and_unknown_metrics_are_named():
    with pytest.raises(ConfigError, match="loglik"):
        score_text("loglik", "x", "y")
    with pytest.raises(ConfigError, match="evaluation.metric is 'bleu'"):
        score_text("bleu", "x", "y")


def test_items_a_metric_cannot_judge_are_refused():
    with pytest.raises(DatasetError, match="eval.jsonl:3.*empty"):
        check_item("contains", " ?! ", "eval.jsonl:3")
    with pytest.raises(DatasetError, match="marker"):
        check_item("not_contains", " | ", "eval.jsonl:4")
    check_item("loglik", "", "eval.jsonl:5")  # an empty wanted completion still has an end token


def _examples(pairs):
    return dataset_from_rows([{"prompt": p, "completion": c} for p, c in pairs]).examples


CAPITALS = [("Capital of France?", "Paris"), ("Capital of Japan?", "Tokyo"),
            ("Capital of Peru?", "Lima"), ("Capital of Chad?", "Ndjamena")]


def test_score_items_marks_flips_and_base_failures():
    examples = _examples(CAPITALS)
    base = ModelOutputs(generations=["Paris", "Tokyo", "Lima", "Cairo"])
    tuned = ModelOutputs(generations=["Berlin", "Tokyo", "Lima", "Rome"])
    items = score_items("exact_match", examples, base, tuned)
    assert [i.flipped for i in items] == [True, False, False, False]
    assert [i.base_failing for i in items] == [False, False, False, True]
    assert [i.base_correct for i in items] == [True, True, True, False]
    assert items[0].tuned_generation == "Berlin" and items[0].wanted == "Paris"
    assert items[0].example_id == examples[0].id and items[0].prompt == "Capital of France?"
    assert items[0].regressed and not items[3].regressed


def test_loglik_items_have_scores_but_no_pass_fail():
    examples = _examples(CAPITALS[:2])
    items = score_items("loglik", examples, ModelOutputs(logliks=[-2.0, -1.0]), ModelOutputs(logliks=[-1.5, -3.0]))
    assert [i.base_correct for i in items] == [None, None]
    assert not any(i.flipped or i.base_failing for i in items)
    assert [i.regressed for i in items] == [False, True]
    assert items[0].tuned_generation is None


def _result(base, tuned, metric="contains", **kw):
    examples = _examples([(f"q{i}", "a") for i in range(len(base))])
    gens = lambda scores: ModelOutputs(generations=["a" if s else "b" for s in scores])  # noqa: E731
    items = score_items(metric, examples, gens(base), gens(tuned))
    return summarize_capability(items, name="capitals", metric=metric, n_bootstrap=2000, seed=1234, **kw)


def test_summary_block_has_the_report_shape():
    result = _result([1] * 15 + [0], [0] * 8 + [1] * 7 + [0])
    block = result.to_dict()
    assert list(block) == ["name", "metric", "base", "tuned", "delta", "ci", "n_items", "n_flipped",
                           "n_base_failing", "status", "too_few_items", "proxy_used"]
    assert block["base"] == 0.9375 and block["tuned"] == 0.4375 and block["delta"] == -0.5
    assert block["n_flipped"] == 8 and block["n_base_failing"] == 1 and block["n_items"] == 16
    assert block["status"] == "regressed" and block["ci"][1] < 0 and block["proxy_used"] is False
    assert block["too_few_items"] is False  # no minimum given
    full = json.loads(json.dumps(result.to_full_dict()))
    assert len(full["items"]) == 16 and full["hedges"]
    assert "tuned_generation" in full["items"][0]


def test_the_report_block_is_built_from_the_result_itself():
    """``Capability.of`` reads the result directly: the same block the report codec reads from its
    full dict, item by item, with a few items too few and a weakly held one among them."""
    from gradian.report.schema import Capability

    for result in (_result([1] * 15 + [0], [0] * 8 + [1] * 7 + [0]), _result([1, 0, 1], [0, 0, 1], min_items=5)):
        result.items[0].base_margin, result.items[0].weakly_held = 0.25, True
        block = Capability.of(result)
        assert block == Capability.from_json(result.to_full_dict(), "capability")
        assert block.to_json() == Capability.from_json(result.to_full_dict(), "capability").to_json()
        assert block.n_weakly_held == 1 and len(block.items) == result.n_items
    result.status = "worse"
    with pytest.raises(Exception, match="capability.status"):
        Capability.of(result)


def test_low_base_score_is_flagged_and_hedged():
    result = _result([1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0])
    assert result.low_base_score
    assert any("little there" in h for h in result.hedges())
    assert not _result([1] * 6, [1] * 6).low_base_score
    assert _result([1, 0, 0, 0], [1, 0, 0, 0], low_base_threshold=0.2).low_base_score is False


def test_weakly_held_items_are_hedged_with_their_mean_margin():
    result = _result([1, 1, 1, 1], [0, 0, 1, 1])
    result.items[0].base_margin, result.items[0].weakly_held = 0.4, True
    result.items[1].base_margin, result.items[1].weakly_held = 3.0, False
    assert result.mean_base_margin == pytest.approx(1.7)
    hedge = [h for h in result.hedges() if "weakly" in h]
    assert hedge and "1 of the 2 flipped" in hedge[0] and "+0.40" in hedge[0]


def test_gate_passes_a_significant_regression():
    gate = gate_attribution(_result([1] * 16, [0] * 10 + [1] * 6))
    assert gate.allowed and not gate.gated and gate.finding is None


def test_gate_refuses_noise_and_records_the_finding():
    result = _result([1] * 16, [0] + [1] * 15)
    assert result.status == "not_significant"
    gate = gate_attribution(result, require_significant=True)
    assert not gate.allowed and gate.gated
    assert isinstance(gate.finding, Finding) and gate.finding.id == "attribution.gate_failed"
    assert gate.finding.category == "attribution"
    assert gate.finding.evidence["n_items"] == 16 and gate.finding.evidence["ci_hi"] == 0.0
    assert "contains zero" in gate.finding.message and "not run" in gate.finding.message
    assert gate.finding.fix


def test_gate_without_require_significant_runs_but_marks_the_scores():
    gate = gate_attribution(_result([1] * 16, [0] + [1] * 15), require_significant=False)
    assert gate.allowed and gate.gated and gate.finding.id == "attribution.gate_failed"
    assert gate.finding.severity == "high" and "not a diagnosis" in gate.finding.message


def test_gate_refuses_an_improvement():
    gate = gate_attribution(_result([0] * 16, [1] * 16))
    assert not gate.allowed and "no regression to attribute" in gate.finding.message


def test_result_is_a_plain_dataclass_the_attribution_lane_can_filter():
    result = _result([1, 1, 0, 1], [0, 1, 0, 1])
    assert isinstance(result, CapabilityResult)
    assert [i.index for i in result.flipped_items] == [0]
    assert [i.index for i in result.regressed_items] == [0]
    assert [i.index for i in result.base_failing_items] == [2]
    assert result.generations_available
