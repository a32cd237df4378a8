"""The validation work folder: scenarios written once, fine-tunes and reports reused when unchanged.

Every experiment starts from an offline world (``gradian.tinyworld``: tinyworld, or the bestiary
for its scenarios): the world's cached base model, a scenario written into
``<workdir>/scenarios/<name>/``, its fine-tune in ``run/`` and its report in
``report/``. A fine-tune is reused only when a fingerprint of its inputs (the training file, the
config, the base model) matches the one stored beside it, and a report only when its run and
settings match too; ``--fresh`` clears the folder. Within one suite run, ``counterfactual`` thus
reuses the poisoned fine-tune and report that ``poison`` made.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["Workspace", "ScenarioRun", "steps_per_epoch"]

_FINGERPRINT = "validation.fingerprint"


def steps_per_epoch(config: Any, n_rows: int) -> int:
    """Optimizer steps in one epoch of ``n_rows`` training rows under ``config``'s recipe."""
    return math.ceil(n_rows / (config.train.per_device_train_batch_size * config.train.gradient_accumulation_steps))


def _sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class ScenarioRun:
    """A written scenario (and, once trained or attributed, its run and report)."""

    name: str
    root: Path
    info: dict[str, Any]
    record: Any = None
    report: dict[str, Any] | None = None
    rankings: Any = None
    report_files: list[Path] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.root / "gradian.yaml"

    def config(self, cache_dir: Path, **overrides: Any) -> Any:
        from gradian.config import load_config

        return load_config(self.config_path, overrides={"cache_dir": str(cache_dir), **overrides})


class Workspace:
    """``<workdir>``: scenarios, fine-tunes, reports and the shared gradient-index cache."""

    def __init__(self, root: str | Path, log: Callable[[str], None] = print) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.cache_dir = self.root / "cache"
        self.log = log
        self._bases: dict[str, Path] = {}

    @property
    def base_model(self) -> Path:
        """tinyworld's cached base model."""
        return self.base_model_of("tinyworld")

    def base_model_of(self, world: str) -> Path:
        """The cached base model of ``world`` (a key of ``gradian.tinyworld.worlds.WORLDS``), built when missing."""
        if world not in self._bases:
            from gradian.tinyworld.worlds import get_world

            self._bases[world] = get_world(world).ensure_base_model()
        return self._bases[world]

    def scenario(self, name: str, folder: str | None = None) -> ScenarioRun:
        """Write scenario ``name`` of any world (deterministic, a few seconds) into ``scenarios/<folder or name>``."""
        from gradian.tinyworld import write_scenario
        from gradian.tinyworld.worlds import scenario_world

        root = self.root / "scenarios" / (folder or name)
        info = write_scenario(name, root, base_model=self.base_model_of(scenario_world(name).name))
        return ScenarioRun(name=name, root=root, info=info)

    def train(self, run: ScenarioRun, config: Any = None, dataset: Path | None = None) -> Any:
        """Fine-tune the scenario (or reuse the identical fine-tune already there)."""
        from gradian.config import config_hash
        from gradian.runs import read_run_dir
        from gradian.train import train_lora

        config = config or run.config(self.cache_dir)
        data = Path(dataset or config.dataset)
        out = Path(config.train.output_dir if config.train.output_dir != "runs/run" else run.root / "run")
        fingerprint = _sha(data.read_bytes(), config_hash(config),
                           str(self.base_model_of(run.info.get("world", "tinyworld"))))
        marker = out / _FINGERPRINT
        if marker.is_file() and marker.read_text().strip() == fingerprint and (out / "gradian_run.json").is_file():
            self.log(f"[{run.name}] reusing the fine-tune in {out}")
            run.record = read_run_dir(out)
            run.seconds.setdefault("train", 0.0)
            return run.record
        self.log(f"[{run.name}] fine-tuning a LoRA adapter ({out})")
        t0 = time.time()
        run.record = train_lora(config, out, dataset=data, overwrite=True)
        run.seconds["train"] = round(time.time() - t0, 2)
        marker.write_text(fingerprint + "\n")
        return run.record

    def attribute(self, run: ScenarioRun, config: Any = None, *, capability: str = "capitals",
                  cross_check: str = "graddot", folder: str = "report") -> dict[str, Any]:
        """``gradian attribute`` on the scenario's fine-tune (or reuse the identical report)."""
        from gradian.attribution import run_attribution
        from gradian.config import config_hash
        from gradian.counterfactual import load_report

        config = config or run.config(self.cache_dir)
        out = run.root / folder
        run_marker = Path(config.run or run.root / "run") / _FINGERPRINT
        fingerprint = _sha(run_marker.read_text() if run_marker.is_file() else "", config_hash(config),
                           capability, cross_check)
        marker = out / _FINGERPRINT
        if marker.is_file() and marker.read_text().strip() == fingerprint and (out / "report.json").is_file():
            self.log(f"[{run.name}] reusing the report in {out}")
            run.report, run.rankings = load_report(out)
            run.report_files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != _FINGERPRINT)
            run.seconds.setdefault("attribute", 0.0)
            return run.report
        self.log(f"[{run.name}] gradian attribute (engine {config.engine.name}, cross-check {cross_check})")
        t0 = time.time()
        outcome = run_attribution(config, capability=capability, cross_check=cross_check, out_dir=out)
        run.seconds["attribute"] = round(time.time() - t0, 2)
        run.report = outcome.report.to_json() if outcome.report is not None else None
        run.rankings, run.report_files = outcome.rankings, list(outcome.files)
        marker.write_text(fingerprint + "\n")
        return run.report

    def experiment_dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_json(self, path: Path, data: Any) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        return path
