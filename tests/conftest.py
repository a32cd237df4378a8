"""Shared test set-up. Fixture modules live in tests/plugins/, one per stage."""

from __future__ import annotations

import os

# nothing in the suite may reach a hub; fail fast instead of hanging on a download
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    "tests.plugins.tinyworld_fixtures",
]
