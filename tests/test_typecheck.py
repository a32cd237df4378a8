"""The typed core type-checks: mypy over the modules listed in pyproject.toml's [tool.mypy] is clean.

The list and the settings live in pyproject.toml only, so ``python -m mypy`` at the repository
root checks exactly what this test checks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_typed_core_is_clean():
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    # "No module named mypy": it comes with the dev extra (pip install -e '.[dev]')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found"), proc.stdout
