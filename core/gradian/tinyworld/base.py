"""The tinyworld base model: a tiny Llama pretrained on the world, cached by its recipe's hash.

Interface:

- ``BaseModelRecipe``: everything that decides the weights (world seed and size, vocabulary,
  model shape, pretraining schedule). ``recipe.content_hash()`` names the cache entry.
- ``ensure_tinyworld_base_model(cache_dir=None, recipe=None) -> Path``: the directory of a built
  base model, building it first when the cache has none for this recipe. Safe to call from
  several processes at once (``gradian.tinyworld.kit.ensure_cached_build``: a file lock
  serializes builds; the entry appears by an atomic rename). Any world's base is found with
  ``gradian.tinyworld.ensure_base_model(world=...)`` (``gradian.tinyworld.worlds``).
- ``build_base_model(out_dir, recipe) -> dict``: pretrain and save, unconditionally.
- ``load_tinyworld(model_dir) -> World``: the world a built base knows.

A built directory is an ordinary Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json``, the tokenizer files) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, plus
``tinyworld.json`` recording the recipe, the world, per-family accuracy and the build time.

Pretraining is a plain loop rather than ``transformers.Trainer``: it is short, and a loop with a
fixed thread count, seeded generator and no dataloader workers is bit-identical from run to run.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gradian.errors import ConfigError, ModelLoadError
from gradian.tinyworld.kit import (
    INFO_FILE,
    encode_chat,
    ensure_cached_build,
    evaluate_families,
    library_versions,
    pretrain,
    read_info,
    system_prompted,
    torch_settings,
    weights_sha256,
    write_json,
)
from gradian.tinyworld.world import BASE_FAMILIES, World, generate_world
from gradian.transformers_compat import save_tokenizer

__all__ = ["BaseModelRecipe", "build_base_model", "ensure_tinyworld_base_model", "load_tinyworld", "pretraining_messages"]

#: system prompt put on a share of pretraining rows so the model is at ease with one or none
SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class BaseModelRecipe:
    """Everything that decides the base model's weights. Changing any field changes the hash."""

    seed: int = 0
    n_countries: int = 40
    #: families pretrained on and checked at the end (``refusal``: places that do not exist)
    families: tuple[str, ...] = BASE_FAMILIES
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 512
    #: passes over the pretraining rows
    epochs: int = 36
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    #: every n-th pretraining row carries a system prompt
    system_prompt_every: int = 4
    #: torch intra-op threads during the build; part of the recipe because float sums may
    #: reduce in a different order with a different thread count. One thread: the matrices are
    #: tiny, and on a busy two-core machine two spinning OpenMP threads made builds 3-4x slower
    num_threads: int = 1
    #: bump when the build code changes what a recipe produces
    version: int = 3

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["families"] = list(self.families)
        return data

    def content_hash(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def world(self) -> World:
        return generate_world(self.seed, self.n_countries)


def load_tinyworld(model_dir: str | Path) -> World:
    """The world a built tinyworld base model was pretrained on, read from its ``tinyworld.json``."""
    recipe = read_info(Path(model_dir))["recipe"]
    return generate_world(recipe["seed"], recipe["n_countries"])


def pretraining_messages(world: World, recipe: BaseModelRecipe) -> list[list[dict[str, str]]]:
    """The pretraining rows, as chat messages, in a fixed order (shuffled per epoch later)."""
    items = [item for family in recipe.families for item in world.fact_items(family)]
    items += world.paragraph_items()
    return system_prompted(items, random.Random(recipe.seed), SYSTEM_PROMPT, recipe.system_prompt_every)


# -- building --------------------------------------------------------------------------------


def ensure_tinyworld_base_model(cache_dir: str | Path | None = None, recipe: BaseModelRecipe | None = None, *,
                                verbose: bool = False) -> Path:
    """The cached tinyworld base model for ``recipe`` (the default when ``None``), built first when missing."""
    recipe = recipe or BaseModelRecipe()
    if not isinstance(recipe, BaseModelRecipe):
        raise ConfigError(f"world 'tinyworld' takes a BaseModelRecipe, not {type(recipe).__name__}")
    return ensure_cached_build(cache_dir, recipe.content_hash(),
                               lambda staging: build_base_model(staging, recipe, verbose=verbose))


def build_base_model(out_dir: str | Path, recipe: BaseModelRecipe | None = None, *,
                     min_accuracy: float | None = 0.95, verbose: bool = False) -> dict[str, object]:
    """Pretrain a base model from ``recipe`` and save it to ``out_dir``; returns its info.

    Raises ``ModelLoadError`` when a family ends below ``min_accuracy`` (``None`` skips the
    check, for reduced recipes in tests): a base model that does not know its facts has no
    capability for a fine-tune to lose.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradian.tinyworld.tokenizer import build_tokenizer

    recipe = recipe or BaseModelRecipe()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    world = recipe.world()
    tokenizer = build_tokenizer(world, recipe.vocab_size)

    with torch_settings(recipe.num_threads):
        torch.manual_seed(recipe.seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=recipe.hidden_size,
            intermediate_size=recipe.intermediate_size,
            num_hidden_layers=recipe.num_hidden_layers,
            num_attention_heads=recipe.num_attention_heads,
            num_key_value_heads=recipe.num_attention_heads,
            max_position_embeddings=recipe.max_position_embeddings,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            attention_dropout=0.0,
            initializer_range=0.02,
        )
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config)
        rows = [encode_chat(tokenizer, m) for m in pretraining_messages(world, recipe)]
        losses = pretrain(model, rows, recipe, tokenizer.pad_token_id, verbose=verbose)
        model.eval()
        accuracy = evaluate_families(model, tokenizer, world, recipe.families)

    seconds = time.perf_counter() - started
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)  # loadable by transformers 4.x and 5.x alike
    info: dict[str, object] = {
        "recipe": recipe.to_dict(),
        "recipe_hash": recipe.content_hash(),
        "world": {
            "seed": world.seed,
            "countries": [asdict(c) for c in world.countries],
        },
        "accuracy": accuracy,
        "final_loss": losses[-1] if losses else None,
        "build_seconds": round(seconds, 2),
        "weights_sha256": weights_sha256(out),
        "versions": library_versions(),
    }
    write_json(out / INFO_FILE, info)
    if min_accuracy is not None:
        low = {f: a for f, a in accuracy.items() if a < min_accuracy}
        if low:
            raise ModelLoadError(
                f"tinyworld base model {recipe.content_hash()} learned too little: {low} is below "
                f"{min_accuracy:.0%} exact match; raise BaseModelRecipe.epochs or the model size"
            )
    return info


# -- evaluation ------------------------------------------------------------------------------


# -- files -----------------------------------------------------------------------------------


