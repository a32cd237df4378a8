"""``run_counterfactual``: retrain without the removed examples and measure the capability again.

A ranking is a hypothesis; retraining tests it. The retrain starts from the same base model with
the same training settings and seed as the original fine-tune, on the training file minus the
removed rows (kept rows in their original order). The capability is then measured exactly as the
evaluate lane measures it (base under ``disable_adapter()`` vs the retrained adapter, paired
bootstrap), and compared with the original fine-tune's score.

Interface: ``run_counterfactual(cfg, plan, ...) -> CounterfactualOutcome`` and
``retrain_config(cfg, run) -> (config, source)``: the config the retrain uses (the config's
``train:`` section, or, when that section is left at its defaults and a run is given, the trainer
settings the run recorded).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from gradian.counterfactual.figures import (
    capability_recovery,
    counterfactual_outcome,
    predicted_score_sums,
    removal_precision,
)
from gradian.counterfactual.selection import RemovalPlan
from gradian.counterfactual.subset import write_kept_rows
from gradian.errors import ConfigError
from gradian.report.schema import (
    Capability,
    Counterfactual,
    CounterfactualInputs,
    CounterfactualManifest,
    CounterfactualSeconds,
    DatasetSummary,
    GroundTruth,
    PredictedSums,
    Recovery,
    Removal,
    Report,
    Verdict,
)

if TYPE_CHECKING:
    from gradian.config import GradianConfig, TrainConfig
    from gradian.evaluate.result import CapabilityResult
    from gradian.runs import RunRecord

__all__ = ["CounterfactualOutcome", "retrain_config", "run_counterfactual", "KEPT_DATA_FILE", "RETRAIN_SUBDIR"]

#: inside the output folder: the kept rows, and the retrained run
KEPT_DATA_FILE = "data/train_kept.jsonl"
RETRAIN_SUBDIR = "run"
#: train settings that say nothing about the recipe, ignored when deciding "left at the defaults"
_NOT_RECIPE = ("backend", "base_model", "output_dir", "logging_steps", "save_steps", "save_checkpoints", "extra")


@dataclass
class CounterfactualOutcome:
    #: the report as written (report.json is ``report.to_json()``)
    report: Report
    plan: RemovalPlan
    #: the retrained model's ``CapabilityResult`` (base vs retrained)
    capability: CapabilityResult
    #: the retrained run's ``RunRecord``
    run: RunRecord
    files: list[Path] = field(default_factory=list)


def _train_at_defaults(train: TrainConfig) -> bool:
    from gradian.config import TrainConfig

    default = TrainConfig()
    return all(getattr(train, f.name) == getattr(default, f.name)
               for f in dataclasses.fields(train) if f.name not in _NOT_RECIPE)


def retrain_config(cfg: GradianConfig, run: RunRecord | None = None) -> tuple[GradianConfig, str]:
    """``(config, source)``: the config's own ``train:`` recipe, or the one ``run`` recorded."""
    if run is None or not _train_at_defaults(cfg.train):
        return cfg, "config train section"
    c, lora = run.config, run.lora
    updates: dict[str, Any] = {}
    for name in ("learning_rate", "num_train_epochs", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "lr_scheduler_type", "max_grad_norm", "weight_decay",
                 "max_seq_length", "warmup_ratio"):
        value = getattr(c, name, None)
        if value is not None:
            updates[name] = value
    extra = dict(cfg.train.extra or {})
    if c.warmup_ratio is None and c.warmup_steps:
        extra["warmup_steps"] = int(c.warmup_steps)
    if c.max_steps is not None and c.max_steps > 0:
        extra["max_steps"] = int(c.max_steps)
    if lora.r:
        updates["r"] = int(lora.r)
    if lora.alpha is not None:
        updates["lora_alpha"] = int(lora.alpha)
    if lora.dropout is not None:
        updates["lora_dropout"] = float(lora.dropout)
    if lora.target_modules:
        updates["target_modules"] = list(lora.target_modules)
    train = dataclasses.replace(cfg.train, extra=extra, **updates)
    seed = c.seed if c.seed is not None else cfg.seed
    return dataclasses.replace(cfg, train=train, seed=seed), f"run {run.source}"


def _capability_before(cfg: GradianConfig, before: Mapping[str, Any] | None, capability: str,
                       log: Callable[[str], None]) -> tuple[dict[str, Any] | None, str]:
    """The original fine-tune's capability block and where it came from."""
    if before is not None:
        return dict(before), "the accusing report"
    if cfg.adapter_path:
        from gradian.evaluate import evaluate_capability

        log(f"measuring '{capability}' on the original fine-tune {cfg.adapter_path}")
        return evaluate_capability(cfg, cfg.eval_dataset, adapter_path=cfg.adapter_path,
                                   capability=capability).to_dict(), "measured on the original adapter"
    return None, "unknown (no report and no original adapter)"


def run_counterfactual(
    cfg: GradianConfig,
    plan: RemovalPlan,
    *,
    out_dir: str | Path,
    capability: str = "capability",
    before: Mapping[str, Any] | None = None,
    planted: Iterable[int] | None = None,
    run: RunRecord | None = None,
    write: bool = True,
    log: Callable[[str], None] = lambda message: None,
) -> CounterfactualOutcome:
    """Retrain without ``plan``'s rows, re-measure, and return (and write) the counterfactual report.

    ``cfg`` names the base model, the training data ``plan`` was made from, the eval set and the
    training recipe; ``before`` is the original fine-tune's capability block (e.g. the accusing
    report's), else it is measured on ``cfg.adapter_path`` when set. ``planted`` (row indices of
    known-bad rows, e.g. a tinyworld scenario's ``planted.indices``) adds removal precision.
    ``run`` is the original run's ``RunRecord``, used for its recipe when the config has none.
    """
    from gradian import __version__
    from gradian.config import config_hash, config_to_dict
    from gradian.data import load_dataset
    from gradian.evaluate import evaluate_capability
    from gradian.train import train_lora

    started = time.time()
    if not cfg.eval_dataset:
        raise ConfigError("a counterfactual re-measures the capability: pass --eval-dataset or set eval_dataset")
    if not cfg.dataset:
        raise ConfigError("a counterfactual retrains on the training data minus the removed rows: pass --dataset")
    out = Path(out_dir)
    dataset = load_dataset(cfg.dataset)
    if dataset.sha256 != plan.dataset_sha256:
        raise ConfigError(f"the removal plan was made for {plan.dataset_path}, not {cfg.dataset}; plan and retrain on the same file")
    before_cap, before_source = _capability_before(cfg, before, capability, log)

    kept_path = write_kept_rows(dataset, plan.keep_indices(), out / KEPT_DATA_FILE)
    retrain_cfg, recipe_source = retrain_config(cfg, run)
    retrain_cfg = dataclasses.replace(retrain_cfg, train=dataclasses.replace(
        retrain_cfg.train, output_dir=str(out / RETRAIN_SUBDIR), save_checkpoints=False))
    log(f"retraining on {plan.n_keep} of {plan.n_examples} rows ({plan.n_drop} removed), seed {retrain_cfg.seed}")
    t0 = time.time()
    record = train_lora(retrain_cfg, out / RETRAIN_SUBDIR, dataset=kept_path, overwrite=True)
    train_seconds = time.time() - t0

    log(f"measuring '{capability}' on the base and the retrained models")
    t0 = time.time()
    after = evaluate_capability(retrain_cfg, cfg.eval_dataset, adapter_path=record.adapter_dir, capability=capability)
    eval_seconds = time.time() - t0

    recovery = capability_recovery(
        base=after.base,
        before=None if before_cap is None else float(before_cap["tuned"]),
        after=after.tuned,
        n_items=after.n_items,
        metric=after.metric,
        status_after=after.status,
    )
    outcome, kind = counterfactual_outcome(recovery)
    truth = removal_precision(plan.drop_indices, planted) if planted is not None else None
    predicted = predicted_score_sums(plan.scores, plan.drop_ids) if plan.scores else None

    block = Counterfactual(
        outcome=outcome,  # type: ignore[arg-type]
        removal=Removal.of(plan),
        capability=dataclasses.replace(recovery, before_source=before_source),
        ground_truth=GroundTruth.from_json(truth, "counterfactual.ground_truth") if truth is not None else None,
        predicted=PredictedSums.from_json(predicted, "counterfactual.predicted") if predicted is not None else None,
        recipe_source=recipe_source,
        seconds=CounterfactualSeconds(train=round(train_seconds, 2), evaluate=round(eval_seconds, 2),
                                      total=round(time.time() - started, 2)),
    )
    kept = load_dataset(kept_path)
    manifest = CounterfactualManifest(
        gradian_version=__version__,
        config_hash=config_hash(retrain_cfg),
        config=config_to_dict(retrain_cfg),
        inputs=CounterfactualInputs(
            dataset=DatasetSummary(path=plan.dataset_path, sha256=plan.dataset_sha256, n_examples=plan.n_examples),
            kept_dataset=DatasetSummary(path=str(kept_path), sha256=kept.sha256, n_examples=len(kept)),
            eval_dataset=cfg.eval_dataset,
            base_model=retrain_cfg.base_model,
            adapter_before=cfg.adapter_path,
            adapter_after=record.adapter_dir,
            capability=capability,
            seed=retrain_cfg.seed,
        ),
        seconds=block.seconds.total if block.seconds is not None else 0.0,
    )
    report = Report(
        capability=Capability.of(after),
        findings=[],
        attribution=None,
        verdict=Verdict(kind=kind,  # type: ignore[arg-type]
                        summary=_summary(plan, block.capability, outcome, block.ground_truth, block.predicted,
                                         capability),
                        hedges=_hedges(block.capability, outcome, block.ground_truth), accused_cluster=plan.cluster),
        manifest=manifest,
        counterfactual=block,
    )
    files: list[Path] = []
    if write:
        from gradian.report import write_report

        files = write_report(report, out,
                             extra_files={"removed_ids.txt": "".join(i + "\n" for i in plan.drop_ids).encode("utf-8")})
    return CounterfactualOutcome(report=report, plan=plan, capability=after, run=record, files=files)


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _summary(plan: RemovalPlan, rec: Recovery, outcome: str, truth: GroundTruth | None,
             predicted: PredictedSums | None, capability: str) -> str:
    before = "?" if rec.before is None else f"{rec.before:.4f}"
    text = (f"Retrained without {plan.n_drop} of {plan.n_examples} examples ({plan.reason}), same base, "
            f"recipe and seed: '{capability}' ({rec.metric}) went {rec.base:.4f} on the base, {before} "
            f"after the original fine-tune, {rec.after:.4f} after the retrain")
    if rec.recovered_fraction is not None:
        text += f"; {_pct(rec.recovered_fraction)} of the loss recovered"
    if rec.items_below_base_after is not None:
        text += f"; {rec.items_below_base_after:g} item(s) below the base (status {rec.status_after})"
    text += f". Outcome: {outcome.replace('_', ' ')}."
    if truth is not None:
        text += (f" Removal precision {_pct(truth.precision)} ({truth.n_planted_removed} of "
                 f"{truth.n_removed} removed rows were planted), recall {_pct(truth.recall)}.")
    if predicted is not None:
        text += (f" The accusing scores summed {predicted.sum_all:+.4g} over the whole set and "
                 f"{predicted.sum_kept:+.4g} over the kept rows"
                 + (" (the sign changed)." if predicted.sign_changed else " (same sign)."))
    return text


def _hedges(rec: Recovery, outcome: str, truth: GroundTruth | None) -> list[str]:
    hedges = []
    if outcome == "recovered":
        hedges.append("Recovery shows the removed rows were enough to cause the loss together; it does not "
                      "show that every removed row was harmful.")
    if truth is not None and truth.precision is not None and truth.precision < 0.5:
        hedges.append(f"Only {_pct(truth.precision)} of the removed rows were planted: the removal took a lot "
                      "of innocent data with it.")
    if rec.before is None:
        hedges.append("The original fine-tune's score is unknown (no report, no original adapter), so recovery "
                      "is judged against the base model only.")
    if outcome in ("partial", "not_recovered"):
        hedges.append("The capability did not come back: the removed rows are not the whole cause. Look at the "
                      "audit's config findings and the next clusters in the ranking.")
    return hedges
