"""Fixtures for the bestiary (tinyworld's second world, on a tiny Mistral).

- ``bestiary_base``: path of the built bestiary base model (session scope), built once and cached
  by its recipe's hash beside tinyworld's entries (``$GRADIAN_TINYWORLD_CACHE``, default
  ``~/.cache/gradian/tinyworld``); concurrent workers wait on the build's file lock.
- ``bestiary_world``: the ``Bestiary`` the base model knows (cheap, no model).
- ``bestiary_tokenizer``: the base model's tokenizer, built in memory from the bestiary (about a
  second, no training), encoding exactly like the saved one.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bestiary_world():
    from gradian.tinyworld.bestiary import BestiaryRecipe

    return BestiaryRecipe().world()


@pytest.fixture(scope="session")
def bestiary_tokenizer(bestiary_world):
    from gradian.tinyworld.bestiary import BestiaryRecipe, build_bestiary_tokenizer

    return build_bestiary_tokenizer(bestiary_world, BestiaryRecipe().vocab_size)


@pytest.fixture(scope="session")
def bestiary_base() -> Path:
    from gradian.tinyworld import ensure_base_model

    return ensure_base_model(world="bestiary")
