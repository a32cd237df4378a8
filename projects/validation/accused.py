"""Experiment ``accused``: with no declared clusters, is the accused set the planted rows, and does
dropping exactly it bring the capability back?

The scenario (``poison_capitals`` by default; ``poison_capitals_ontopic``, whose clean rows teach
the right capitals in the planted rows' own question form; or the bestiary's
``bestiary_poison_diets``, another architecture, tokenizer and fact family) is fine-tuned with its own recipe
and a checkpoint saved at the end of every epoch, as most trainers keep them; the training itself
is the one experiment ``poison`` runs. The training data is copied without the declared cluster
field (each row's ``cluster`` / ``cluster_id``), so ``gradian attribute`` has to find the topics
itself (``clustering.method: auto``), with the default engine (EK-FAC), cross-check and query.

Two attributions of that one fine-tune: under every saved checkpoint (``engine.checkpoints:
all``, what the report advises for a run that saved checkpoints), which decides the verdict, and
under the final adapter alone (the default for a run without them), recorded beside it as
``final_adapter``. For each, the report's accused set (the rows refined out of the accused
cluster) is scored against the planted rows, and ``gradian counterfactual --drop accused``
retrains without exactly that set (same base, recipe and seed) and measures the capability again.

PASS when the accused set's precision and recall against the planted rows are both at least 0.8
and the retrain comes back within one item of the base. INCONCLUSIVE when the regression did not
pass its gate or nothing was accused. ``--quick`` changes nothing: the experiment is one
fine-tune, two attributions and two retrains.
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
from workspace import Workspace, steps_per_epoch

__all__ = ["run", "strip_declared_clusters", "SCENARIOS"]

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


#: the scenarios this experiment reads: tinyworld's capitals poison, with and without on-topic clean
#: rows, and the bestiary's diets poison
SCENARIOS = (SCENARIO, "poison_capitals_ontopic", "bestiary_poison_diets")
#: the attributions it makes of the one fine-tune: the verdict's first, then the comparison
MODES = {"checkpoints": {"engine.checkpoints": "all"}, "final_adapter": {"engine.checkpoints": "final"}}


def run(ws: Workspace, quick: bool = False, scenario: str | None = None, **_: Any) -> ExperimentResult:
    from gradian.data import load_dataset

    started = time.time()
    name = scenario if scenario in SCENARIOS else SCENARIO
    if scenario and scenario != name:
        ws.log(f"[accused] {scenario} is not one of its poison scenarios; measuring {name}")
    run_ = ws.scenario(name, folder=f"{name}-checkpoints")
    per_epoch = steps_per_epoch(run_.config(ws.cache_dir), int(run_.info["n_train"]))
    saving = {"train.save_checkpoints": True, "train.save_steps": per_epoch}
    ws.train(run_, run_.config(ws.cache_dir, **saving))
    out = ws.experiment_dir("accused")
    stripped = strip_declared_clusters(run_.root / "train.jsonl", out / name / "train.jsonl")
    data = load_dataset(stripped)
    index_of = {e.id: e.index for e in data.examples}
    planted = [int(i) for i in run_.info["planted"]["indices"]]
    capability = str(run_.info["capability"]["name"])
    children: list[ChildReport] = []
    measured: dict[str, dict[str, Any]] = {}
    for mode, overrides in MODES.items():
        cfg = run_.config(ws.cache_dir, **{"dataset": str(stripped), "clustering.method": "auto", **overrides})
        ws.attribute(run_, cfg, capability=capability, cross_check="auto", folder=f"report-auto-clusters-{mode}")
        accusing = Report.of(run_.report)
        accused = accusing.attribution.accused if accusing.attribution is not None else None
        accused_rows = [index_of[i] for i in accused.example_ids] if accused is not None else []
        children.append(ChildReport("attribute", run_.report, run_.report_files, run_.rankings))
        block, accusation, child = retrain_without(ws, run_, cfg, data, out / name / f"retrain-{mode}", planted,
                                                   drop="accused", tag=f"accused, {mode}", capability=capability)
        if child is not None:
            children.append(child)
        figures = accused_figures(accusing, accused_rows, planted, block)
        figures["dropped"] = accusation
        figures["attribute_seconds"] = run_.seconds.get("attribute")
        measured[mode] = figures

    figures = dict(measured["checkpoints"])
    figures["attributed_under"] = "every saved checkpoint (engine.checkpoints: all)"
    figures["final_adapter"] = measured["final_adapter"]
    figures["final_adapter_outcome"] = list(accused_verdict(measured["final_adapter"]))
    figures["round1_seconds"] = dict(run_.seconds)
    status, reason = accused_verdict(figures)
    final_status = figures["final_adapter_outcome"][0]
    reason = f"{name}, under every saved checkpoint: {reason} (final adapter alone: {final_status})"
    verdict = Verdict(
        experiment="accused", status=status, reason=reason, figures=figures,
        params={"scenario": name, "n_train": run_.info["n_train"], "n_planted": len(planted),
                "clustering": "auto", "engine": figures.get("engine"), "checkpoints": "all",
                "save_steps": per_epoch, "quick": quick, "dropped": figures["dropped"]},
        seconds=round(time.time() - started, 2),
    )
    artifacts = [verdict.write(out / "verdict.json")]
    return ExperimentResult(verdict, artifacts, children)
