"""The bestiary: tinyworld's second world, on another model family.

Invented animals (what each eats, where it lives, its color, its legs) and the alphabet, learned
by a tiny ``MistralForCausalLM`` (grouped-query attention, sliding window) with its own
SentencePiece-style tokenizer and ``<user>``/``<bot>`` chat turns. Attribution methods measured on
tinyworld's Llama can be measured here too, on the same scenario format.

Public interface:

- ``generate_bestiary(seed, n_animals) -> Bestiary``, ``BESTIARY_FAMILIES``, ``Animal``;
- ``build_bestiary_tokenizer(bestiary, vocab_size) -> PreTrainedTokenizerFast`` and
  ``BESTIARY_CHAT_TEMPLATE``;
- ``BestiaryRecipe``, ``ensure_bestiary_base_model(cache_dir=None, recipe=None) -> Path``,
  ``build_bestiary_base_model``, ``load_bestiary``;
- ``BESTIARY_SCENARIOS`` and ``build_bestiary_scenario(name, bestiary)``; files are written by
  ``gradian.tinyworld.write_scenario``, as for tinyworld.
"""

from gradian.tinyworld.bestiary.base import (
    BESTIARY_SYSTEM_PROMPT,
    BestiaryRecipe,
    build_bestiary_base_model,
    ensure_bestiary_base_model,
    load_bestiary,
)
from gradian.tinyworld.bestiary.scenarios import BESTIARY_SCENARIOS, build_bestiary_scenario
from gradian.tinyworld.bestiary.tokenizer import (
    BESTIARY_CHAT_TEMPLATE,
    BESTIARY_EOS_TOKEN,
    build_bestiary_tokenizer,
)
from gradian.tinyworld.bestiary.world import BESTIARY_FAMILIES, Animal, Bestiary, generate_bestiary

__all__ = [
    "BESTIARY_CHAT_TEMPLATE",
    "BESTIARY_EOS_TOKEN",
    "BESTIARY_FAMILIES",
    "BESTIARY_SCENARIOS",
    "BESTIARY_SYSTEM_PROMPT",
    "Animal",
    "Bestiary",
    "BestiaryRecipe",
    "build_bestiary_base_model",
    "build_bestiary_scenario",
    "build_bestiary_tokenizer",
    "ensure_bestiary_base_model",
    "generate_bestiary",
    "load_bestiary",
]
