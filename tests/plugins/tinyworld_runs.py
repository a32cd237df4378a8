"""Fine-tunes of tinyworld scenarios, trained once per test session and shared by every test.

- ``tinyworld_run``: a session-scoped factory, ``tinyworld_run(name) -> TinyworldRun`` (any scenario
  of any world: a bestiary or delta one is trained on its own world's base). The first
  call for a scenario writes its files (``write_scenario``) and fine-tunes it with ``train_lora``
  and the scenario's own settings (about 20 s on 2 CPU cores for the baseline's 4 epochs, a minute for 12);
  later calls in the session return the same run.
- ``attributed``: ``attributed(name) -> (run, outcome, out_dir)``, the scenario attributed once per
  session with every default but the contrastive query (``run_attribution(..., out_dir=...)``). ``TinyworldRun.config(**overrides)`` loads the
  scenario's ``gradian.yaml`` with its index cache inside the scenario directory, so every test
  attributing the same run with the same settings gets a cache hit on the gradient index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class TinyworldRun:
    """A scenario written and fine-tuned: its directory, ground truth and run record."""

    name: str
    root: Path
    info: dict[str, Any]
    record: Any

    @property
    def config_path(self) -> Path:
        return self.root / "gradian.yaml"

    @property
    def planted_rows(self) -> set[int]:
        return set((self.info.get("planted") or {}).get("indices") or [])

    def config(self, **overrides: Any) -> Any:
        """The scenario's config, on CPU, indexing into ``<root>/.gradian`` (dotted-key overrides)."""
        from gradian.config import load_config

        return load_config(self.config_path, {"cache_dir": str(self.root / ".gradian"), "device": "cpu", **overrides})


class _TinyworldRuns:
    def __init__(self, base: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._base = base
        self._tmp = tmp_path_factory
        self._runs: dict[str, TinyworldRun] = {}

    def __call__(self, name: str) -> TinyworldRun:
        if name not in self._runs:
            self._runs[name] = self._train(name)
        return self._runs[name]

    def _train(self, name: str) -> TinyworldRun:
        from gradian.tinyworld import write_scenario
        from gradian.train import train_lora

        from gradian.tinyworld.worlds import scenario_world

        root = self._tmp.mktemp(f"tinyworld-{name}")
        # another world's scenario gets that world's own base (built once and cached like tinyworld's)
        info = write_scenario(name, root, self._base if scenario_world(name).name == "tinyworld" else None)
        record = train_lora(root / "gradian.yaml", root / "run")
        # the ground truth as written, so tests read exactly what a user's tooling would
        info = json.loads((root / "scenario.json").read_text())
        return TinyworldRun(name=name, root=root, info=info, record=record)


@pytest.fixture(scope="session")
def tinyworld_run(tinyworld_base, tmp_path_factory):
    return _TinyworldRuns(tinyworld_base, tmp_path_factory)


@pytest.fixture(scope="session")
def attributed(tinyworld_run, tmp_path_factory):
    """``attributed(name) -> (run, outcome, out_dir)``: one attribution per scenario per session."""
    from gradian.attribution import run_attribution

    done: dict[str, tuple] = {}

    def attribute(name: str):
        if name not in done:
            run = tinyworld_run(name)
            out = tmp_path_factory.mktemp(f"report-{name}")
            cfg = run.config(**{"evaluation.query_signal": "contrastive"})
            outcome = run_attribution(cfg, capability="capitals", out_dir=out)
            done[name] = (run, outcome, out)
        return done[name]

    return attribute
