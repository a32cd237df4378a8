"""``run_until_recovered``: counterfactual rounds that accumulate the accused rows until the
capability is back.

A wrong fact taught by many redundant rows survives the removal of most of them: the rows left in
still teach it, and on the original adapter their harm was hidden behind the rows that taught it
more strongly. After a retrain without the accused set it is not hidden any more. So each round
retrains the original training file without every row removed so far, measures the capability,
and, unless it came back, attributes the regression again on the retrained adapter (same eval
set, same config, the kept rows as the training data) and adds rows to the removal:

- when the first removal was a report's accused set (``plan.topic_ids``: the cluster it was
  refined from), the kept rows of that topic whose harm stands out under the retrain, refined as
  the report refines its cluster. The rounds look for what the first removal left of the same
  cause; once most of it is gone, the harm that is left can sum larger over a big unrelated topic
  (a little drift per row over hundreds of rows) than over the few survivors, and the retrain's
  own verdict would then accuse that topic (measured on the delta world's redundant poison,
  docs/validation.md);
- otherwise (ids given by hand), the accused set of the retrain's report.

The rounds stop when the capability is back (``recovered``, and for pass/fail metrics at most
one item below the base; or nothing to recover), when a round finds nothing to add (no harm
stands out on the topic, or the retrain's report accuses nothing), or after ``max_rounds``
retrains.

Every round writes its own folder (``round-<k>/``: the counterfactual report, the kept rows, the
retrained run, and ``attribution/``, the report that chose the next rows); the final report is the
last round's, with ``counterfactual.rounds`` listing every round, the rows each one added, and why
the rounds stopped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import numpy as np

from gradian.counterfactual.experiment import KEPT_DATA_FILE, RETRAIN_SUBDIR, CounterfactualOutcome, run_counterfactual
from gradian.counterfactual.selection import RemovalPlan
from gradian.errors import ConfigError
from gradian.report.schema import CounterfactualRound, Report

if TYPE_CHECKING:
    from gradian.config import GradianConfig
    from gradian.data import Dataset
    from gradian.runs import RunRecord

__all__ = ["MAX_ROUNDS", "RoundsOutcome", "capability_back", "run_until_recovered"]

#: the most retrains ``--max-rounds`` accepts (each is a full fine-tune)
MAX_ROUNDS = 10


@dataclass
class RoundsOutcome:
    #: every round's counterfactual, in order
    rounds: list[CounterfactualOutcome]
    #: the final report (the last round's, with ``counterfactual.rounds``)
    report: Report
    #: why the rounds stopped
    stopped: str
    files: list[Path] = field(default_factory=list)


def capability_back(outcome: str, items_below_base_after: float | None) -> bool:
    """Whether a round's retrain ends the rounds: nothing was lost, or the retrain is ``recovered``
    (no significant regression left) and, for pass/fail metrics, at most one item below the base.
    A handful of items is too few for the bootstrap to call a loss of two or three of them a
    regression, yet a user who lost three answers has not got the capability back."""
    if outcome == "nothing_to_recover":
        return True
    if outcome != "recovered":
        return False
    return items_below_base_after is None or items_below_base_after <= 1.0


def round_config(cfg: GradianConfig, kept_path: Path, adapter_dir: str | Path | None, run_dir: Path,
                 outcome: str) -> GradianConfig:
    """The config that attributes a round's retrain: the kept rows, the retrained adapter and run. A
    retrain that came out ``recovered`` still has items lost (else the rounds would have stopped),
    too few for the significance gate: it is attributed without the gate (the report says so)."""
    attribute_cfg = dataclasses.replace(cfg, dataset=str(kept_path), run=str(run_dir),
                                        adapter_path=str(adapter_dir) if adapter_dir is not None else None)
    if outcome == "recovered":
        attribute_cfg = dataclasses.replace(
            attribute_cfg, evaluation=dataclasses.replace(cfg.evaluation, require_significant=False))
    return attribute_cfg


def _on_topic(scores: Mapping[str, float], original_of: Mapping[str, str], topic: set[str],
              seed: int) -> tuple[list[str], str]:
    """The rows a later round adds when the first removal came from an accused topic: the kept rows
    of that topic whose harm stands out under the retrained adapter's scores, refined as the
    report's accused set is (``refine_accused``; no gradient siblings). None when nothing stands
    out (the topic's scores are not bimodal). Returns the kept-data ids and one line saying why."""
    from gradian.cluster import refine_accused

    ids = list(scores)
    values = np.asarray([scores[i] for i in ids], dtype=np.float64)
    members = [j for j, kid in enumerate(ids) if original_of.get(kid) in topic]
    if not members:
        return [], "no row of the accused topic is left"
    refined = refine_accused("topic", [ids[j] for j in members], values[members],
                             scale=float(np.median(np.abs(values))) or 1.0,
                             total_negative=float(values[values < 0].sum()), seed=seed)
    if refined.method == "whole_cluster":
        return [], (f"no harm stands out among the {len(members)} rows left of the accused topic under its "
                    "retrain (their scores are not bimodal)")
    return list(refined.example_ids), (f"{refined.n} of the {len(members)} rows left of the accused topic stand "
                                       f"out under its retrain ({refined.method})")


def _unknown_to_base(cfg: GradianConfig, kept: Dataset, chosen: list[str]) -> tuple[list[str], list[str]]:
    """``chosen`` split into the rows the base model did not already answer as written and those it
    did (loss <= ``clustering.accused_known_nats`` under the base, as the report's accused set
    leaves them out); the base is loaded with the round's adapter, which is then switched off."""
    from gradian.evaluate.likelihood import base_losses
    from gradian.model_loading import load_peft_model, load_tokenizer

    line = float(cfg.clustering.accused_known_nats)
    if line <= 0 or not chosen or not cfg.adapter_path:
        return chosen, []
    model = load_peft_model(cfg.base_model, cfg.adapter_path, cfg)
    base = cfg.base_model or str(model.peft_config[model.active_adapter].base_model_name_or_path)
    tokenizer = load_tokenizer(cfg.tokenizer or base, cfg.trust_remote_code)
    by_id = kept.by_id()
    losses = base_losses(model, tokenizer, [by_id[eid] for eid in chosen], cfg.grads.max_seq_length,
                         batch_size=cfg.evaluation.batch_size)
    del model
    known = [eid for eid, loss in zip(chosen, losses) if loss is not None and loss <= line]
    gone = set(known)
    return [eid for eid in chosen if eid not in gone], known


def _round_plan(first: RemovalPlan, dataset: Dataset, ids: list[str], round_no: int, added: int) -> RemovalPlan:
    position = {eid: i for i, eid in enumerate(dataset.ids)}
    return dataclasses.replace(
        first, drop_ids=list(ids), drop_indices=[position[i] for i in ids],
        reason=first.reason if round_no == 1 else
        f"{first.reason}, then {len(ids) - first.n_drop} row(s) accused on the retrained adapters of rounds 1-{round_no - 1}"
        f" ({added} in round {round_no - 1})")


def run_until_recovered(
    cfg: GradianConfig,
    plan: RemovalPlan,
    *,
    out_dir: str | Path,
    capability: str = "capability",
    before: Mapping[str, object] | None = None,
    planted: Iterable[int] | None = None,
    run: RunRecord | None = None,
    max_rounds: int = 3,
    log: Callable[[str], None] = lambda message: None,
) -> RoundsOutcome:
    """Rounds of ``run_counterfactual`` from ``plan``, each adding the accused set of an attribution
    on the previous round's retrained adapter; see the module docstring. The arguments are
    ``run_counterfactual``'s, plus ``max_rounds`` (1 to ``MAX_ROUNDS``)."""
    from gradian.attribution.pipeline import run_attribution
    from gradian.data import load_dataset
    from gradian.report import write_report

    if not 1 <= int(max_rounds) <= MAX_ROUNDS:
        raise ConfigError(f"--max-rounds {max_rounds}: give 1 to {MAX_ROUNDS} (each round is a full retrain)")
    if not cfg.dataset:
        raise ConfigError("a counterfactual retrains on the training data minus the removed rows: pass --dataset")
    out = Path(out_dir)
    dataset = load_dataset(cfg.dataset)
    planted = list(planted) if planted is not None else None
    removed = list(plan.drop_ids)
    outcomes: list[CounterfactualOutcome] = []
    rows: list[CounterfactualRound] = []
    added_last = 0
    stopped = ""
    for k in range(1, int(max_rounds) + 1):
        round_plan = _round_plan(plan, dataset, removed, k, added_last)
        log(f"round {k} of at most {max_rounds}: retraining without {round_plan.n_drop} rows")
        outcome = run_counterfactual(cfg, round_plan, out_dir=out / f"round-{k}", capability=capability,
                                     before=before, planted=planted, run=run, log=log)
        outcomes.append(outcome)
        block = outcome.report.counterfactual
        assert block is not None
        truth = block.ground_truth
        row = CounterfactualRound(
            round=k, n_removed=round_plan.n_drop, outcome=block.outcome, after=block.capability.after,
            recovered_fraction=block.capability.recovered_fraction,
            items_below_base_after=block.capability.items_below_base_after,
            precision=truth.precision if truth is not None else None,
            recall=truth.recall if truth is not None else None,
            report=f"round-{k}/report.json")
        rows.append(row)
        state = block.outcome.replace("_", " ")
        if capability_back(block.outcome, block.capability.items_below_base_after):
            stopped = f"round {k}: {state}"
            break
        if block.outcome == "recovered":
            state = (f"no significant regression left, but {block.capability.items_below_base_after:g} items "
                     "still below the base")
            log(f"round {k}: {state}")
        if k == max_rounds:
            stopped = f"round {k}: {state}, and that was the last of --max-rounds {max_rounds}"
            break
        # attribute the regression that is left, on the retrained adapter and the rows it kept
        kept_path = out / f"round-{k}" / KEPT_DATA_FILE
        kept = load_dataset(kept_path)
        original_of = dict(zip(kept.ids, (dataset.ids[i] for i in round_plan.keep_indices())))
        attribute_cfg = round_config(cfg, kept_path, outcome.run.adapter_dir, out / f"round-{k}" / RETRAIN_SUBDIR,
                                     block.outcome)
        log(f"round {k}: attributing what is left of the regression on the retrained adapter")
        attributed = run_attribution(attribute_cfg, capability=capability, out_dir=out / f"round-{k}" / "attribution")
        typed = attributed.report
        assert typed is not None  # a single process always reports
        scores: dict[str, float] = {}
        if attributed.rankings is not None:
            scores = dict(zip(attributed.rankings["example_id"].astype(str),
                              attributed.rankings["score"].astype(float)))
        if plan.topic_ids and scores:
            chosen, why = _on_topic(scores, original_of, set(plan.topic_ids), cfg.seed)
            chosen, known = _unknown_to_base(attribute_cfg, kept, chosen)
            if known:
                why += (f"; {len(known)} of them left out, the base model already answering them as written "
                        f"(loss <= {attribute_cfg.clustering.accused_known_nats:g} nat)")
            if not chosen:
                stopped = f"round {k}: {state}; {why}"
                break
            log(f"round {k}: {why}")
        else:
            accused = typed.attribution.accused if typed.attribution is not None else None
            if accused is None or not accused.example_ids:
                stopped = (f"round {k}: {state}; the attribution of its retrain accuses no "
                           f"rows (verdict {typed.verdict.kind}: {typed.verdict.summary})")
                break
            chosen = list(accused.example_ids)
        pairs = [(kid, original_of[kid]) for kid in chosen if kid in original_of]
        new = [eid for _, eid in pairs]
        row.added = [{"example_id": eid, "score": float(scores.get(kid, float("nan")))} for kid, eid in pairs]
        removed += [eid for eid in new if eid not in set(removed)]
        added_last = len(new)
    rows[-1].stopped = stopped
    last = outcomes[-1].report
    assert last is not None and last.counterfactual is not None
    final = dataclasses.replace(
        last, counterfactual=dataclasses.replace(last.counterfactual, rounds=rows),
        verdict=dataclasses.replace(last.verdict, summary=f"After {len(rows)} round(s) ({stopped}). {last.verdict.summary}"))
    files = write_report(final, out, extra_files={
        "removed_ids.txt": "".join(i + "\n" for i in outcomes[-1].plan.drop_ids).encode("utf-8")})
    return RoundsOutcome(rounds=outcomes, report=final, stopped=stopped, files=files)
