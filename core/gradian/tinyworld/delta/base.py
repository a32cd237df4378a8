"""The delta base model: a tiny Qwen2 pretrained on the delta world, cached by its recipe's hash.

Interface:

- ``DeltaRecipe``: everything that decides the weights; ``cache_key()`` names the cache entry
  ``base-delta-<hash>``, beside the other worlds' entries in the same cache directory.
- ``ensure_delta_base_model(cache_dir=None, recipe=None) -> Path``: the built model, built first
  when missing (file lock and atomic rename, as for the other worlds).
- ``build_delta_base_model(out_dir, recipe) -> dict``: pretrain and save, unconditionally.
- ``load_delta(model_dir) -> Delta``: the facts a built model was taught.

The model is a ``Qwen2ForCausalLM``: biases on the query, key and value projections (the one
architectural trait Qwen2 adds to a Llama block), grouped-query attention (two key/value heads
for four query heads), tied input and output embeddings, two layers and a width of 160. Its
tokenizer is a byte-level BPE laid out like Qwen2's and its chat format is ChatML
(``gradian.tinyworld.delta.tokenizer``). Pretraining reuses the kit's loop (seeded, one thread,
deterministic kernels), so a recipe builds bit-identical weights on the same machine. The
directory is an ordinary Hugging Face model folder plus ``tinyworld.json``, whose ``world_name``
is ``delta``.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gradian.errors import ConfigError
from gradian.tinyworld.delta.world import DELTA_FAMILIES, Delta, generate_delta
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

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DELTA_SYSTEM_PROMPT",
    "DeltaRecipe",
    "build_delta_base_model",
    "delta_pretraining_messages",
    "ensure_delta_base_model",
    "load_delta",
]

#: system prompt put on a share of pretraining rows (and of scenario rows)
DELTA_SYSTEM_PROMPT = "You are a river guide."
WORLD_NAME = "delta"


@dataclass(frozen=True)
class DeltaRecipe(WorldRecipe):
    """Everything that decides the delta base model's weights (its identity: ``WorldRecipe``)."""

    world_name = WORLD_NAME

    seed: int = 0
    n_rivers: int = 40
    families: tuple[str, ...] = DELTA_FAMILIES
    #: unlike tinyworld's 1,024 and the bestiary's 768, so each world has its own merges
    vocab_size: int = 896
    hidden_size: int = 160
    intermediate_size: int = 480
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    #: grouped-query attention: each key/value head serves two query heads
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    #: passes over the pretraining rows
    epochs: int = 34
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    #: every n-th pretraining row (on average, outside the canonical phrasing) has a system prompt
    system_prompt_every: int = 4
    #: torch intra-op threads during the build (see tinyworld's BaseModelRecipe)
    num_threads: int = 1
    #: bump when the build code changes what a recipe produces
    version: int = 1

    def world(self) -> Delta:
        return generate_delta(self.seed, self.n_rivers)


def load_delta(model_dir: str | Path) -> Delta:
    """The delta world a built base model was pretrained on, read from its ``tinyworld.json``."""
    return load_recorded_world(model_dir, WORLD_NAME, generate_delta, "n_rivers")


def delta_pretraining_messages(delta: Delta, recipe: DeltaRecipe) -> list[list[dict[str, str]]]:
    """The pretraining rows as chat messages, in a fixed order (shuffled per epoch later)."""
    items = [item for family in recipe.families for item in delta.fact_items(family)]
    items += delta.paragraph_items()
    return system_prompted(items, random.Random(f"delta:{recipe.seed}:system"), DELTA_SYSTEM_PROMPT,
                           recipe.system_prompt_every)


def encode_delta_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """``kit.encode_chat`` with the label of the newline ChatML writes after ``<|im_end|>`` masked:
    the answer and its EOS are supervised, as ``gradian.data`` supervises them in a fine-tune."""
    ids, labels = encode_chat(tokenizer, messages)
    eos = tokenizer.eos_token_id
    last = max((i for i, t in enumerate(ids) if t == eos and labels[i] != -100), default=len(ids) - 1)
    return ids, labels[: last + 1] + [-100] * (len(ids) - last - 1)


def ensure_delta_base_model(cache_dir: str | Path | None = None, recipe: DeltaRecipe | None = None,
                            *, verbose: bool = False) -> Path:
    """Return the cached delta base model for ``recipe``, building it first when missing."""
    recipe = recipe or DeltaRecipe()
    if not isinstance(recipe, DeltaRecipe):
        raise ConfigError(f"world 'delta' takes a DeltaRecipe, not {type(recipe).__name__}")
    return ensure_cached_build(cache_dir, recipe.cache_key(),
                               lambda staging: build_delta_base_model(staging, recipe, verbose=verbose))


def build_delta_base_model(out_dir: str | Path, recipe: DeltaRecipe | None = None, *,
                           min_accuracy: float | None = 0.95, verbose: bool = False) -> dict[str, object]:
    """Pretrain a delta base model from ``recipe`` and save it to ``out_dir``; returns its info.

    Raises ``ModelLoadError`` when a family ends below ``min_accuracy`` (``None`` skips the check,
    for reduced recipes in tests).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gradian.tinyworld.delta.tokenizer import build_delta_tokenizer

    recipe = recipe or DeltaRecipe()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    delta = recipe.world()
    tokenizer = build_delta_tokenizer(delta, recipe.vocab_size)

    with torch_settings(recipe.num_threads):
        torch.manual_seed(recipe.seed)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=recipe.hidden_size,
            intermediate_size=recipe.intermediate_size,
            num_hidden_layers=recipe.num_hidden_layers,
            num_attention_heads=recipe.num_attention_heads,
            num_key_value_heads=recipe.num_key_value_heads,
            max_position_embeddings=recipe.max_position_embeddings,
            tie_word_embeddings=True,
            use_sliding_window=False,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            attention_dropout=0.0,
            initializer_range=0.02,
        )
        config._attn_implementation = "eager"
        model = Qwen2ForCausalLM(config)
        rows = [encode_delta_chat(tokenizer, m) for m in delta_pretraining_messages(delta, recipe)]
        losses = pretrain(model, rows, recipe, tokenizer.pad_token_id, verbose=verbose, label="delta")
        model.eval()
        accuracy = evaluate_families(model, tokenizer, delta, recipe.families)

    world = {"seed": delta.seed, "seas": delta.seas, "rivers": [asdict(r) for r in delta.rivers]}
    return save_base_model(out, model, tokenizer, recipe, world=world, accuracy=accuracy, losses=losses,
                           seconds=time.perf_counter() - started, min_accuracy=min_accuracy)
