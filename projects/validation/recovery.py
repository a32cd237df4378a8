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

from gradian.report.schema import Counterfactual, Report
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
    accusing = Report.of(scenario.report)
    block: Counterfactual | None = None
    try:
        plan = plan_removal(data, report=scenario.report, rankings=scenario.rankings)
    except ConfigError as err:  # nothing accused: the experiment did not get its precondition
        accusation = str(err)
    else:
        accusation = plan.reason
        ws.log(f"[counterfactual] retraining without {plan.n_drop} rows ({plan.reason})")
        outcome = run_counterfactual(cfg, plan, out_dir=out / "retrain", capability="capitals",
                                     before=accusing.capability.to_json() if accusing.capability else None,
                                     planted=scenario.info["planted"]["indices"], log=ws.log)
        block = Report.of(outcome.report).counterfactual
        children.append(ChildReport("counterfactual", outcome.report, outcome.files))
    status, reason = counterfactual_verdict(block, accusation)
    figures: dict[str, Any] = {"accused_cluster": accusing.verdict.accused_cluster,
                               "round1_seconds": dict(scenario.seconds)}
    if block is not None:
        rec, removal, truth = block.capability, block.removal, block.ground_truth
        figures.update({
            "capability": {"base": rec.base, "before": rec.before, "after": rec.after,
                           "delta_before": rec.delta_before, "delta_after": rec.delta_after,
                           "recovered_fraction": rec.recovered_fraction,
                           "items_below_base_before": rec.items_below_base_before,
                           "items_below_base_after": rec.items_below_base_after, "n_items": rec.n_items},
            "within_one_item": rec.within_one_item,
            "outcome": block.outcome,
            "removal": {"n_removed": removal.n_removed, "n_kept": removal.n_kept, "n_examples": removal.n_examples},
            "removal_precision": truth.precision if truth is not None else None,
            "removal_recall": truth.recall if truth is not None else None,
            "predicted": block.predicted.to_json() if block.predicted is not None else None,
            "round2_seconds": block.seconds.to_json() if block.seconds is not None else None,
        })
    verdict = Verdict(
        experiment="counterfactual", status=status, reason=reason, figures=figures,
        params={"scenario": scenario.name, "quick": quick, "dropped": accusation},
        seconds=round(time.time() - started, 2),
    )
    artifacts = [verdict.write(out / "verdict.json")]
    return ExperimentResult(verdict, artifacts, children)
