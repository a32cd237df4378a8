"""Fixtures for the tinyworld base model, shared by every stage's tests.

- ``tinyworld_base``: path of the built base model directory (session scope). Built once and
  cached on disk by the recipe's content hash under ``$GRADIAN_TINYWORLD_CACHE`` (default
  ``~/.cache/gradian/tinyworld``), so later sessions only load it. Concurrent pytest workers
  wait on a file lock instead of building twice.
- ``tinyworld_world``: the ``World`` the base model knows (cheap, no model).
- ``tinyworld_tokenizer``: the base model's tokenizer, built in memory from the world (well
  under a second, no model training). It encodes exactly like the one saved with the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tinyworld_world():
    from gradian.tinyworld import BaseModelRecipe

    return BaseModelRecipe().world()


@pytest.fixture(scope="session")
def tinyworld_tokenizer(tinyworld_world):
    from gradian.tinyworld import BaseModelRecipe, build_tokenizer

    return build_tokenizer(tinyworld_world, BaseModelRecipe().vocab_size)


@pytest.fixture(scope="session")
def tinyworld_base() -> Path:
    from gradian.tinyworld import ensure_base_model

    return ensure_base_model()
