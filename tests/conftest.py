"""Shared test set-up. Fixture modules live in tests/plugins/, one per stage."""

from __future__ import annotations

import os
from pathlib import Path

# nothing in the suite may reach a hub; fail fast instead of hanging on a download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_PLUGINS = Path(__file__).parent / "plugins"
pytest_plugins = [
    f"tests.plugins.{p.stem}" for p in sorted(_PLUGINS.glob("*.py")) if p.stem != "__init__"
]
