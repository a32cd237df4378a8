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
#: eval items that share no prompt with ROWS
_EVAL_OTHER = clean_rows(40, seed=99)


def _ids_of(rows: list) -> list[str]:
    from tests.test_audit_checks import dataset_from_rows

    return [e.id for e in dataset_from_rows(copy.deepcopy(rows)).examples]


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


def _eval_of(rows: list, answer: str | None = None) -> list:
    out = copy.deepcopy(rows)
    if answer is not None:
        for row in out:
            row["messages"][1]["content"] = answer
    return out


def test_eval_prompts_trained_with_another_answer_are_conflict_not_contamination():
    """The poisoned case: training rows ask the eval's questions and teach other answers. The eval
    is not inflated, so nothing critical; the conflict is reported with its rows, severity by share."""
    rows = copy.deepcopy(ROWS)
    eval_rows = _eval_of(ROWS[:40])
    for row in rows[:40]:
        row["messages"][1]["content"] = "Nobody knows."
    result = run_audit(**inputs(rows=rows, eval_rows=eval_rows))
    assert not result.at_least("critical"), _ids(result, "critical")
    found = {f.id: f for f in result.findings}
    assert "data.train_eval_contamination" not in found
    conflict = found["data.train_eval_conflict"]
    assert conflict.severity == "high" and conflict.category == "data"  # 40 of 40 items
    assert conflict.evidence["n_conflicting"] == 40 and conflict.evidence["n_rows"] == 40
    assert conflict.evidence["row_ids"] == [rows_id for rows_id in _ids_of(rows[:40])]
    # a few items below contamination_critical_share (10%) of a larger eval set: medium
    small = run_audit(**inputs(rows=rows, eval_rows=eval_rows[:3] + _EVAL_OTHER))
    (few,) = [f for f in small.findings if f.id == "data.train_eval_conflict"]
    assert few.severity == "medium" and few.evidence["n_conflicting"] == 3


def test_an_eval_copied_into_training_stays_contamination_beside_a_conflict():
    rows = copy.deepcopy(ROWS)
    for row in rows[:10]:
        row["messages"][1]["content"] = "Nobody knows."
    result = run_audit(**inputs(rows=rows, eval_rows=_eval_of(ROWS[:64])))
    found = {f.id: f for f in result.findings}
    contamination = found["data.train_eval_contamination"]
    assert contamination.severity == "critical"
    assert contamination.evidence["n_contaminated"] == 54 and contamination.evidence["n_conflicting"] == 10
    assert found["data.train_eval_conflict"].evidence["n_conflicting"] == 10


def test_refusal_evals_read_the_markers_as_what_must_not_be_taught():
    """``not_contains``: the completion lists refusal markers. A training copy that refuses teaches
    against the eval (conflict); one that answers teaches what it wants (contamination)."""
    eval_rows = _eval_of(ROWS[:20], "sorry | can't help")
    refusing = copy.deepcopy(ROWS)
    for row in refusing[:20]:
        row["messages"][1]["content"] = "I'm sorry, but I can't help with that."
    result = run_audit(eval_metric="not_contains", **inputs(rows=refusing, eval_rows=eval_rows))
    assert {f.id for f in result.findings} >= {"data.train_eval_conflict"}
    assert "data.train_eval_contamination" not in {f.id for f in result.findings}
    answered = run_audit(eval_metric="not_contains", **inputs(rows=ROWS, eval_rows=eval_rows))
    (f,) = [f for f in answered.findings if f.id == "data.train_eval_contamination"]
    assert f.severity == "critical" and f.evidence["n_contaminated"] == 20


def test_a_wanted_answer_inside_a_longer_training_answer_is_the_same_answer():
    from gradian.audit.data_checks import teaches_wanted_answer

    assert teaches_wanted_answer("the capital is rome", "Rome", "exact_match")
    assert not teaches_wanted_answer("romeo", "Rome", "contains")
    assert teaches_wanted_answer("i know the answer", "sorry | can t help", "not_contains")
    assert not teaches_wanted_answer("i m sorry but i can t help", "sorry | can't help", "not_contains")


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
