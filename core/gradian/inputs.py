"""What a lane works on, resolved once: the config filled from the run record, and the tokenizer.

Interface: ``resolve_inputs(cfg, run=None, report_inputs=None) -> ResolvedInputs``. Every lane
(``diagnose``, ``index``, ``attribute``, ``counterfactual``) calls it, so one rule decides where
each input comes from:

- the run: ``run`` when the caller read it already, else the one ``cfg.run`` names;
- ``adapter_path``, ``base_model``, ``dataset``, ``eval_dataset``: the config (its file and the
  flags) first, then ``report_inputs`` (the inputs recorded by the report a counterfactual starts
  from), then the run record (its adapter, the base its adapter was trained from, its training
  data when that file is reachable);
- the tokenizer: ``cfg.tokenizer``, else the base model, else the base named by the adapter's
  ``adapter_config.json``. ``tokenizer_given`` says whether the user named it (the config, or the
  base model as a flag or key); one found only through the run or the adapter is worth loading
  where no model weights are loaded (the audit) only when it is a local directory.

Nothing here loads a model or a dataset; what a lane cannot work without it checks itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gradian.config import GradianConfig
    from gradian.runs import RunRecord

__all__ = ["RecordedInputs", "ResolvedInputs", "resolve_inputs", "tokenizer_source"]


class _RecordedFile(Protocol):
    @property
    def path(self) -> str | None: ...


class RecordedInputs(Protocol):
    """The inputs a report recorded (``gradian.report.schema.AnalysisInputs`` is one)."""

    @property
    def adapter(self) -> str | None: ...

    @property
    def base_model(self) -> str | None: ...

    @property
    def dataset(self) -> _RecordedFile | None: ...

    @property
    def eval_dataset(self) -> _RecordedFile | None: ...

#: the config fields filled from a report's inputs or a run record, in this order of keys
FILLED = ("adapter_path", "base_model", "dataset", "eval_dataset")


@dataclass(frozen=True)
class ResolvedInputs:
    """The config with its inputs filled, the run it was filled from, and the tokenizer to load."""

    config: GradianConfig
    run: RunRecord | None
    #: where each filled field came from: "config", "report" or "run"
    origins: dict[str, str]
    tokenizer_name: str | None
    #: the config key or flag that named the tokenizer, for messages
    tokenizer_origin: str
    #: the user named the tokenizer (config ``tokenizer`` or ``base_model``), not the run or adapter
    tokenizer_given: bool

    @property
    def tokenizer_is_local(self) -> bool:
        return bool(self.tokenizer_name) and Path(str(self.tokenizer_name)).is_dir()


def _from_run(run: RunRecord | None) -> dict[str, str | None]:
    if run is None:
        return {}
    data = run.dataset.path if run.dataset.path and Path(run.dataset.path).exists() else None
    return {"adapter_path": run.adapter_dir, "base_model": run.lora.base_model, "dataset": data}


def _from_report(inputs: RecordedInputs | None) -> dict[str, str | None]:
    if inputs is None:
        return {}
    return {"adapter_path": inputs.adapter, "base_model": inputs.base_model,
            "dataset": inputs.dataset.path if inputs.dataset else None,
            "eval_dataset": inputs.eval_dataset.path if inputs.eval_dataset else None}


def tokenizer_source(cfg: GradianConfig, base_given: bool = True, base_origin: str | None = None) -> tuple[str | None, str, bool]:
    """``(name, origin, given)`` of the tokenizer for ``cfg``: ``tokenizer``, else ``base_model``,
    else the base in the adapter's ``adapter_config.json``. ``origin`` is the key or flag that named
    it; ``given`` whether the user named it (``base_given``: ``base_model`` came from the user, not
    from a run record, which ``base_origin`` then describes). Reads nothing but that ``adapter_config.json``."""
    if cfg.tokenizer:
        return cfg.tokenizer, "tokenizer (config)", True
    if cfg.base_model:
        origin = "--base-model" if base_given else (base_origin or "the run's adapter_config.json base_model_name_or_path")
        return cfg.base_model, origin, base_given
    if cfg.adapter_path and (Path(cfg.adapter_path) / "adapter_config.json").is_file():
        from gradian.model_loading import read_adapter_config

        name = read_adapter_config(cfg.adapter_path).get("base_model_name_or_path") or None
        return name, "adapter_config.json base_model_name_or_path", False
    return None, "--base-model", False


def resolve_inputs(cfg: GradianConfig, run: RunRecord | None = None, report_inputs: RecordedInputs | None = None) -> ResolvedInputs:
    """Fill ``cfg``'s inputs from ``report_inputs`` and the run record, and name the tokenizer.

    ``report_inputs``: ``Report.manifest.inputs`` of the report a lane starts from.
    """
    if run is None and cfg.run:
        from gradian.runs import resolve_run, run_options

        run = resolve_run(cfg.run, cache_dir=cfg.cache_dir, **run_options(cfg))
    origins: dict[str, str] = {}
    updates: dict[str, Any] = {}  # str values, but mypy checks replace(**updates) against every config field
    sources = (("report", _from_report(report_inputs)), ("run", _from_run(run)))
    for key in FILLED:
        if getattr(cfg, key):
            origins[key] = "config"
            continue
        for origin, values in sources:
            if values.get(key):
                updates[key], origins[key] = values[key], origin
                break
    given_base = bool(cfg.base_model)
    cfg = dataclasses.replace(cfg, **updates) if updates else cfg
    base_origin = (run.inferred.get("base_model") if run is not None and origins.get("base_model") == "run"
                   and isinstance(getattr(run, "inferred", None), dict) else None)
    name, origin, given = tokenizer_source(cfg, base_given=given_base, base_origin=base_origin)
    return ResolvedInputs(config=cfg, run=run, origins=origins, tokenizer_name=name, tokenizer_origin=origin,
                          tokenizer_given=given)
