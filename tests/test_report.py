"""Report tables and renderers: report.json/md/html, plots, diagnose-only reports, escaping."""

from __future__ import annotations

import base64
import dataclasses
import json
import re

import numpy as np
import pandas as pd
import pytest

from gradian.data import dataset_from_rows
from gradian.findings import Finding
from gradian.report import (
    assemble_report,
    cluster_table,
    flagged_steps,
    render_html,
    render_markdown,
    top_examples,
    write_report,
)
from gradian.runs import TrainingLogs
from tests.test_verdict import attribution, capability, lr_finding, planted_scores

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cluster_table_sums_and_sign_convention():
    scores = np.array([-10.0, -6.0, 1.0, -2.0, 3.0, -2.0])
    ids = [f"id{i}" for i in range(6)]
    clusters = {"id0": "a", "id1": "a", "id2": "a", "id3": "b", "id4": "b", "id5": "c"}
    table = cluster_table(scores, ids, clusters, None, 2)
    by = {r["cluster"]: r for r in table}
    assert [r["cluster"] for r in table] == ["a", "c", "b"]  # share of negative, then mean per example
    assert by["a"]["n"] == 3 and by["a"]["signed_influence"] == pytest.approx(-15.0)
    assert by["a"]["share_of_negative"] == pytest.approx(16 / 20)
    assert sum(r["share_of_negative"] for r in table) == pytest.approx(1.0)
    assert by["b"]["mean_per_example"] == pytest.approx(0.5)
    top = by["a"]["top_examples"]
    assert [t["example_id"] for t in top] == ["id0", "id1"]
    assert top[0]["predicted_loss_delta_if_removed"] == pytest.approx(-10.0 / 6)  # score / whole n
    with pytest.raises(ValueError, match="row-aligned"):
        cluster_table(scores, ids[:3], clusters)


def test_top_examples_sides_and_excerpts():
    ds = dataset_from_rows([{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(5)])
    ids = [e.id for e in ds.examples]
    scores = [-3.0, 2.0, -1.0, 0.0, 5.0]
    harmful = top_examples(scores, ids, None, ds.examples, k=10, harmful=True)
    helpful = top_examples(scores, ids, None, ds.examples, k=1, harmful=False)
    assert [r["score"] for r in harmful] == [-3.0, -1.0]  # only the negative side, most harmful first
    assert harmful[0]["excerpt"] == "question 0 → answer 0" and harmful[0]["cluster"] == "0"
    assert harmful[0]["predicted_loss_delta_if_removed"] == pytest.approx(-3.0 / 5)
    assert [r["score"] for r in helpful] == [5.0]
    # ordered by another ranking of the same sign, the rows keep their own scores
    ranked = top_examples(scores, ids, None, ds.examples, k=10, harmful=True, order_by=[-0.1, 1.0, -0.7, 0.0, 2.0])
    assert [r["score"] for r in ranked] == [-1.0, -3.0]
    # a row whose ranking value and score disagree in sign is not listed on either side
    mixed = top_examples(scores, ids, None, ds.examples, k=10, harmful=True, order_by=[-0.5, -0.9, -0.1, 0.0, 1.0])
    assert [r["score"] for r in mixed] == [-3.0, -1.0]
    assert top_examples(scores, ids, None, ds.examples, k=1, harmful=True, order_by=[-0.5, -0.9, -0.1, 0.0, 1.0])[0]["score"] == -3.0
    with pytest.raises(ValueError, match="order_by"):
        top_examples(scores, ids, order_by=[1.0])
    assert cluster_table(scores, ids)[0]["share_of_negative"] == pytest.approx(1.0)
    assert cluster_table([1.0, 2.0], ["x", "y"])[0]["share_of_negative"] == 0.0


def _logs() -> TrainingLogs:
    history = [{"step": s, "loss": 2.0 / s + (5.0 if s == 12 else 0.0), "grad_norm": 0.5 + (9 if s == 20 else 0)}
               for s in range(1, 41)]
    return TrainingLogs.from_log_history(history)


def _dynamics() -> list[Finding]:
    return [
        Finding(id="dynamics.loss_spike", category="dynamics", severity="medium", title="1 loss spike",
                message="m", evidence={"spikes": [{"step": 12, "loss": 5.2, "rolling_median": 0.2}], "n_spikes": 1}),
        Finding(id="dynamics.grad_norm_explosion", category="dynamics", severity="high", title="blowup",
                message="m", evidence={"steps": [20], "n_blowups": 1, "median_grad_norm": 0.5}),
    ]


def full_report(evil: str = "") -> tuple[dict, pd.DataFrame]:
    scores, ids, clusters = planted_scores()
    attr = attribution(scores, ids, clusters, spearman=0.791)
    for row in attr["top_harmful"]:
        row["excerpt"] = f"What is the capital of France? → Berlin {evil}"
    dups = Finding(id="data.duplicates", category="data", severity="medium", title=f"duplicates {evil}",
                   message="m", example_ids=[ids[int(np.argmin(scores))]])
    report = assemble_report(capability(n_base_failing=1), [dups] + _dynamics(), attr,
                             manifest={"kind": "attribute", "config_hash": "cfg-1234abcd", "index_id": "8a98bd",
                                       "note": evil},
                             assignment=clusters)
    rankings = pd.DataFrame({"example_id": ids, "score": scores, "cluster": [clusters[i] for i in ids]})
    return report, rankings


def test_write_report_writes_every_file_and_returns_the_paths(tmp_path):
    report, rankings = full_report()
    paths = write_report(report, tmp_path / "out", rankings=rankings, logs=_logs())
    names = sorted(p.relative_to(tmp_path / "out").as_posix() for p in paths)
    assert names == ["plots/capability.png", "plots/clusters.png", "plots/scores.png", "plots/training.png",
                     "report.html", "report.json", "report.md"]
    assert all(p.exists() for p in paths)
    assert json.loads((tmp_path / "out/report.json").read_text())["verdict"] == report["verdict"]
    assert (tmp_path / "out/plots/scores.png").read_bytes().startswith(PNG_MAGIC)
    md = (tmp_path / "out/report.md").read_text()
    for heading in ("**Verdict (mixed):**", "## Capability", "### Influence by cluster", "### Top harmful examples",
                    "## Findings", "## Provenance", "cfg-1234abcd", "0.791", "![Training curves](plots/training.png)"):
        assert heading in md, heading
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic writes leave no temp files


def test_html_is_self_contained_and_complete(tmp_path):
    report, rankings = full_report()
    write_report(report, tmp_path, rankings=rankings, logs=_logs())
    html = (tmp_path / "report.html").read_text()
    for anchor in ('id="verdict"', 'id="capability"', 'id="clusters"', 'id="scores"', 'id="training"',
                   'id="findings"', 'id="top-harmful"', 'id="top-helpful"', 'id="provenance"',
                   'class="accused"', 'id="engine-agreement">0.791'):
        assert anchor in html, anchor
    assert "cfg-1234abcd" in html
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 4 and all(base64.b64decode(i).startswith(PNG_MAGIC) for i in images)
    # nothing is fetched from elsewhere
    assert not re.search(r'(src|href)="(https?:)?//', html) and "<script" not in html
    # findings are led by the most severe
    order = re.findall(r'class="sev sev-(\w+)"', html)
    assert order == sorted(order, key=["critical", "high", "medium", "low", "info"].index)


def test_user_text_is_escaped():
    evil = "<script>alert(1)</script>"
    report, _ = full_report(evil)
    html = render_html(report)
    assert evil not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_config_verdict_renders_without_a_deletion_list(tmp_path):
    scores = np.random.default_rng(1).normal(-4, 0.5, 300)
    ids = [f"r{i}" for i in range(300)]
    clusters = {i: "100" for i in ids}
    report = assemble_report(capability(), [lr_finding("critical")], attribution(scores, ids, clusters))
    html, md = render_html(report), render_markdown(report)
    assert 'id="deletions-withheld"' in html and "None offered" in md
    assert "r0" not in md.split("## Findings")[0].split("### Top harmful examples")[1]


def test_diagnose_only_report_renders(tmp_path):
    from gradian.audit.runner import AuditResult, SkippedCheck

    result = AuditResult(findings=[lr_finding("critical")], skipped=[SkippedCheck("data.x", "data", "no tokenizer")],
                         ran=["config.lr_too_high"])
    report = {"capability": None, "findings": [f.to_dict() for f in result.findings], "attribution": None,
              "verdict": result.verdict(), "skipped": [s.to_dict() for s in result.skipped],
              "manifest": {"kind": "diagnose"}}
    md = render_markdown(report)
    assert md.startswith("# Gradian diagnosis") and "## Skipped checks" in md and "## Capability" not in md
    paths = write_report(report, tmp_path)
    assert sorted(p.name for p in paths) == ["report.html", "report.json", "report.md"]
    html = (tmp_path / "report.html").read_text()
    assert 'id="skipped"' in html and 'id="capability"' not in html
    # the barest shape: findings and a verdict only
    bare = render_html({"findings": [], "verdict": {"kind": "inconclusive", "summary": "s", "hedges": []}})
    assert "No check fired." in bare


def test_diagnose_writes_through_the_one_writer_with_its_nan_guard(tmp_path):
    """diagnose.json/.md/.html come from the same renderer table as report.*, and a non-finite
    figure in a finding's evidence is written as null, so the file is strict JSON."""
    from gradian.audit.report import build_diagnosis_report, write_diagnosis
    from gradian.audit.runner import AuditResult
    from gradian.report.write import RENDERERS

    finding = lr_finding("high")
    finding.evidence = {**finding.evidence, "ratio": float("nan"), "peak": float("inf")}
    report = build_diagnosis_report(AuditResult(findings=[finding], ran=["config.lr_too_high"]))
    paths = write_diagnosis(report, tmp_path / "d")
    assert [p.name for p in paths] == [f"diagnose{r.suffix}" for r in RENDERERS.values()]
    text = paths[0].read_text()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in diagnose.json"))
    assert written["findings"][0]["evidence"]["ratio"] is None and written["findings"][0]["evidence"]["peak"] is None
    assert paths[1].read_text() == render_markdown(report) and "<html" in paths[2].read_text()
    assert not (tmp_path / "d" / "plots").exists()


def test_flagged_steps_reads_dynamics_evidence():
    assert flagged_steps({"spikes": [{"step": 12}, {"step": 30}], "n_spikes": 2}) == [12, 30]
    assert flagged_steps({"steps": [20, 21], "n_blowups": 2}) == [20, 21]
    assert flagged_steps({"first_step": 7, "nan_loss_steps": [7, 8], "zero_loss_nan_grad_steps": []}) == [7, 8]
    assert flagged_steps({"clipped_steps": 40, "logged_steps": 41, "share": 0.97}) == []


def test_report_json_is_strict_json(tmp_path):
    report, _ = full_report()
    report["capability"]["weird"] = float("nan")
    report["attribution"]["lumpiness"]["rate_ratio"] = float("inf")
    write_report(report, tmp_path)
    text = (tmp_path / "report.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["capability"]["weird"] is None


def _report_with_accused(evil: str = "") -> dict:
    from gradian.cluster import refine_accused

    scores, ids, clusters = planted_scores()
    attr = attribution(scores, ids, clusters, spearman=0.9)
    accused_cluster = attr["clusters"][0]["cluster"]
    members = [i for i, e in enumerate(ids) if clusters[e] == accused_cluster]
    accused = refine_accused(accused_cluster, [ids[i] for i in members], scores[members], scale=1.0)
    attr["accused"] = accused.to_dict()
    text = f"Vel is on Omar. Its capital is Brask{evil}. Shops take the dorn."
    start = text.index("Its")
    end = text.index(". Shops") + 1
    attr["spans"] = [{"example_id": accused.example_ids[0], "item_id": "item-1", "engine": "datainf",
                      "signal": "contrastive", "token_sum": -3.0, "text": text,
                      "span_start": start, "span_end": end, "span_text": text[start:end], "span_score": -3.0,
                      "words": [{"text": "Brask" + evil, "start": text.index("Brask"), "end": end - 1, "score": -3.0}],
                      "sentences": []}]
    return assemble_report(capability(), [], attr, manifest={"kind": "attribute"}, assignment=clusters)


def test_the_accused_set_is_shown_beside_its_cluster_with_the_harmful_span():
    report = _report_with_accused()
    accused = report["attribution"]["accused"]
    assert accused is not None and report["verdict"]["accused_set_n"] == accused["n"]
    assert f"the accused set is {accused['n']} of its {accused['cluster_n']} rows" in report["verdict"]["summary"] \
        or "The whole cluster is the accused set" in report["verdict"]["summary"]
    md = render_markdown(report)
    assert "### Accused set: the rows to act on" in md
    assert "**Its capital is Brask.**" in md
    html = render_html(report)
    assert 'id="accused"' in html and 'id="accused-spans"' in html
    assert '<mark class="harmful"' in html


def test_span_text_is_escaped_in_html():
    html = render_html(_report_with_accused("<script>x</script>"))
    assert "<script>x</script>" not in html and "&lt;script&gt;" in html


def test_an_accused_set_without_an_accused_cluster_is_dropped():
    from gradian.report.schema import Accused, Span

    scores, ids, clusters = planted_scores()
    attr = attribution(scores, ids, clusters, spearman=0.9)
    attr["accused"] = Accused(cluster="elsewhere", cluster_label="", cluster_n=1, example_ids=[ids[0]], left_out_ids=[],
                              share_of_cluster_harm=1.0, share_of_negative=0.0, estimated_harmful_share=1.0,
                              mean_per_example=float(scores[0]), left_out_mean_per_example=None, method="whole",
                              reason="r").to_json()
    attr["spans"] = [Span(example_id=ids[0], item_id="item-1", engine="datainf", signal="contrastive", text="t",
                          token_sum=-1.0).to_json()]
    report = assemble_report(capability(), [], attr, manifest={}, assignment=clusters)
    assert report["attribution"]["accused"] is None and report["attribution"]["spans"] == []


def test_top_harmful_rows_show_the_items_they_hurt():
    from gradian.report.html import _example_rows
    from gradian.report.markdown import _examples_table
    from gradian.report.schema import ExampleRow

    rows = [ExampleRow.from_json(r) for r in [{"example_id": "abc123def456-7", "cluster": "0", "score": -2.0, "predicted_loss_delta_if_removed": -0.1,
             "excerpt": "row", "items_hurt": [{"item_id": "item-<3>", "share": 0.75}, {"item_id": "item-9", "share": 0.25}]}]]
    md = "\n".join(_examples_table(rows, {}))
    assert "items it hurts most" in md and "item-<3> (75%); item-9 (25%)" in md  # by id when no prompt is known
    html = _example_rows(rows, {})
    assert "item-&lt;3&gt; (75%); item-9 (25%)" in html  # escaped
    # by their prompt when the report measured the items: a reader sees which questions a row breaks
    prompts = {"item-<3>": "What is the capital of <Pailand>?\n", "item-9": "Name " + "a very long question " * 5}
    md = "\n".join(_examples_table(rows, prompts))
    assert "“What is the capital of <Pailand>?” (75%)" in md
    assert "“Name a very long question a very long question a very long…” (25%)" in md
    assert "&lt;Pailand&gt;" in _example_rows(rows, prompts)
    assert "items it hurts" not in "\n".join(_examples_table([dataclasses.replace(rows[0], items_hurt=[])], {}))
