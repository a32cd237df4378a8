"""The engine never imports mlflow (nor trainer-side libraries it does not need)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import gradian

FORBIDDEN = ("mlflow", "trl", "unsloth", "bitsandbytes", "xformers")


def test_no_module_under_gradian_imports_forbidden_packages():
    # every module but the `python -m gradian` script, which runs the CLI when imported
    names = [m.name for m in pkgutil.walk_packages(gradian.__path__, prefix="gradian.") if not m.name.endswith("__main__")]
    assert "gradian.config" in names and "gradian.data" in names
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
