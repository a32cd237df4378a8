"""The registry of offline worlds: the only list of world names.

Interface: ``WORLDS`` (name -> ``WorldSpec``), ``get_world(name)``, ``scenario_world(scenario)``
(the world a scenario name belongs to) and ``world_of_model(model_dir)`` (the world a built base
model was pretrained on, read from its ``tinyworld.json``).

Two worlds are registered, so attribution methods can be measured on two model families:

- ``tinyworld``: invented countries (capitals, languages, continents, currencies) and sums, on a
  two-layer Llama with a byte-level BPE and ``<|role|>...<|end|>`` turns;
- ``bestiary``: invented animals (diets, habitats, colors, legs) and the alphabet, on a
  three-layer Mistral (grouped-query attention, sliding window) with a SentencePiece-style BPE
  with byte fallback and ``<user>...</turn>`` turns.

Both write scenarios in one on-disk format (``gradian.tinyworld.scenarios.write_scenario``), and
scenario names are unique across worlds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gradian.errors import ConfigError

__all__ = ["WORLDS", "WorldSpec", "get_world", "scenario_world", "world_of_model"]


@dataclass(frozen=True)
class WorldSpec:
    """One offline world: its base model, its facts and its scenarios."""

    name: str
    #: one line for ``gradian tinyworld worlds`` and the docs
    description: str
    #: ``model_type`` of the base model's config
    architecture: str
    #: the fact families the base is pretrained on and checked against, in report order
    families: tuple[str, ...]
    #: ``(cache_dir=None, recipe=None, *, verbose=False) -> Path``
    ensure_base_model: Callable[..., Path]
    #: the world a built base model knows, from its directory
    load_world: Callable[[Path], Any]
    #: scenario name -> one-line description
    scenarios: dict[str, str]
    #: ``(name, world, tokenizer=None) -> Scenario``
    build_scenario: Callable[..., Any]
    #: the world's recipe dataclass (its default builds the cached base)
    recipe_type: type


def _tinyworld() -> WorldSpec:
    from gradian.tinyworld.base import BaseModelRecipe, ensure_base_model, load_world
    from gradian.tinyworld.scenarios import SCENARIOS, build_scenario
    from gradian.tinyworld.world import BASE_FAMILIES

    return WorldSpec(
        name="tinyworld",
        description="Invented countries and sums on a 2-layer Llama (byte-level BPE, <|role|> turns)",
        architecture="llama",
        families=BASE_FAMILIES,
        ensure_base_model=ensure_base_model,
        load_world=load_world,
        scenarios=SCENARIOS,
        build_scenario=build_scenario,
        recipe_type=BaseModelRecipe,
    )


def _bestiary() -> WorldSpec:
    from gradian.tinyworld.bestiary.base import BestiaryRecipe, ensure_bestiary_base_model, load_bestiary
    from gradian.tinyworld.bestiary.scenarios import BESTIARY_SCENARIOS, build_bestiary_scenario
    from gradian.tinyworld.bestiary.world import BESTIARY_FAMILIES

    return WorldSpec(
        name="bestiary",
        description="Invented animals and the alphabet on a 3-layer Mistral (GQA, sliding window; "
                    "SentencePiece-style BPE, <user>/<bot> turns)",
        architecture="mistral",
        families=BESTIARY_FAMILIES,
        ensure_base_model=ensure_bestiary_base_model,
        load_world=load_bestiary,
        scenarios=BESTIARY_SCENARIOS,
        build_scenario=build_bestiary_scenario,
        recipe_type=BestiaryRecipe,
    )


WORLDS: dict[str, WorldSpec] = {spec.name: spec for spec in (_tinyworld(), _bestiary())}


def get_world(name: str) -> WorldSpec:
    if name not in WORLDS:
        raise ConfigError(f"unknown world '{name}' (--world); choose one of {', '.join(WORLDS)}")
    return WORLDS[name]


def scenario_world(scenario: str) -> WorldSpec:
    """The world whose scenarios include ``scenario``."""
    for spec in WORLDS.values():
        if scenario in spec.scenarios:
            return spec
    names = ", ".join(n for spec in WORLDS.values() for n in spec.scenarios)
    raise ConfigError(f"unknown tinyworld scenario '{scenario}'; choose one of {names}")


def world_of_model(model_dir: str | Path) -> str:
    """The world a built base model directory belongs to (``tinyworld`` when unrecorded)."""
    from gradian.tinyworld.base import _read_info

    return _read_info(Path(model_dir)).get("world_name", "tinyworld")
