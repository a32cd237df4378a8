"""One diagnosis from a config: resolve the inputs, run the audit, build the report dict.

Shared by ``gradian diagnose`` and the MLflow entry point, so both read the same inputs the same
way. Only the tokenizer is loaded, never model weights.
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradian.audit.report import build_diagnosis_report
from gradian.audit.runner import AuditResult, run_audit
from gradian.errors import ConfigError

if TYPE_CHECKING:  # imported lazily at run time: the data layer pulls in tokenizer code
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset
    from gradian.jsontypes import JsonObject
    from gradian.report.schema import Report
    from gradian.runs import RunRecord

__all__ = ["Diagnosis", "AuditInputs", "load_audit_inputs", "diagnose"]


@dataclass
class AuditInputs:
    dataset: Dataset | None
    eval_dataset: Dataset | None
    run: RunRecord | None
    tokenizer: PreTrainedTokenizerBase | None
    tokenizer_name: str | None
    base_model: str | None
    max_seq_length: int | None
    #: why there is no tokenizer although the run named a base model (the skip lines say it)
    tokenizer_missing: str | None = None

    def manifest(self) -> JsonObject:
        def ds(d: Dataset | None) -> JsonObject | None:
            return {"path": d.path, "sha256": d.sha256, "n_examples": len(d)} if d is not None else None

        return {
            "dataset": ds(self.dataset),
            "eval_dataset": ds(self.eval_dataset),
            "run": self.run.source if self.run else None,
            "base_model": self.base_model,
            "tokenizer": self.tokenizer_name,
            "max_seq_length": self.max_seq_length,
        }


@dataclass
class Diagnosis:
    inputs: AuditInputs
    result: AuditResult
    report: Report


def with_adapter_settings(run: RunRecord | None, adapter_path: str | None) -> RunRecord | None:
    """``run`` with its LoRA settings read from ``adapter_path``'s ``adapter_config.json`` when the
    run recorded none (a run logged with params only, as the stock MLflow callback does, plus
    ``--adapter DIR``); ``run.inferred['lora']`` says where they came from. A run that knows its
    settings, or no adapter folder, leaves ``run`` as it is."""
    import dataclasses

    if run is None or run.lora.r is not None or not adapter_path:
        return run
    config_file = Path(adapter_path) / "adapter_config.json"
    if not config_file.is_file():
        return run
    from gradian.model_loading import read_adapter_config
    from gradian.runs import LoraSettings

    lora = LoraSettings.from_adapter_config(read_adapter_config(adapter_path))
    if lora.base_model is None:
        lora = dataclasses.replace(lora, base_model=run.lora.base_model)
    return dataclasses.replace(run, lora=lora, inferred={**run.inferred, "lora": f"--adapter {adapter_path}"})


def load_audit_inputs(cfg: GradianConfig, max_seq_length: int | None = None,
                      run: RunRecord | None = None) -> AuditInputs:
    """Dataset, eval set, run record and tokenizer named by ``cfg`` (``run`` may be given ready).

    Where each comes from is ``gradian.inputs.resolve_inputs``'s rule, shared by every lane; a
    tokenizer the user did not name is loaded only from a local directory.
    """
    from gradian.data import load_dataset
    from gradian.inputs import resolve_inputs
    from gradian.model_loading import load_tokenizer

    resolved = resolve_inputs(cfg, run)
    run, filled = resolved.run, resolved.config
    run = with_adapter_settings(run, filled.adapter_path)
    dataset = load_dataset(filled.dataset) if filled.dataset else None
    eval_dataset = load_dataset(filled.eval_dataset) if filled.eval_dataset else None
    # the audit loads no weights: a tokenizer found through the run is read only from a local folder
    usable = resolved.tokenizer_given or resolved.tokenizer_is_local
    tokenizer_name = resolved.tokenizer_name if usable else None
    missing = None
    if resolved.tokenizer_name and not usable:
        missing = (f"no tokenizer: {resolved.tokenizer_origin} names {resolved.tokenizer_name}, which is not a "
                   "folder on this machine (pass --base-model DIR, or set `tokenizer` in the config)")
    tokenizer = (load_tokenizer(tokenizer_name, cfg.trust_remote_code, resolved.tokenizer_origin)
                 if tokenizer_name else None)
    if max_seq_length is None and run is not None:
        max_seq_length = run.config.max_seq_length
    return AuditInputs(
        dataset=dataset,
        eval_dataset=eval_dataset,
        run=run,
        tokenizer=tokenizer,
        tokenizer_name=tokenizer_name,
        base_model=cfg.base_model or None,
        max_seq_length=max_seq_length,
        tokenizer_missing=missing,
    )


def diagnose(cfg: GradianConfig, max_seq_length: int | None = None, run: RunRecord | None = None) -> Diagnosis:
    """Run every check the inputs allow, with the diagnose report they make."""
    import time

    from gradian.config import config_to_dict

    started = time.time()
    inputs = load_audit_inputs(cfg, max_seq_length, run)
    if all(x is None for x in (inputs.dataset, inputs.run, inputs.tokenizer, inputs.eval_dataset)):
        raise ConfigError("nothing to diagnose: pass --dataset, --run or --base-model (or set them in the config)")
    result = run_audit(
        dataset=inputs.dataset,
        tokenizer=inputs.tokenizer,
        run=inputs.run,
        eval_dataset=inputs.eval_dataset,
        max_seq_length=max_seq_length,
        base_model=inputs.base_model,
        config=cfg.audit,
        tokenizer_missing=inputs.tokenizer_missing,
        eval_metric=cfg.evaluation.metric,
    )
    report = build_diagnosis_report(result, inputs=inputs.manifest(), audit_config=config_to_dict(cfg).get("audit"),
                                    started_at=started, thresholds=cfg.verdict)
    return Diagnosis(inputs=inputs, result=result, report=report)
