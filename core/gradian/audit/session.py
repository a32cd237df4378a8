"""One diagnosis from a config: resolve the inputs, run the audit, build the report dict.

Shared by ``gradian diagnose`` and the MLflow entry point, so both read the same inputs the same
way. Only the tokenizer is loaded, never model weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradian.audit.report import diagnosis_report
from gradian.audit.runner import AuditResult, run_audit
from gradian.errors import ConfigError

__all__ = ["Diagnosis", "AuditInputs", "load_audit_inputs", "diagnose"]


@dataclass
class AuditInputs:
    dataset: Any
    eval_dataset: Any
    run: Any
    tokenizer: Any
    tokenizer_name: str | None
    base_model: str | None
    max_seq_length: int | None

    def manifest(self) -> dict[str, Any]:
        def ds(d: Any) -> dict[str, Any] | None:
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
    report: dict[str, Any]


def load_audit_inputs(cfg: Any, max_seq_length: int | None = None, run: Any = None) -> AuditInputs:
    """Dataset, eval set, run record and tokenizer named by ``cfg`` (``run`` may be given ready).

    ``cfg.run_dir`` may be a local directory or a tracking-server reference (``runs:/<id>``).
    The dataset defaults to the one the run recorded, and the tokenizer to the config's
    tokenizer, the base model, or the adapter's base model when that is a local directory.
    """
    from gradian.data import load_dataset
    from gradian.model_loading import load_tokenizer
    from gradian.runs import resolve_run

    if run is None and cfg.run_dir:
        run = resolve_run(cfg.run_dir, cache_dir=cfg.cache_dir)
    dataset_path = cfg.dataset
    if dataset_path is None and run is not None and run.dataset.path and Path(run.dataset.path).exists():
        dataset_path = run.dataset.path  # the run recorded its training data and it is reachable
    dataset = load_dataset(dataset_path) if dataset_path else None
    eval_dataset = load_dataset(cfg.eval_dataset) if cfg.eval_dataset else None

    tokenizer_name, flag = None, "--base-model"
    if cfg.tokenizer:
        tokenizer_name, flag = cfg.tokenizer, "tokenizer (config)"
    elif cfg.base_model:
        tokenizer_name = cfg.base_model
    elif run is not None and run.lora.base_model and Path(run.lora.base_model).is_dir():
        tokenizer_name, flag = run.lora.base_model, "adapter_config.json base_model_name_or_path"
    tokenizer = load_tokenizer(tokenizer_name, cfg.trust_remote_code, flag) if tokenizer_name else None
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
    )


def diagnose(cfg: Any, max_seq_length: int | None = None, run: Any = None) -> Diagnosis:
    """Run every check the inputs allow; the report dict has the report.json shape."""
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
    )
    report = diagnosis_report(result, inputs=inputs.manifest(), audit_config=config_to_dict(cfg).get("audit"),
                              started_at=started)
    return Diagnosis(inputs=inputs, result=result, report=report)
