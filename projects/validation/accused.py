"""Experiment ``accused``: with no declared clusters, is the accused set the planted rows, and does
dropping exactly it bring the capability back?

Round 1 is experiment ``poison``'s fine-tune (the same scenario, reused when already in the work
folder). Its training data is copied without the declared cluster field (each row's ``cluster`` /
``cluster_id``), so ``gradian attribute`` has to find the topics itself (``clustering.method:
auto``), with the same adapter, base and eval set, the default engine (EK-FAC) and cross-check, and
the default query. The report's accused set (the rows refined out of the accused cluster) is
scored against the planted rows. Round 2 is ``gradian counterfactual --drop accused``: exactly
that set removed, the same base, recipe and seed, the capitals measured again.

PASS when the accused set's precision and recall against the planted rows are both at least 0.8
and the retrain comes back within one item of the base. INCONCLUSIVE when the regression did not
pass its gate or nothing was accused. ``--quick`` changes nothing: the experiment is one
attribution and one retrain.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gradian.report.schema import Report
from poison import SCENARIO
from recovery import retrain_without
from tracking import ChildReport, ExperimentResult
from verdicts import Verdict, accused_figures, accused_verdict
from workspace import Workspace

__all__ = ["run", "strip_declared_clusters"]

#: the row keys that declare a cluster (``clustering.method: declared`` reads them)
CLUSTER_KEYS = ("cluster", "cluster_id")


def strip_declared_clusters(source: Path, dest: Path) -> Path:
    """Copy a JSONL training file without its rows' declared cluster keys; rows keep their order,
    so row indices (and the scenario's planted indices) stay valid. Rewritten byte for byte the
    same each time, so the attribution's fingerprint still matches on a rerun."""
    lines = []
    for line in Path(source).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for key in CLUSTER_KEYS:
            row.pop(key, None)
        lines.append(json.dumps(row, ensure_ascii=False))
    dest.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    if not dest.is_file() or dest.read_text(encoding="utf-8") != text:
        dest.write_text(text, encoding="utf-8")
    return dest


def run(ws: Workspace, quick: bool = False, **_: Any) -> ExperimentResult:
    from gradian.data import load_dataset

    started = time.time()
    scenario = ws.scenario(SCENARIO)
    ws.train(scenario)  # poison's fine-tune: reused when poison already ran in this work folder
    out = ws.experiment_dir("accused")
    stripped = strip_declared_clusters(scenario.root / "train.jsonl", out / "train.jsonl")
    cfg = scenario.config(ws.cache_dir, **{"dataset": str(stripped), "clustering.method": "auto"})
    # the report goes beside poison's, under the scenario (Workspace.attribute's folders live there)
    ws.attribute(scenario, cfg, capability="capitals", cross_check="auto", folder="report-auto-clusters")
    accusing = Report.of(scenario.report)
    data = load_dataset(stripped)
    planted = [int(i) for i in scenario.info["planted"]["indices"]]
    accused = accusing.attribution.accused if accusing.attribution is not None else None
    index_of = {e.id: e.index for e in data.examples}
    accused_rows = [index_of[i] for i in accused.example_ids] if accused is not None else []
    children = [ChildReport("attribute", scenario.report, scenario.report_files, scenario.rankings)]

    block, accusation, child = retrain_without(ws, scenario, cfg, data, out / "retrain", planted,
                                               drop="accused", tag="accused")
    if child is not None:
        children.append(child)

    figures = accused_figures(accusing, accused_rows, planted, block)
    figures["round1_seconds"] = dict(scenario.seconds)
    status, reason = accused_verdict(figures)
    verdict = Verdict(
        experiment="accused", status=status, reason=reason, figures=figures,
        params={"scenario": SCENARIO, "n_train": scenario.info["n_train"], "n_planted": len(planted),
                "clustering": "auto", "engine": cfg.engine.name, "quick": quick, "dropped": accusation},
        seconds=round(time.time() - started, 2),
    )
    artifacts = [verdict.write(out / "verdict.json")]
    return ExperimentResult(verdict, artifacts, children)
