"""The small chat tokenizer of the data-layer tests (defined once, in projects/benchmarks/chat_tokenizer.py,
beside the benchmarks that also use it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SOURCE = Path(__file__).resolve().parents[2] / "projects" / "benchmarks" / "chat_tokenizer.py"
_spec = importlib.util.spec_from_file_location("gradian_benchmarks_chat_tokenizer", _SOURCE)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
CHAT_TEMPLATE = _module.CHAT_TEMPLATE
build_chat_tokenizer = _module.build_chat_tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_chat_tokenizer(True)


@pytest.fixture(scope="session")
def plain_tokenizer():
    return build_chat_tokenizer(False)
