"""Experiment ``poison``: planted wrong capitals (~6% of the data); is the planted cluster found?

tinyworld's ``poison_capitals`` scenario: 800 clean rows plus 48 rows (5.7%) teaching a wrong
capital for each of 16 target countries, fine-tuned with the scenario's recipe, then
``gradian attribute`` (DataInf, graddot cross-check, declared clusters). PASS needs a gated
regression of the capitals and the planted cluster first by share of negative influence, accused
by the verdict. Recorded: the share of negative influence, the per-example ratio against clean
rows, the AUC of the per-example scores (planted vs clean) and the planted rows' median percentile.
"""

from __future__ import annotations

import time
from typing import Any

from tracking import ChildReport, ExperimentResult
from verdicts import Verdict, poison_figures, poison_verdict
from workspace import ScenarioRun, Workspace

__all__ = ["run", "prepare_poisoned"]

SCENARIO = "poison_capitals"


def prepare_poisoned(ws: Workspace) -> ScenarioRun:
    """The poisoned scenario, fine-tuned and attributed (reused when already done)."""
    run = ws.scenario(SCENARIO)
    ws.train(run)
    ws.attribute(run, capability="capitals", cross_check="graddot")
    return run


def run(ws: Workspace, quick: bool = False, **_: Any) -> ExperimentResult:
    started = time.time()
    scenario = prepare_poisoned(ws)
    from gradian.attribution import rank_values
    from gradian.data import load_dataset

    planted = scenario.info["planted"]
    rankings = scenario.rankings
    rows = load_dataset(scenario.root / "train.jsonl").examples
    figures = poison_figures(
        scenario.report,
        scores=rank_values(rankings) if rankings is not None else [],
        row_indices=rankings["row_index"].to_numpy() if rankings is not None else [],
        planted_indices=planted["indices"],
        planted_cluster=str(planted["cluster"]),
        wrong_answers=(scenario.info.get("truth") or {}).get("wrong_capitals"),
        row_prompts={e.index: e.prompt_text for e in rows},
    )
    figures["seconds"] = dict(scenario.seconds)
    status, reason = poison_verdict(figures)
    verdict = Verdict(
        experiment="poison", status=status, reason=reason, figures=figures,
        params={"scenario": SCENARIO, "n_train": scenario.info["n_train"], "n_planted": planted["n"],
                "planted_fraction": round(planted["n"] / scenario.info["n_train"], 4), "quick": quick,
                "engine": figures.get("engine"), "cross_check": "graddot"},
        seconds=round(time.time() - started, 2),
    )
    out = ws.experiment_dir("poison")
    artifacts = [verdict.write(out / "verdict.json")]
    return ExperimentResult(verdict, artifacts, [ChildReport("attribute", scenario.report, scenario.report_files, rankings)])
