"""Experiment ``counterfactual``: drop what the poisoned run's report accused, retrain, re-measure.

Round 1 is experiment ``poison``'s fine-tune and report (reused when already in the work
folder). Round 2 is ``gradian counterfactual``: the accused cluster removed, the same base,
recipe and seed, the capitals measured again. PASS when the capability comes back within one
item of the base score (and above round 1). Removal precision against the planted rows, and the
sign of the summed scores before and after the removal, are recorded. The attribution and the
counterfactual reports are logged as child runs of this experiment's run.
"""

from __future__ import annotations

import time
from typing import Any

from poison import prepare_poisoned
from tracking import ChildReport, ExperimentResult
from verdicts import Verdict, counterfactual_verdict
from workspace import Workspace

__all__ = ["run"]


def run(ws: Workspace, quick: bool = False, **_: Any) -> ExperimentResult:
    from gradian.counterfactual import plan_removal, run_counterfactual
    from gradian.data import load_dataset
    from gradian.errors import ConfigError

    started = time.time()
    scenario = prepare_poisoned(ws)
    cfg = scenario.config(ws.cache_dir)
    data = load_dataset(cfg.dataset)
    out = ws.experiment_dir("counterfactual")
    children = [ChildReport("attribute", scenario.report, scenario.report_files, scenario.rankings)]
    verdict_block = scenario.report.get("verdict") or {}
    block = None
    try:
        plan = plan_removal(data, report=scenario.report, rankings=scenario.rankings)
    except ConfigError as err:  # nothing accused: the experiment did not get its precondition
        accusation = str(err)
    else:
        accusation = plan.reason
        ws.log(f"[counterfactual] retraining without {plan.n_drop} rows ({plan.reason})")
        outcome = run_counterfactual(cfg, plan, out_dir=out / "retrain", capability="capitals",
                                     before=scenario.report.get("capability"),
                                     planted=scenario.info["planted"]["indices"], log=ws.log)
        block = outcome.report["counterfactual"]
        children.append(ChildReport("counterfactual", outcome.report, outcome.files))
    status, reason = counterfactual_verdict(block, accusation)
    figures: dict[str, Any] = {"accused_cluster": verdict_block.get("accused_cluster"),
                               "round1_seconds": dict(scenario.seconds)}
    if block is not None:
        rec = block["capability"]
        figures.update({
            "capability": {k: rec[k] for k in ("base", "before", "after", "delta_before", "delta_after",
                                                  "recovered_fraction", "items_below_base_before",
                                                  "items_below_base_after", "n_items")},
            "within_one_item": rec["within_one_item"],
            "outcome": block["outcome"],
            "removal": {k: block["removal"][k] for k in ("n_removed", "n_kept", "n_examples")},
            "removal_precision": (block["ground_truth"] or {}).get("precision"),
            "removal_recall": (block["ground_truth"] or {}).get("recall"),
            "predicted": block["predicted"],
            "round2_seconds": block["seconds"],
        })
    verdict = Verdict(
        experiment="counterfactual", status=status, reason=reason, figures=figures,
        params={"scenario": scenario.name, "quick": quick, "dropped": accusation},
        seconds=round(time.time() - started, 2),
    )
    artifacts = [verdict.write(out / "verdict.json")]
    return ExperimentResult(verdict, artifacts, children)
