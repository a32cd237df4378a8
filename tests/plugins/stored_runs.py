"""Fine-tunes stored in the repository, for tests that must see the same fine-tune on every machine.

A fine-tune is not repeatable across CPU kinds (nor across training seeds), so a test that pins
the numbers or the accused rows of one attribution reads its fine-tune from ``tests/golden/<name>/
inputs`` instead of training it: the base model's files, the scenario's files and the run folder,
with the folder they were written in replaced by a marker.

- ``freeze_run(run, base, dest)``: copy a ``TinyworldRun`` and its base model into ``dest``.
- ``thaw_run(src, where) -> Path``: the stored fine-tune written under ``where``, paths pointing there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT_MARK = "@SCENARIO@"
_TEXT = (".json", ".yaml", ".md", ".jsonl")


def freeze_run(run: Any, base: Path, dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(run.root, dest, ignore=shutil.ignore_patterns(".gradian", "report*"))
    shutil.copytree(base, dest / "base")
    for path in dest.rglob("*"):
        if path.is_file() and path.suffix in _TEXT:
            text = path.read_text(encoding="utf-8")
            path.write_text(text.replace(str(base), f"{ROOT_MARK}/base").replace(str(run.root), ROOT_MARK),
                            encoding="utf-8")


def thaw_run(src: Path, where: Path) -> Path:
    shutil.copytree(src, where)
    for path in where.rglob("*"):
        if path.is_file() and path.suffix in _TEXT:
            path.write_text(path.read_text(encoding="utf-8").replace(ROOT_MARK, str(where)), encoding="utf-8")
    return where
