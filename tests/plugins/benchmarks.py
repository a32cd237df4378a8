"""Import a script of ``projects/benchmarks`` (not a package) from a test, leaving ``sys.path`` as it was."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "projects" / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    """``projects/benchmarks/<name>.py`` as a module (its sibling imports resolve while it loads)."""
    before = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = before
