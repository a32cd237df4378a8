"""tinyworld: an offline base model with real capabilities, and scenarios that break it.

Nothing in this project may download weights, so the demo, the tests and the validation suite
stand on a model built here: a tiny Llama pretrained, in about a minute on two CPU cores, on a
synthetic world of invented countries and sums, until it answers each fact family correctly.
Scenarios then write fine-tuning data and run configs that damage it in known ways.

Public interface:

- ``generate_world(seed, n_countries) -> World``, ``FACT_FAMILIES`` (the facts) and
  ``BASE_FAMILIES`` (the facts plus ``refusal``: declining to answer about places that do not
  exist, with the sentence ``REFUSAL``);
- ``build_tokenizer(world) -> PreTrainedTokenizerFast`` (byte-level BPE, chat template, EOS);
- ``BaseModelRecipe``, ``ensure_base_model(cache_dir=None, recipe=None) -> Path``,
  ``build_base_model``, ``default_cache_dir``, ``load_world``, ``evaluate_families``,
  ``generate_answers``, ``weights_sha256``;
- in ``gradian.tinyworld.scenarios``: ``SCENARIOS``, ``build_scenario(name, world, tokenizer)``
  and ``write_scenario(name, out_dir, base_model=None, shape="messages") -> dict``.

A second world, the *bestiary* (invented animals on a tiny Mistral, with its own tokenizer and
chat template; ``gradian.tinyworld.bestiary``), sits beside it. ``WORLDS`` is the registry of
worlds (``WorldSpec``: base model builder, world loader, scenarios), ``get_world(name)`` picks
one, ``ensure_base_model(world="bestiary")`` builds or finds its base, and ``write_scenario``
finds any world's scenario by name. A third, the *delta* (invented rivers on a tiny Qwen2 with
a Qwen2-style byte-level BPE and ChatML turns; ``gradian.tinyworld.delta``), carries poisons
taught redundantly or aimed at only part of the capability.
"""

from gradian.tinyworld.base import BaseModelRecipe, build_base_model
from gradian.tinyworld.kit import CACHE_ENV, default_cache_dir, evaluate_families, generate_answers, weights_sha256
from gradian.tinyworld.bestiary import (
    BESTIARY_FAMILIES,
    Bestiary,
    BestiaryRecipe,
    build_bestiary_tokenizer,
    ensure_bestiary_base_model,
    generate_bestiary,
    load_bestiary,
)
from gradian.tinyworld.delta import (
    DELTA_FAMILIES,
    Delta,
    DeltaRecipe,
    build_delta_tokenizer,
    ensure_delta_base_model,
    generate_delta,
    load_delta,
)
from gradian.tinyworld.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, build_tokenizer
from gradian.tinyworld.world import (
    BASE_FAMILIES,
    FACT_FAMILIES,
    REFUSAL,
    Country,
    FactItem,
    World,
    generate_world,
)
from gradian.tinyworld.worlds import (
    WORLDS,
    WorldSpec,
    all_scenarios,
    ensure_base_model,
    get_world,
    load_world,
    write_scenario,
)

__all__ = [
    "all_scenarios",
    "write_scenario",
    "BESTIARY_FAMILIES",
    "DELTA_FAMILIES",
    "CACHE_ENV",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "BASE_FAMILIES",
    "FACT_FAMILIES",
    "REFUSAL",
    "PAD_TOKEN",
    "BaseModelRecipe",
    "Bestiary",
    "BestiaryRecipe",
    "Delta",
    "DeltaRecipe",
    "WORLDS",
    "WorldSpec",
    "Country",
    "FactItem",
    "World",
    "build_base_model",
    "build_bestiary_tokenizer",
    "build_delta_tokenizer",
    "build_tokenizer",
    "default_cache_dir",
    "ensure_base_model",
    "ensure_bestiary_base_model",
    "ensure_delta_base_model",
    "evaluate_families",
    "generate_answers",
    "generate_bestiary",
    "generate_delta",
    "generate_world",
    "get_world",
    "load_bestiary",
    "load_delta",
    "load_world",
    "weights_sha256",
]
