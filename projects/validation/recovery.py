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
from pathlib import Path
from typing import Any, Sequence

from gradian.report.schema import Counterfactual, Report
from poison import prepare_poisoned
from tracking import ChildReport, ExperimentResult
from verdicts import Verdict, counterfactual_verdict
from workspace import Workspace

__all__ = ["run", "retrain_without"]


def retrain_without(ws: Workspace, scenario: Any, cfg: Any, data: Any, out: Path, planted: Sequence[int], *,
                    drop: str | None = None, tag: str, capability: str = "capitals",
                    ) -> tuple[Counterfactual | None, str, ChildReport | None]:
    """Remove what ``scenario.report`` accused (``drop``: ``accused`` for its accused set, None for
    its cluster), retrain with ``cfg``'s recipe and seed into ``out``, and measure ``capability`` again.

    Returns the counterfactual block (None when nothing was accused), what was dropped (or why
    nothing was), and the counterfactual's child report.
    """
    from gradian.counterfactual import plan_removal, run_counterfactual
    from gradian.errors import ConfigError

    accusing = Report.of(scenario.report)
    try:
        plan = plan_removal(data, report=scenario.report, rankings=scenario.rankings, drop=drop)
    except ConfigError as err:  # nothing accused: the experiment did not get its precondition
        return None, str(err), None
    ws.log(f"[{tag}] retraining without {plan.n_drop} rows ({plan.reason})")
    outcome = run_counterfactual(cfg, plan, out_dir=out, capability=capability,
                                 before=accusing.capability.to_json() if accusing.capability else None,
                                 planted=list(planted), log=ws.log)
    block = outcome.report.counterfactual
    return block, plan.reason, ChildReport("counterfactual", outcome.report.to_json(), outcome.files)


def run(ws: Workspace, quick: bool = False, **_: Any) -> ExperimentResult:
    from gradian.data import load_dataset

    started = time.time()
    scenario = prepare_poisoned(ws)
    cfg = scenario.config(ws.cache_dir)
    data = load_dataset(cfg.dataset)
    out = ws.experiment_dir("counterfactual")
    children = [ChildReport("attribute", scenario.report, scenario.report_files, scenario.rankings)]
    accusing = Report.of(scenario.report)
    block, accusation, child = retrain_without(ws, scenario, cfg, data, out / "retrain",
                                               scenario.info["planted"]["indices"], tag="counterfactual")
    if child is not None:
        children.append(child)
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
