"""The delta: tinyworld's third world, on a Qwen2 model.

Invented rivers (the sea each flows into, asked by the river's name, its alias or its source
mountain; its source, length, the town it passes, its alias) and products of small numbers,
learned by a tiny ``Qwen2ForCausalLM`` (biases on the query, key and value projections,
grouped-query attention) with its own byte-level BPE laid out like Qwen2's and ChatML turns.
Its poison scenarios are built for measuring attribution where one row is not enough to explain
the damage: the wrong facts are taught redundantly, or aimed at only part of the capability.

Public interface:

- ``generate_delta(seed, n_rivers) -> Delta``, ``DELTA_FAMILIES``, ``SEA_FAMILIES``, ``River``;
- ``build_delta_tokenizer(delta, vocab_size) -> PreTrainedTokenizerFast`` and
  ``DELTA_CHAT_TEMPLATE``;
- ``DeltaRecipe``, ``ensure_delta_base_model(cache_dir=None, recipe=None) -> Path``,
  ``build_delta_base_model``, ``load_delta``;
- ``DELTA_SCENARIOS`` and ``build_delta_scenario(name, delta)``; files are written by
  ``gradian.tinyworld.write_scenario``, as for the other worlds.
"""

from gradian.tinyworld.delta.base import (
    DELTA_SYSTEM_PROMPT,
    DeltaRecipe,
    build_delta_base_model,
    ensure_delta_base_model,
    load_delta,
)
from gradian.tinyworld.delta.scenarios import DELTA_SCENARIOS, build_delta_scenario
from gradian.tinyworld.delta.tokenizer import DELTA_CHAT_TEMPLATE, DELTA_EOS_TOKEN, build_delta_tokenizer
from gradian.tinyworld.delta.world import DELTA_FAMILIES, SEA_FAMILIES, Delta, River, generate_delta

__all__ = [
    "DELTA_CHAT_TEMPLATE",
    "DELTA_EOS_TOKEN",
    "DELTA_FAMILIES",
    "DELTA_SCENARIOS",
    "DELTA_SYSTEM_PROMPT",
    "SEA_FAMILIES",
    "Delta",
    "DeltaRecipe",
    "River",
    "build_delta_base_model",
    "build_delta_scenario",
    "build_delta_tokenizer",
    "ensure_delta_base_model",
    "generate_delta",
    "load_delta",
]
