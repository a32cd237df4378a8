"""The bestiary base model: a tiny Mistral pretrained on the bestiary, cached by its recipe's hash.

Interface:

- ``BestiaryRecipe``: everything that decides the weights; ``content_hash()`` names the cache
  entry ``base-bestiary-<hash>``, beside tinyworld's entries in the same cache directory.
- ``ensure_bestiary_base_model(cache_dir=None, recipe=None) -> Path``: the built model, built
  first when missing (file lock and atomic rename, as for tinyworld).
- ``build_bestiary_base_model(out_dir, recipe) -> dict``: pretrain and save, unconditionally.
- ``load_bestiary(model_dir) -> Bestiary``: the facts a built model was taught.

The model is a ``MistralForCausalLM``: grouped-query attention (two key/value heads shared by six
query heads), a sliding attention window, untied input and output embeddings, three layers, and a
different width from tinyworld's Llama, so an attribution method measured on both worlds meets two
model families. Pretraining reuses tinyworld's loop (seeded, one thread, deterministic kernels),
so a recipe builds bit-identical weights on the same machine. The directory is an ordinary Hugging
Face model folder plus ``tinyworld.json``, whose ``world_name`` is ``bestiary``.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gradian.errors import ConfigError
from gradian.tinyworld.bestiary.world import BESTIARY_FAMILIES, Bestiary, generate_bestiary
from gradian.tinyworld.kit import (
    WorldRecipe,
    encode_chat,
    ensure_cached_build,
    evaluate_families,
    load_recorded_world,
    pretrain,
    save_base_model,
    system_prompted,
    torch_settings,
)

__all__ = [
    "BESTIARY_SYSTEM_PROMPT",
    "BestiaryRecipe",
    "bestiary_pretraining_messages",
    "build_bestiary_base_model",
    "ensure_bestiary_base_model",
    "load_bestiary",
]

#: system prompt put on a share of pretraining rows (and of scenario rows)
BESTIARY_SYSTEM_PROMPT = "You are a careful naturalist."
WORLD_NAME = "bestiary"


@dataclass(frozen=True)
class BestiaryRecipe(WorldRecipe):
    """Everything that decides the bestiary base model's weights (its identity: ``WorldRecipe``)."""

    world_name = WORLD_NAME

    seed: int = 0
    n_animals: int = 40
    families: tuple[str, ...] = BESTIARY_FAMILIES
    vocab_size: int = 768
    hidden_size: int = 144
    intermediate_size: int = 320
    num_hidden_layers: int = 3
    num_attention_heads: int = 6
    #: grouped-query attention: each key/value head serves three query heads
    num_key_value_heads: int = 2
    #: attention sees at most this many previous tokens: a question and a short answer fit in
    #: it, a paragraph (up to 53 tokens) does not, so the window really masks during training
    sliding_window: int = 32
    max_position_embeddings: int = 512
    #: passes over the pretraining rows (every family is at 100% well before the last)
    epochs: int = 28
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    system_prompt_every: int = 4
    #: torch intra-op threads during the build (see tinyworld's BaseModelRecipe)
    num_threads: int = 1
    version: int = 1

    def world(self) -> Bestiary:
        return generate_bestiary(self.seed, self.n_animals)


def load_bestiary(model_dir: str | Path) -> Bestiary:
    """The bestiary a built base model was pretrained on, read from its ``tinyworld.json``."""
    return load_recorded_world(model_dir, WORLD_NAME, generate_bestiary, "n_animals")


def bestiary_pretraining_messages(bestiary: Bestiary, recipe: BestiaryRecipe) -> list[list[dict[str, str]]]:
    """The pretraining rows as chat messages, in a fixed order (shuffled per epoch later)."""
    items = [item for family in recipe.families for item in bestiary.fact_items(family)]
    items += bestiary.paragraph_items()
    return system_prompted(items, random.Random(f"bestiary:{recipe.seed}:system"), BESTIARY_SYSTEM_PROMPT,
                           recipe.system_prompt_every)


def ensure_bestiary_base_model(cache_dir: str | Path | None = None, recipe: BestiaryRecipe | None = None,
                               *, verbose: bool = False) -> Path:
    """Return the cached bestiary base model for ``recipe``, building it first when missing."""
    recipe = recipe or BestiaryRecipe()
    if not isinstance(recipe, BestiaryRecipe):
        raise ConfigError(f"world 'bestiary' takes a BestiaryRecipe, not {type(recipe).__name__}")
    return ensure_cached_build(cache_dir, recipe.cache_key(),
                               lambda staging: build_bestiary_base_model(staging, recipe, verbose=verbose))


def build_bestiary_base_model(out_dir: str | Path, recipe: BestiaryRecipe | None = None, *,
                              min_accuracy: float | None = 0.95, verbose: bool = False) -> dict[str, object]:
    """Pretrain a bestiary base model from ``recipe`` and save it to ``out_dir``; returns its info.

    Raises ``ModelLoadError`` when a family ends below ``min_accuracy`` (``None`` skips the check).
    """
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from gradian.tinyworld.bestiary.tokenizer import build_bestiary_tokenizer

    recipe = recipe or BestiaryRecipe()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    bestiary = recipe.world()
    tokenizer = build_bestiary_tokenizer(bestiary, recipe.vocab_size)

    with torch_settings(recipe.num_threads):
        torch.manual_seed(recipe.seed)
        config = MistralConfig(
            vocab_size=len(tokenizer),
            hidden_size=recipe.hidden_size,
            intermediate_size=recipe.intermediate_size,
            num_hidden_layers=recipe.num_hidden_layers,
            num_attention_heads=recipe.num_attention_heads,
            num_key_value_heads=recipe.num_key_value_heads,
            head_dim=recipe.hidden_size // recipe.num_attention_heads,
            sliding_window=recipe.sliding_window,
            max_position_embeddings=recipe.max_position_embeddings,
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            attention_dropout=0.0,
            initializer_range=0.02,
        )
        config._attn_implementation = "eager"
        model = MistralForCausalLM(config)
        rows = [encode_chat(tokenizer, m) for m in bestiary_pretraining_messages(bestiary, recipe)]
        losses = pretrain(model, rows, recipe, tokenizer.pad_token_id, verbose=verbose,
                           label="bestiary")
        model.eval()
        accuracy = evaluate_families(model, tokenizer, bestiary, recipe.families)

    world = {"seed": bestiary.seed, "animals": [asdict(a) for a in bestiary.animals]}
    return save_base_model(out, model, tokenizer, recipe, world=world, accuracy=accuracy, losses=losses,
                           seconds=time.perf_counter() - started, min_accuracy=min_accuracy)
