"""Experiment ``badconfig``: good data, broken settings; do the checks name the cause, and only it?

For each broken-config tinyworld scenario (clean data, one bad setting) the fine-tune runs with
that setting, then ``gradian attribute`` does the whole job a user would run: audit, evaluation,
the significance gate, and attribution when something regressed. A scenario passes when every
check its ``scenario.json`` expects fires and no data cluster is accused. ``--quick`` runs two of
the five: ``lr_10x`` (a real regression, so attribution runs and must not blame the data) and
``truncating_seq_len``.
"""

from __future__ import annotations

import time
from typing import Any

from gradian.report.schema import Report
from tracking import ExperimentResult
from verdicts import Verdict, badconfig_verdict, scenario_badconfig_verdict
from workspace import Workspace

__all__ = ["run", "SCENARIOS", "QUICK_SCENARIOS"]

SCENARIOS = ("lr_10x", "too_many_epochs", "truncating_seq_len", "attention_only", "tiny_batch_high_lr")
QUICK_SCENARIOS = ("lr_10x", "truncating_seq_len")


def run(ws: Workspace, quick: bool = False, scenarios: tuple[str, ...] | None = None, **_: Any) -> ExperimentResult:
    started = time.time()
    chosen = scenarios or (QUICK_SCENARIOS if quick else SCENARIOS)
    out = ws.experiment_dir("badconfig")
    per_scenario: dict[str, dict[str, Any]] = {}
    reports: dict[str, Report] = {}
    artifacts = []
    for name in chosen:
        scenario = ws.scenario(name)
        ws.train(scenario)
        # no cross-check: the second engine would not change what this experiment asks
        ws.attribute(scenario, capability="capitals", cross_check="none")
        reports[name] = Report.of(scenario.report)
        result = scenario_badconfig_verdict(reports[name], scenario.info["expected_findings"])
        result["defect"] = scenario.info.get("defect")
        result["seconds"] = dict(scenario.seconds)
        per_scenario[name] = result
        ws.log(f"[{name}] {result['status']}: {result['reason']}")
        report_json = scenario.root / "report" / "report.json"
        if report_json.is_file():
            copy = out / f"{name}.report.json"
            copy.write_bytes(report_json.read_bytes())
            artifacts.append(copy)
    status, reason = badconfig_verdict(per_scenario)
    figures = {name: {"pass": r["status"] == "PASS", "n_expected": len(r["expected"]), "n_missing": len(r["missing"]),
                      "accused": reports[name].verdict.accused_cluster is not None,
                      "capability_delta": reports[name].capability.delta if reports[name].capability else None,
                      "attributed": r["attributed"], "train_seconds": r["seconds"].get("train"),
                      "attribute_seconds": r["seconds"].get("attribute")}
               for name, r in per_scenario.items()}
    verdict = Verdict(
        experiment="badconfig", status=status, reason=reason,
        figures={"scenarios": figures, "n_scenarios": len(per_scenario),
                 "n_pass": sum(r["status"] == "PASS" for r in per_scenario.values()), "details": per_scenario},
        params={"scenarios": ",".join(chosen), "quick": quick},
        seconds=round(time.time() - started, 2),
    )
    artifacts.insert(0, verdict.write(out / "verdict.json"))
    return ExperimentResult(verdict, artifacts)
