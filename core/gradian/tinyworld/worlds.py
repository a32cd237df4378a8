"""The registry of offline worlds: the only list of world names.

Interface: ``WORLDS`` (name -> ``WorldSpec``), ``get_world(name)``, ``scenario_world(scenario)``
(the world a scenario name belongs to) and ``world_of_model(model_dir)`` (the world a built base
model was pretrained on, read from its ``tinyworld.json``); across every world,
``ensure_base_model(cache_dir, recipe, world=...)``, ``load_world(model_dir)``,
``all_scenarios()`` and ``write_scenario(name, out_dir, base_model, shape)``.

Three worlds are registered, so attribution methods can be measured on three model families:

- ``tinyworld``: invented countries (capitals, languages, continents, currencies) and sums, on a
  two-layer Llama with a byte-level BPE and ``<|role|>...<|end|>`` turns;
- ``bestiary``: invented animals (diets, habitats, colors, legs) and the alphabet, on a
  three-layer Mistral (grouped-query attention, sliding window) with a SentencePiece-style BPE
  with byte fallback and ``<user>...</turn>`` turns;
- ``delta``: invented rivers (the sea each flows into, asked three ways; sources, lengths, towns,
  aliases) and products, on a two-layer Qwen2 (biases on q/k/v) with a byte-level BPE laid out
  like Qwen2's and ChatML turns; its poisons are redundant or aimed at part of the capability.

All stand on one kit (``gradian.tinyworld.kit``, ``gradian.tinyworld.scenario_kit``) and write
scenarios in one on-disk format (``write_scenario`` here); scenario names are unique across
worlds. This module is the only one that knows them all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gradian.errors import ConfigError
from gradian.tinyworld.base import BaseModelRecipe, ensure_tinyworld_base_model, load_tinyworld
from gradian.tinyworld.bestiary.base import BestiaryRecipe, ensure_bestiary_base_model, load_bestiary
from gradian.tinyworld.bestiary.scenarios import BESTIARY_SCENARIOS, build_bestiary_scenario
from gradian.tinyworld.bestiary.world import BESTIARY_FAMILIES, Bestiary
from gradian.tinyworld.delta.base import DeltaRecipe, ensure_delta_base_model, load_delta
from gradian.tinyworld.delta.scenarios import DELTA_SCENARIOS, build_delta_scenario
from gradian.tinyworld.delta.world import DELTA_FAMILIES, Delta
from gradian.tinyworld.kit import read_info
from gradian.tinyworld.scenario_kit import AUDIT_THRESHOLDS, BASELINE_TRAIN, CLEAN_CLUSTER, PLANTED_CLUSTER, ROW_SHAPES, Scenario, shape_row
from gradian.tinyworld.scenarios import SCENARIOS, build_scenario
from gradian.tinyworld.world import BASE_FAMILIES, World

__all__ = ["WORLDS", "WorldSpec", "all_scenarios", "ensure_base_model", "get_world", "load_world", "scenario_world",
           "world_of_model", "write_scenario"]


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
    load_world: Callable[[Path], World | Bestiary | Delta]
    #: scenario name -> one-line description
    scenarios: dict[str, str]
    #: ``(name, world, tokenizer=None) -> Scenario``
    build_scenario: Callable[..., Scenario]
    #: the world's recipe dataclass (its default builds the cached base)
    recipe_type: type


def _tinyworld() -> WorldSpec:
    return WorldSpec(
        name="tinyworld",
        description="Invented countries and sums on a 2-layer Llama (byte-level BPE, <|role|> turns)",
        architecture="llama",
        families=BASE_FAMILIES,
        ensure_base_model=ensure_tinyworld_base_model,
        load_world=load_tinyworld,
        scenarios=SCENARIOS,
        build_scenario=build_scenario,
        recipe_type=BaseModelRecipe,
    )


def _bestiary() -> WorldSpec:
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


def _delta() -> WorldSpec:
    return WorldSpec(
        name="delta",
        description="Invented rivers and products on a 2-layer Qwen2 (q/k/v biases, GQA; "
                    "Qwen2-style byte-level BPE, ChatML turns)",
        architecture="qwen2",
        families=DELTA_FAMILIES,
        ensure_base_model=ensure_delta_base_model,
        load_world=load_delta,
        scenarios=DELTA_SCENARIOS,
        build_scenario=build_delta_scenario,
        recipe_type=DeltaRecipe,
    )


WORLDS: dict[str, WorldSpec] = {spec.name: spec for spec in (_tinyworld(), _bestiary(), _delta())}


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
    return read_info(Path(model_dir)).get("world_name", "tinyworld")


def ensure_base_model(cache_dir: str | Path | None = None,
                      recipe: BaseModelRecipe | BestiaryRecipe | DeltaRecipe | None = None, *, verbose: bool = False,
                      world: str = "tinyworld") -> Path:
    """The cached base model of ``world`` for ``recipe`` (that world's recipe type, its default
    when ``None``), built first when missing."""
    return get_world(world).ensure_base_model(cache_dir, recipe, verbose=verbose)


def load_world(model_dir: str | Path) -> World | Bestiary | Delta:
    """The world a built base model was pretrained on (a ``World``, a ``Bestiary``, a ``Delta``)."""
    return get_world(world_of_model(model_dir)).load_world(Path(model_dir))


def all_scenarios() -> dict[str, str]:
    """Every scenario of every world, name -> description (names are unique across worlds)."""
    return {name: text for spec in WORLDS.values() for name, text in spec.scenarios.items()}


def write_scenario(name: str, out_dir: str | Path, base_model: str | Path | None = None, *,
                   shape: str = "messages") -> dict[str, Any]:
    """Write a scenario's files to ``out_dir`` and return what ``scenario.json`` holds.

    ``name`` may belong to any world of ``gradian.tinyworld.worlds.WORLDS`` (``poison_capitals``
    is tinyworld's, ``bestiary_poison_diets`` the bestiary's, ``delta_poison_redundant`` the
    delta's). ``base_model`` is a built base
    model directory of that world; by default the cached one for the world's default recipe
    (built first when missing, one to two minutes). Paths in ``gradian.yaml`` are absolute, so
    commands can run from any directory.
    """
    import yaml

    from gradian.atomic import write_text_atomic

    if shape not in ROW_SHAPES:
        raise ConfigError(f"unknown row shape '{shape}' (--shape); choose one of {', '.join(ROW_SHAPES)}")
    spec = scenario_world(name)
    base = Path(base_model) if base_model is not None else spec.ensure_base_model()
    base = base.resolve()
    if world_of_model(base) != spec.name:
        raise ConfigError(
            f"scenario '{name}' belongs to the {spec.name} world, but {base} is a "
            f"{world_of_model(base)} base model; pass a {spec.name} base (--base-model) or none"
        )
    world = spec.load_world(base)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    s = spec.build_scenario(name, world, tokenizer)

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_lines = [json.dumps({**shape_row(m, shape), "cluster": c}, ensure_ascii=False)
                   for m, c in s.train]
    eval_lines = [json.dumps(shape_row(m, shape), ensure_ascii=False) for m in s.eval]
    write_text_atomic(out / "train.jsonl", "\n".join(train_lines) + "\n")
    write_text_atomic(out / "eval.jsonl", "\n".join(eval_lines) + "\n")

    train_section = {**BASELINE_TRAIN, **s.train_overrides, "output_dir": str(out / "run")}
    config = {
        "seed": world.seed,
        "base_model": str(base),
        "dataset": str(out / "train.jsonl"),
        "eval_dataset": str(out / "eval.jsonl"),
        "run": str(out / "run"),
        "adapter_path": str(out / "run" / "adapter"),
        "evaluation": {"metric": s.capability["metric"], "max_new_tokens": 16},
        "clustering": {"method": "declared"},
        "audit": dict(AUDIT_THRESHOLDS),
        "train": train_section,
    }
    header = (f"# {s.world} scenario '{name}': {s.description}\n"
              f"# Train with: gradian train --config {out / 'gradian.yaml'} --out {out / 'run'}\n")
    write_text_atomic(out / "gradian.yaml", header + yaml.safe_dump(config, sort_keys=False))

    info = {
        "name": name,
        "description": s.description,
        "kind": s.kind,
        "seed": world.seed,
        "base_model": str(base),
        "shape": shape,
        "n_train": len(s.train),
        "capability": s.capability,
        "planted": {
            "cluster": PLANTED_CLUSTER,
            "n": len(s.planted_indices),
            "indices": s.planted_indices,
            "duplicate_indices": s.duplicate_indices,
        } if s.planted_indices else None,
        "clean_cluster": CLEAN_CLUSTER,
        "defect": {f"train.{k}": v for k, v in s.train_overrides.items()} or None,
        "baseline_train": BASELINE_TRAIN,
        "audit_thresholds": AUDIT_THRESHOLDS,
        "expected_findings": s.expected_findings,
        "truth": s.truth,
        "files": {"train": "train.jsonl", "eval": "eval.jsonl", "config": "gradian.yaml",
                  "run": "run"},
        "world": s.world,
        "ontopic": {"family": s.ontopic_family, "n": len(s.ontopic_indices),
                    "indices": s.ontopic_indices},
        "same_entity": {"n": len(s.same_entity_indices), "indices": s.same_entity_indices},
    }
    write_text_atomic(out / "scenario.json", json.dumps(info, indent=2) + "\n")
    return info
