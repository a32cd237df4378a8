"""The broken-config scenarios of the case studies: each fires the checks that name its defect.

Built in memory as equivalents of tinyworld's scenarios (800 clean rows, a healthy run, one
injected defect each); the assertions are the ones the scenarios must meet.
"""

from __future__ import annotations

import copy

import pytest

from gradian.audit import run_audit
from tests.test_audit_checks import clean_rows, healthy_logs, inputs, make_run

ROWS = clean_rows(800, seed=7)


def _ids(result, at_least: str = "low") -> dict[str, str]:
    return {f.id: f.severity for f in result.findings if f.at_least(at_least)}


def _clipping_logs():
    steps = healthy_logs()
    for s in steps:
        s.grad_norm = 0.6 if s.step % 33 == 0 else 2.5  # 97% of steps at or above max_grad_norm=1
    steps[59].loss = 8.0
    return steps


@pytest.fixture(scope="module")
def baseline():
    return run_audit(**inputs(rows=ROWS))


def test_healthy_800_rows_has_nothing_serious(baseline):
    assert not baseline.at_least("high"), _ids(baseline)


def test_twelve_epochs_is_overtraining():
    result = run_audit(**inputs(rows=ROWS, run=make_run({"num_train_epochs": "12"})))
    assert _ids(result, "high") == {"config.overtraining": "high"}
    (f,) = [f for f in result.findings if f.id == "config.overtraining"]
    assert "12 epochs over 800 examples" in f.title


def test_lr_ten_times_is_critical_with_the_effective_figure():
    result = run_audit(**inputs(rows=ROWS, run=make_run({"learning_rate": "0.002", "num_train_epochs": "3"})))
    assert _ids(result, "high") == {"config.lr_too_high": "critical"}
    (f,) = result.at_least("critical")
    assert "(lr=0.002 x alpha/r=2 = 0.004)" in f.title
    # 3 epochs over 800 rows: the medium flag the reference reports beside the critical rate
    assert _ids(result)["config.overtraining"] == "medium"


def test_batch_one_at_5e4_is_unstable():
    run = make_run({"learning_rate": "5e-4", "per_device_train_batch_size": "1",
                    "gradient_accumulation_steps": "1"}, logs=_clipping_logs())
    found = _ids(run_audit(**inputs(rows=ROWS, run=run)))
    assert found["config.lr_too_high"] == "high"
    assert found["config.small_effective_batch"] == "medium"
    assert found["dynamics.always_clipping"] == "medium"
    assert found["dynamics.loss_spike"] == "medium"


def test_short_max_seq_length_truncates_answers():
    run = make_run({"max_length": "18"})
    result = run_audit(**inputs(rows=ROWS, run=run))
    found = _ids(result)
    assert found["data.completion_truncated"] == "critical"
    assert found["data.no_supervised_tokens"] == "critical"
    assert found["config.max_seq_length_vs_data"] == "high"
    assert result.verdict()["summary"].startswith("2 critical issue(s) invalidate or dominate this run")


def test_attention_only_targets():
    run = make_run(lora={"target_modules": ["q_proj", "v_proj"]})
    result = run_audit(**inputs(rows=ROWS, run=run))
    assert _ids(result, "medium") == {"config.attention_only_targets": "medium"}


def test_eval_inside_train_is_contamination():
    eval_rows = copy.deepcopy(ROWS[:64])
    result = run_audit(**inputs(rows=ROWS, eval_rows=eval_rows))
    (f,) = result.at_least("critical")
    assert f.id == "data.train_eval_contamination"
    assert f.evidence["n_contaminated"] == 64 and f.evidence["with_same_answer"] == 64
    assert "64 eval items (100.0%)" in f.title


def test_planted_contradictions_are_conflicting_answers():
    rows = copy.deepcopy(ROWS)
    for row in copy.deepcopy(ROWS[:51]):
        row["messages"][1]["content"] = "I cannot help with that."
        rows.append(row)
    found = _ids(run_audit(checks=["data.conflicting_answers"], **inputs(rows=rows)))
    assert found == {"data.conflicting_answers": "high"}


def test_healthy_tinyworld_data_with_its_tokenizer(tinyworld_world, tinyworld_tokenizer):
    """Templated factual rows (every phrasing of every fact) tokenized by the tinyworld tokenizer:
    short answers, shared templates, many rows per fact. None of it may read as a defect."""
    from gradian.tinyworld import FACT_FAMILIES

    items = [it for family in FACT_FAMILIES for it in tinyworld_world.fact_items(family)]
    rows = [{"messages": it.messages()} for it in items]
    args = inputs(rows=rows, tok=tinyworld_tokenizer, base_model=None)
    args["eval_dataset"] = None
    result = run_audit(**args)
    assert not result.at_least("high"), _ids(result, "high")
    assert "data.missing_eos" in result.ran and "data.loss_mask_coverage" in result.ran
