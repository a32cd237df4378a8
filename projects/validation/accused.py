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

``--seeds 0,1,2`` measures instead what a user with every default gets, over fine-tune seeds: for
each seed (the config's ``seed``: LoRA initialisation and row order) the scenario is fine-tuned
without checkpoints, attributed under the final adapter alone with discovered clusters, and
``gradian counterfactual --drop accused --until-recovered`` (at most ``SEED_ROUNDS`` rounds) retrains
without the accused set, attributing the retrain again and adding what it accuses until the
capability is back. Per seed: the planted rows' AUC by the report's rank score, the accused set's
precision and recall, the first retrain and the last one (items below the base, removal
precision). PASS when, as medians over the seeds, the AUC is at least ``SEED_AUC_MIN``, the last
retrain is within one item of the base and the removed rows' precision is at least
``SEED_PRECISION_MIN``; INCONCLUSIVE when a seed's regression did not pass its gate. A scenario of
``NO_UPTAKE`` (a poison that does not reach the eval on these models) with no gated regression on
any seed is a control instead: PASS when every report says no regression and accuses nothing.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from gradian.report.schema import Report
from poison import SCENARIO
from recovery import retrain_without
from tracking import ChildReport, ExperimentResult
from verdicts import Verdict, accused_figures, accused_verdict
from workspace import Workspace, steps_per_epoch

__all__ = ["run", "run_seeds", "seeds_status", "strip_declared_clusters", "NO_UPTAKE", "SCENARIOS", "SEED_AUC_MIN",
           "SEED_PRECISION_MIN", "SEED_ROUNDS"]

#: ``--seeds``: the medians over seeds a PASS needs (the AUC of the planted rows; the precision of
#: the rows the last retrain removed) and the most counterfactual rounds per seed
SEED_AUC_MIN = 0.9
SEED_PRECISION_MIN = 0.9
SEED_ROUNDS = 3

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


#: the scenarios this experiment reads, every poison scenario of the three worlds: tinyworld's
#: capitals poison (with and without on-topic clean rows, aimed at only some targets, with exact
#: duplicates, buried mid-paragraph), its refusals (also on the eval prompts themselves), the
#: bestiary's diets poison, and the delta's seas poisons (taught redundantly; aimed at half the targets)
SCENARIOS = (SCENARIO, "poison_capitals_ontopic", "poison_capitals_partial", "poison_duplicates", "poison_buried",
             "poison_refusal", "poison_eval_prompts", "bestiary_poison_diets", "delta_poison_redundant",
             "delta_poison_partial")
#: scenarios whose poison, on the offline models, does not reach the eval (the wrong capitals buried
#: mid-paragraph never change the answer to the direct question): with no regression on any seed,
#: ``--seeds`` judges them as controls, a report that accuses rows anyway being the failure
NO_UPTAKE = ("poison_buried",)
#: the attributions it makes of the one fine-tune: the verdict's first, then the comparison
MODES = {"checkpoints": {"engine.checkpoints": "all"}, "final_adapter": {"engine.checkpoints": "final"}}


def run(ws: Workspace, quick: bool = False, scenario: str | None = None, seeds: Sequence[int] | None = None,
        **_: Any) -> ExperimentResult:
    started = time.time()
    name = scenario if scenario in SCENARIOS else SCENARIO
    if scenario and scenario != name:
        ws.log(f"[accused] {scenario} is not one of its poison scenarios; measuring {name}")
    if seeds:
        return run_seeds(ws, name, list(seeds), quick=quick)
    run_ = ws.scenario(name, folder=f"{name}-checkpoints")
    per_epoch = steps_per_epoch(run_.config(ws.cache_dir), int(run_.info["n_train"]))
    saving = {"train.save_checkpoints": True, "train.save_steps": per_epoch}
    ws.train(run_, run_.config(ws.cache_dir, **saving))
    out = ws.experiment_dir("accused")
    stripped, data, planted, capability = _undeclared(run_, out / name)
    children: list[ChildReport] = []
    measured: dict[str, dict[str, Any]] = {}
    for mode, overrides in MODES.items():
        cfg = run_.config(ws.cache_dir, **{"dataset": str(stripped), "clustering.method": "auto", **overrides})
        ws.attribute(run_, cfg, capability=capability, cross_check="auto", folder=f"report-auto-clusters-{mode}")
        accusing = Report.of(run_.report)
        accused_rows = _accused_rows(accusing, data)
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


def _undeclared(run_: Any, folder: Path) -> tuple[Path, Any, list[int], str]:
    """The scenario's training file copied into ``folder`` without its declared clusters, loaded,
    with the planted rows' indices and the capability's name: what an accused run reads."""
    from gradian.data import load_dataset

    stripped = strip_declared_clusters(run_.root / "train.jsonl", folder / "train.jsonl")
    capability = str(run_.info["capability"]["name"])
    return stripped, load_dataset(stripped), [int(i) for i in run_.info["planted"]["indices"]], capability


def _accused_rows(report: Report, data: Any) -> list[int]:
    """The row indices of ``report``'s accused set in ``data`` (none when nothing was accused)."""
    accused = report.attribution.accused if report.attribution is not None else None
    index_of = {e.id: e.index for e in data.examples}
    return [index_of[i] for i in accused.example_ids] if accused is not None else []


#: the scenario truth keys that map each target entity to the wrong answer its planted rows teach
TARGET_KEYS = ("wrong_capitals", "wrong_seas", "wrong_diets")


def regressed_target_auc(truth: dict[str, Any], data: Any, planted: Sequence[int], report: Report,
                         rankings: Any) -> float | None:
    """The AUC, by the report's rank, of the planted rows whose target item regressed (flipped)
    against the clean rows: what the query can see. A planted row's target is the one entity of
    ``truth``'s map named in its prompt; None when some planted row names none or several (rows
    that teach through an alias), or the report has no items."""
    import re

    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values

    targets = next((truth[k] for k in TARGET_KEYS if isinstance(truth.get(k), dict)), None)
    items = report.capability.items if report.capability is not None else None
    if not targets or not items or rankings is None:
        return None
    pattern = {t: re.compile(rf"\b{re.escape(t)}\b") for t in targets}

    def named(text: str) -> list[str]:
        return [t for t, p in pattern.items() if p.search(text)]

    flipped = {t for it in items if it.flipped for t in named(it.prompt)}
    behind = []
    for i in planted:
        example = data.examples[i]
        names = named(" ".join(m.get("content", "") for m in example.messages[:-1]) if example.messages
                      else example.text or "")
        if len(names) != 1:
            return None
        if names[0] in flipped:
            behind.append(i)
    row = rankings["row_index"].to_numpy()
    harm = -rank_values(rankings)
    keep = [j for j, r in enumerate(row) if r in set(behind) or r not in set(planted)]
    if not behind or len(keep) == len(behind):
        return None
    labels = [row[j] in set(behind) for j in keep]
    return round(float(roc_auc_score(labels, harm[keep])), 4)


def _seed_figures(ws: Workspace, name: str, seed: int, out: Path) -> tuple[dict[str, Any], list[ChildReport]]:
    """One seed of ``run_seeds``: the fine-tune, its final-adapter attribution and the rounds."""
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values, run_until_recovered
    from gradian.counterfactual import plan_removal
    from gradian.errors import ConfigError

    run_ = ws.scenario(name, folder=f"{name}-seed{seed}")
    ws.train(run_, run_.config(ws.cache_dir, seed=seed))
    stripped, data, planted, capability = _undeclared(run_, out / f"seed{seed}")
    cfg = run_.config(ws.cache_dir, seed=seed, dataset=str(stripped), **{"clustering.method": "auto"})
    ws.attribute(run_, cfg, capability=capability, cross_check="auto", folder="report-auto-clusters-final")
    children = [ChildReport("attribute", run_.report, run_.report_files, run_.rankings)]
    report = Report.of(run_.report)
    figures = accused_figures(report, _accused_rows(report, data), planted, None)
    figures["seed"] = seed
    if run_.rankings is not None:
        harm = -rank_values(run_.rankings)
        is_planted = run_.rankings["row_index"].isin(set(planted)).to_numpy()
        figures["auc"] = round(float(roc_auc_score(is_planted, harm)), 4)
        figures["auc_regressed_targets"] = regressed_target_auc(run_.info.get("truth") or {}, data, planted, report,
                                                                run_.rankings)
    try:
        plan = plan_removal(data, report=run_.report, rankings=run_.rankings, drop="accused")
    except ConfigError as err:  # nothing accused: no retrain to make
        figures["rounds"], figures["stopped"] = [], str(err)
        figures["first_retrain"] = figures["last_retrain"] = nothing_removed(report)
        return figures, children
    ws.log(f"[accused, seed {seed}] retraining without {plan.n_drop} rows, then round by round until the "
           f"capability is back (at most {SEED_ROUNDS})")
    rounds = run_until_recovered(cfg, plan, out_dir=out / f"seed{seed}" / "rounds", capability=capability,
                                 before=report.capability.to_json() if report.capability else None,
                                 planted=planted, max_rounds=SEED_ROUNDS, log=ws.log)
    block = rounds.report.counterfactual
    assert block is not None
    children.append(ChildReport("counterfactual", rounds.report.to_json(), rounds.files))
    figures["rounds"] = [{"round": r.round, "n_removed": r.n_removed, "outcome": r.outcome, "after": r.after,
                          "items_below_base_after": r.items_below_base_after, "precision": r.precision,
                          "recall": r.recall, "added": len(r.added)} for r in (block.rounds or [])]
    figures["stopped"] = rounds.stopped
    first, last = figures["rounds"][0], figures["rounds"][-1]
    figures["first_retrain"] = {k: first[k] for k in ("n_removed", "after", "items_below_base_after", "precision")}
    figures["last_retrain"] = {k: last[k] for k in ("n_removed", "after", "items_below_base_after", "precision",
                                                    "recall", "outcome")}
    figures["base"] = block.capability.base
    return figures, children


def nothing_removed(report: Report) -> dict[str, Any]:
    """The "last retrain" of a seed whose report accuses nothing: no row removed, so the capability
    stays where the fine-tune left it, every flipped item still below the base. The seed's medians
    count it so (a seed left out of them would let the others pass for it); its precision stays
    None, there being no removal to be precise about."""
    cap = report.capability
    return {"n_removed": 0, "after": cap.tuned if cap is not None else None,
            "items_below_base_after": cap.n_flipped if cap is not None else None, "precision": None,
            "recall": 0.0, "outcome": "nothing_removed"}


def seeds_status(name: str, per_seed: Sequence[dict[str, Any]], medians: dict[str, Any]) -> tuple[str, str]:
    """PASS, FAIL or INCONCLUSIVE of ``run_seeds`` and why (the module doc), from each seed's
    figures and their medians. A scenario of ``NO_UPTAKE`` whose poison reached the eval on no
    seed is judged as a control: PASS when every seed's report says there is no regression and
    accuses nothing, FAIL when one accuses rows anyway."""
    gated = [f["seed"] for f in per_seed if not f.get("regressed")]
    if name in NO_UPTAKE and per_seed and len(gated) == len(per_seed):
        blamed = [f["seed"] for f in per_seed if f.get("n_accused") or f.get("verdict_kind") != "no_regression"]
        where = (f"{name}, {len(per_seed)} seeds: the poison reached the eval on none (no gated regression), "
                 "the control this scenario is")
        if blamed:
            return "FAIL", f"{where}; seeds {blamed} still accused rows or gave a verdict other than no_regression"
        return "PASS", f"{where}; every report says no regression and accuses nothing"
    where = (f"{name}, final adapter, {len(per_seed)} seeds: median AUC {medians['auc']}, accused precision "
             f"{medians['precision']} and recall {medians['recall']}; the last retrain "
             f"{medians['last_items_below_base']} item(s) below the base (the first "
             f"{medians['first_items_below_base']}), removed rows' precision {medians['last_precision']}, "
             f"{medians['rounds']} round(s)")
    if gated:
        return "INCONCLUSIVE", f"{where}; seeds {gated} had no gated regression to attribute"
    misses = []
    if medians["auc"] is None or medians["auc"] < SEED_AUC_MIN:
        misses.append(f"AUC below {SEED_AUC_MIN}")
    if medians["last_items_below_base"] is None or medians["last_items_below_base"] > 1:
        misses.append("the last retrain more than one item below the base")
    if medians["last_precision"] is None or medians["last_precision"] < SEED_PRECISION_MIN:
        misses.append(f"removal precision below {SEED_PRECISION_MIN}")
    return ("FAIL" if misses else "PASS"), where + (f"; {', '.join(misses)}" if misses else "")


def run_seeds(ws: Workspace, name: str, seeds: list[int], quick: bool = False) -> ExperimentResult:
    """Experiment ``accused`` over fine-tune ``seeds``, with every default (module doc)."""
    started = time.time()
    out = ws.experiment_dir("accused") / f"{name}-seeds"
    per_seed: list[dict[str, Any]] = []
    children: list[ChildReport] = []
    for seed in seeds:
        figures, reports = _seed_figures(ws, name, seed, out)
        per_seed.append(figures)
        children += reports
        ws.log(f"[accused, seed {seed}] AUC {figures.get('auc')}, accused {figures.get('n_accused')} rows "
               f"(precision {figures.get('precision')}, recall {figures.get('recall')}); last retrain "
               f"{figures.get('last_retrain')}")

    def median(key: str, part: str | None = None) -> float | None:
        values = [(f.get(part) or {}).get(key) if part else f.get(key) for f in per_seed]
        kept = [float(v) for v in values if v is not None]
        return round(statistics.median(kept), 4) if kept else None

    medians = {"auc": median("auc"), "auc_regressed_targets": median("auc_regressed_targets"), "precision": median("precision"), "recall": median("recall"),
               "first_items_below_base": median("items_below_base_after", "first_retrain"),
               "last_items_below_base": median("items_below_base_after", "last_retrain"),
               "last_precision": median("precision", "last_retrain"),
               "rounds": statistics.median(len(f.get("rounds") or []) for f in per_seed)}
    status, reason = seeds_status(name, per_seed, medians)
    verdict = Verdict(
        experiment="accused", status=status, reason=reason,
        figures={"medians": medians, "per_seed": per_seed},
        params={"scenario": name, "seeds": ",".join(map(str, seeds)), "clustering": "auto",
                "checkpoints": "final", "max_rounds": SEED_ROUNDS, "quick": quick},
        seconds=round(time.time() - started, 2),
    )
    artifacts = [verdict.write(out / "verdict.json")]
    return ExperimentResult(verdict, artifacts, children)
