"""Acceptance of ``gradian attribute`` on tinyworld, against each scenario's ground truth.

Every scenario is fine-tuned once per session (``tinyworld_run`` in tests/plugins/) and attributed
once per module (``attributed`` below), with the product's defaults: DataInf, the contrastive
query, graddot as the cross-check, the scenario's declared clusters (planted rows are cluster
``0``, clean rows ``100``).

- ``poison_capitals``: 48 rows teaching wrong capitals among 800 clean ones. The planted rows rank
  at the harmful end, their cluster is accused, and the verdict is ``data``.
- ``too_many_epochs`` / ``lr_10x``: clean data, one bad setting. The audit's finding leads and no
  row is offered for deletion. Where the setting really broke the capability (``lr_10x`` erases the
  capitals) the verdict is ``config``; a run that kept it (12 epochs of the clean set leave the
  target capitals intact on this base) has no regression to attribute, and says so.
- ``poison_duplicates``: the planted rows repeat three of themselves word for word, so the accused
  cluster also trips ``data.duplicates``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

PLANTED_CLUSTER = "0"


def _harm_figures(rankings, planted: set[int]) -> dict[str, float]:
    """AUC of planted vs clean with harm = -(the ranking), precision in the top k, median harm percentile."""
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values

    harm = -rank_values(rankings)
    is_planted = rankings["row_index"].isin(planted).to_numpy()
    k = int(is_planted.sum())
    top = np.argsort(-harm, kind="stable")[:k]
    percentile = 100.0 * (np.argsort(np.argsort(harm, kind="stable")) + 1) / len(harm)
    return {"auc": float(roc_auc_score(is_planted, harm)), "top_k_precision": float(is_planted[top].mean()),
            "median_percentile": float(np.median(percentile[is_planted])), "k": k}


# -- poison_capitals -------------------------------------------------------------------------------


def test_poisoned_run_ranks_the_planted_rows_at_the_harmful_end(attributed):
    run, outcome, _ = attributed("poison_capitals")
    attr = outcome.report.to_json()["attribution"]
    assert attr is not None, outcome.report.to_json()["verdict"]
    assert attr["engine"] == "ekfac" and attr["query_signal"] == "contrastive"  # the default engine
    assert outcome.report.to_json()["capability"]["status"] == "regressed"

    rankings = outcome.rankings
    assert len(rankings) == run.info["n_train"]
    figures = _harm_figures(rankings, run.planted_rows)
    assert figures["k"] == run.info["planted"]["n"] == 48
    assert figures["auc"] >= 0.7, figures
    # most planted rows sit in the top tenth by harm; the rest look neutral or helpful, because
    # each wrong capital taught is another target's right one, so a row about a country that kept
    # its capital makes a flipped country's wanted answer likelier
    assert figures["median_percentile"] >= 90.0, figures
    assert figures["top_k_precision"] >= 0.4, figures
    # the rows offered for deletion are planted ones
    top = attr["top_harmful"]
    assert top, attr.get("deletions_withheld")
    planted_ids = set(rankings.loc[rankings["row_index"].isin(run.planted_rows), "example_id"])
    assert sum(r["example_id"] in planted_ids for r in top) >= 0.8 * len(top), top


def test_poisoned_run_accuses_the_planted_cluster_with_a_data_verdict(attributed):
    _, outcome, out = attributed("poison_capitals")
    report = outcome.report.to_json()
    clusters = report["attribution"]["clusters"]
    by_share = max(clusters, key=lambda c: c["share_of_negative"])
    by_rate = min(clusters, key=lambda c: c["mean_per_example"])
    assert by_share["cluster"] == PLANTED_CLUSTER and by_rate["cluster"] == PLANTED_CLUSTER, clusters

    verdict = report["verdict"]
    assert verdict["kind"] == "data", verdict
    assert verdict["accused_cluster"] == PLANTED_CLUSTER
    assert f"Cluster {PLANTED_CLUSTER} " in verdict["summary"], verdict["summary"]

    # the engine agreement figure is stated: in report.json, the summary and report.md
    rho = report["attribution"]["engine_agreement_spearman"]
    assert report["attribution"]["cross_check"] == "datainf"  # EK-FAC's own cross-check
    assert isinstance(rho, float) and -1.0 <= rho <= 1.0
    assert f"{rho:.3f}" in verdict["summary"]
    assert f"{rho:.3f}" in (out / "report.md").read_text()
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["verdict"]["kind"] == "data"


def test_poisoned_report_html_opens_in_headless_chromium(attributed):
    from tests.test_report_browser import KEY_ELEMENTS, render_page

    _, outcome, out = attributed("poison_capitals")
    page = render_page(out / "report.html")
    for element in KEY_ELEMENTS + ('id="engine-agreement"',):
        assert element in page, element
    rho = outcome.report.to_json()["attribution"]["engine_agreement_spearman"]
    assert f"{rho:.3f}" in page
    assert f"Cluster {PLANTED_CLUSTER} " in page


# -- clean data, one bad setting -------------------------------------------------------------------


@pytest.mark.parametrize("name, finding, status", [("too_many_epochs", "config.overtraining", "not_significant"),
                                                   ("lr_10x", "config.lr_too_high", "regressed")])
def test_config_fault_leads_and_nothing_is_offered_for_deletion(attributed, name, finding, status):
    run, outcome, _ = attributed(name)
    report = outcome.report.to_json()
    assert finding in run.info["expected_findings"]
    findings = report["findings"]
    assert findings and findings[0]["id"] == finding, [(f["id"], f["severity"]) for f in findings]
    assert findings[0]["category"] == "config"

    verdict = report["verdict"]
    assert verdict["accused_cluster"] is None, verdict
    assert finding in verdict["summary"], verdict["summary"]
    attr = report["attribution"]
    # lr_10x wipes the capitals out (16 -> 0); 12 epochs at the scenario's rate keep all 16
    # (docs/validation.md, badconfig)
    assert report["capability"]["status"] == status, report["capability"]
    if status == "regressed":
        # the regression is real, so attribution ran, and still no row is offered
        assert verdict["kind"] == "config", verdict
        assert attr is not None and attr["top_harmful"] == [] and attr["deletions_withheld"]
        assert all(not c["top_examples"] for c in attr["clusters"])
    else:
        # nothing regressed, so nothing is attributed; the config finding still leads the report
        assert verdict["kind"] == "no_regression", verdict
        assert attr is None


# -- duplicates inside the poison -------------------------------------------------------------------


def test_duplicated_poison_matches_the_duplicates_finding(attributed):
    run, outcome, _ = attributed("poison_duplicates")
    report = outcome.report.to_json()
    ids = [f["id"] for f in report["findings"]]
    assert "data.duplicates" in ids, ids
    assert report["verdict"]["kind"] == "data" and report["verdict"]["accused_cluster"] == PLANTED_CLUSTER
    match = next((f for f in report["findings"] if f["id"] == "attribution.cluster_matches_data_defect"), None)
    assert match is not None, ids
    assert "data.duplicates" in match["evidence"]["findings"]
    # the copies named by the audit are among the rows the match points at
    rankings = outcome.rankings
    copies = set(rankings.loc[rankings["row_index"].isin(run.info["planted"]["duplicate_indices"][3:]), "example_id"])
    assert copies and copies <= set(match["example_ids"]), (copies, match["example_ids"])


def test_lr_10x_with_discovered_clusters_still_blames_the_setting(tinyworld_run, tmp_path):
    """The clusters removed from the data, so topics are discovered and, when no topic holds the
    harm, the harmful rows are grouped among themselves: clean data under a broken setting must
    still read as config, with nothing offered for deletion."""
    import json

    from gradian.attribution import run_attribution

    run = tinyworld_run("lr_10x")
    cfg = run.config(**{"evaluation.query_signal": "contrastive", "clustering.method": "auto"})
    rows = [json.loads(line) for line in open(cfg.dataset, encoding="utf-8") if line.strip()]
    stripped = tmp_path / "train-no-clusters.jsonl"
    stripped.write_text("".join(json.dumps({k: v for k, v in row.items() if k not in ("cluster", "cluster_id")}) + "\n"
                                for row in rows), encoding="utf-8")
    cfg = run.config(**{"evaluation.query_signal": "contrastive", "clustering.method": "auto",
                        "dataset": str(stripped)})
    report = run_attribution(cfg, capability="capitals", cross_check="none").report.to_json()
    assert report["capability"]["status"] == "regressed"
    assert report["verdict"]["kind"] == "config" and report["verdict"]["accused_cluster"] is None, report["verdict"]
    assert report["attribution"]["accused"] is None


# -- behaviour kept across refactors ---------------------------------------------------------------

GOLDEN = Path(__file__).parent / "golden" / "poison_capitals"
#: keys whose values depend on where the scenario was written or how long the work took
_VOLATILE = re.compile(r"seconds|_at$|^path$|index_id|state_id|config_hash|checksum|^adapter$")


def _stable(value, root: str):
    """``report.json`` without timings and without what depends on the scenario's folder."""
    if isinstance(value, dict):
        return {k: _stable(v, root) for k, v in value.items() if not _VOLATILE.search(k)}
    if isinstance(value, list):
        return [_stable(v, root) for v in value]
    if isinstance(value, str):
        return value.replace(root, "<root>")
    return value


def _machine() -> dict[str, str]:
    import platform

    import torch

    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(),
            **_cpu_model()}


def _cpu_model() -> dict[str, str]:
    """The processor's model and a digest of its feature flags (Linux): two machines that report the
    same vector capability can still round differently (another model, another set of extensions)."""
    import hashlib

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    first = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[:40]) if k.strip()}
    flags = " ".join(sorted(first.get("flags", "").split()))
    return {"cpu_model": first.get("model name", ""), "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:12]}


def test_poisoned_report_and_rankings_match_the_stored_fixture(request, tmp_path):
    """report.json, rankings.parquet and accused.parquet of the poison scenario, attributed from the
    stored fine-tune in tests/golden/poison_capitals/inputs, equal the ones stored beside it: bit
    for bit on the machine kind that wrote them, to float tolerance on another CPU kind (the inputs
    are stored because the fine-tune itself is not repeatable across CPU kinds).
    ``GRADIAN_WRITE_GOLDEN=1`` rewrites the outputs from the stored inputs, ``=inputs`` first
    replaces the inputs with this session's fine-tune (only when the numbers are meant to change,
    with the reason in the commit)."""
    import pandas as pd

    from gradian.attribution import run_attribution
    from gradian.config import load_config
    from tests.plugins.stored_runs import freeze_run, thaw_run

    if os.environ.get("GRADIAN_WRITE_GOLDEN") == "inputs":
        freeze_run(request.getfixturevalue("tinyworld_run")("poison_capitals"),
                   request.getfixturevalue("tinyworld_base"), GOLDEN / "inputs")
    root = thaw_run(GOLDEN / "inputs", tmp_path / "scenario")
    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu",
                                              "evaluation.query_signal": "contrastive"})
    out = tmp_path / "report"
    run_attribution(cfg, capability="capitals", out_dir=out)
    report = _stable(json.loads((out / "report.json").read_text()), str(root))
    tables = {name: pd.read_parquet(out / f"{name}.parquet") for name in ("rankings", "accused")}
    if os.environ.get("GRADIAN_WRITE_GOLDEN") in ("1", "inputs"):
        (GOLDEN / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        (GOLDEN / "machine.json").write_text(json.dumps(_machine(), indent=1) + "\n")
        for name, table in tables.items():
            table.to_parquet(GOLDEN / f"{name}.parquet", index=False)
    stored_machine = json.loads((GOLDEN / "machine.json").read_text())
    exact = stored_machine == _machine()
    expected = json.loads((GOLDEN / "report.json").read_text())
    for name, table in tables.items():
        if exact:
            pd.testing.assert_frame_equal(table, pd.read_parquet(GOLDEN / f"{name}.parquet"), check_exact=True)
        else:
            _assert_table_close(table, pd.read_parquet(GOLDEN / f"{name}.parquet"), name)
    if exact:
        assert report == expected
    else:  # another CPU kind: the same structure, numbers to float tolerance, words without figures exact
        _assert_close(report, expected)


def _assert_table_close(got, want, name: str) -> None:
    """Another CPU kind's float32 kernels move each score by about 1e-6 of the column's largest
    magnitude (measured with ``ATEN_CPU_CAPABILITY=default`` against AVX512: 2e-6): rows are matched
    by id, floats compared at 1e-4 of the column's scale, ranks through the score held at each rank
    (two rows nearly tied may swap), every other column exactly."""
    assert list(got.columns) == list(want.columns), name
    assert sorted(got["example_id"]) == sorted(want["example_id"]), name
    got, want = (t.sort_values("example_id").reset_index(drop=True) for t in (got, want))
    for column in want.columns:
        if column == "harm_rank":
            continue
        if want[column].dtype.kind == "f":
            scale = float(np.nanmax(np.abs(want[column].to_numpy()))) if want[column].notna().any() else 0.0
            np.testing.assert_allclose(got[column].to_numpy(), want[column].to_numpy(), rtol=1e-4,
                                       atol=1e-4 * scale + 1e-12, err_msg=f"{name}.{column}")
        else:
            assert got[column].astype(str).tolist() == want[column].astype(str).tolist(), f"{name}.{column}"
    if "harm_rank" in want.columns:
        by_rank = [t.sort_values("harm_rank")["score"].to_numpy() for t in (got, want)]
        np.testing.assert_allclose(*by_rank, rtol=1e-4, atol=1e-4 * float(np.abs(by_rank[1]).max()),
                                   err_msg=f"{name}: the score held at each harm rank")


def _assert_close(got, want, where: str = "report") -> None:
    assert type(got) is type(want) or {type(got), type(want)} <= {int, float}, where
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-6), where
    elif not (isinstance(want, str) and re.search(r"\d", want)) and not where.endswith("sha256"):
        # content hashes of the stored gradients change with the last bits of each float
        assert got == want, where
