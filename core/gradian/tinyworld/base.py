"""The tinyworld base model: a tiny Llama pretrained on the world, cached by its recipe's hash.

Interface:

- ``BaseModelRecipe``: everything that decides the weights (world seed and size, vocabulary,
  model shape, pretraining schedule). ``recipe.content_hash()`` names the cache entry.
- ``ensure_base_model(cache_dir=None, recipe=None, world="tinyworld") -> Path``: the directory
  of a built base model, building it first when the cache has none for this recipe. Safe to call
  from several processes at once (a file lock serializes builds; the entry appears by an atomic
  rename). ``world`` picks another registered world (``gradian.tinyworld.worlds``);
  ``ensure_cached_build`` is the caching every world's builder goes through.
- ``build_base_model(out_dir, recipe) -> dict``: pretrain and save, unconditionally.
- ``evaluate_families(model, tokenizer, world) -> dict[str, float]``: greedy exact match per family.
- ``weights_sha256(model_dir)``: hash of the saved weights, for bit-identity checks.

A built directory is an ordinary Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json``, the tokenizer files) that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, plus
``tinyworld.json`` recording the recipe, the world, per-family accuracy and the build time.

Pretraining is a plain loop rather than ``transformers.Trainer``: it is short, and a loop with a
fixed thread count, seeded generator and no dataloader workers is bit-identical from run to run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from gradian.errors import ConfigError, ModelLoadError
from gradian.tinyworld.world import BASE_FAMILIES, World, generate_world

if TYPE_CHECKING:
    from gradian.tinyworld.bestiary.base import BestiaryRecipe
    from gradian.tinyworld.bestiary.world import Bestiary

__all__ = [
    "BaseModelRecipe",
    "CACHE_ENV",
    "build_base_model",
    "default_cache_dir",
    "ensure_base_model",
    "ensure_cached_build",
    "evaluate_families",
    "generate_answers",
    "load_world",
    "pretraining_messages",
    "weights_sha256",
]

#: environment variable that overrides where built base models are cached
CACHE_ENV = "GRADIAN_TINYWORLD_CACHE"
#: system prompt put on a share of pretraining rows so the model is at ease with one or none
SYSTEM_PROMPT = "You are a helpful assistant."
_INFO_FILE = "tinyworld.json"
_WEIGHTS_FILE = "model.safetensors"


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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["families"] = list(self.families)
        return data

    def content_hash(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def world(self) -> World:
        return generate_world(self.seed, self.n_countries)


def default_cache_dir() -> Path:
    """``$GRADIAN_TINYWORLD_CACHE``, else ``~/.cache/gradian/tinyworld``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gradian" / "tinyworld"


def load_world(model_dir: str | Path) -> "World | Bestiary":
    """The world a built base model was pretrained on, read from its ``tinyworld.json``.

    A base model of another world (``world_name`` in the file) gives that world's object, e.g. a
    ``Bestiary``.
    """
    info = _read_info(Path(model_dir))
    if info.get("world_name", "tinyworld") != "tinyworld":
        from gradian.tinyworld.worlds import get_world

        return get_world(info["world_name"]).load_world(Path(model_dir))
    recipe = info["recipe"]
    return generate_world(recipe["seed"], recipe["n_countries"])


def pretraining_messages(world: World, recipe: BaseModelRecipe) -> list[list[dict[str, str]]]:
    """The pretraining rows, as chat messages, in a fixed order (shuffled per epoch later)."""
    items = [item for family in recipe.families for item in world.fact_items(family)]
    items += world.paragraph_items()
    # the canonical phrasing (the one eval items use) never carries the system prompt, so each
    # fact is certainly seen in the plain form it is evaluated in
    rng = random.Random(recipe.seed)
    rows = []
    for item in items:
        draw = rng.random()
        with_system = (recipe.system_prompt_every > 0 and item.phrasing != 0
                       and draw < 1 / recipe.system_prompt_every)
        rows.append(item.messages(SYSTEM_PROMPT if with_system else None))
    return rows


# -- building --------------------------------------------------------------------------------


def ensure_base_model(cache_dir: str | Path | None = None,
                      recipe: "BaseModelRecipe | BestiaryRecipe | None" = None, *,
                      verbose: bool = False, world: str = "tinyworld") -> Path:
    """Return the cached base model of ``world`` for ``recipe``, building it first when missing.

    ``world`` names an entry of ``gradian.tinyworld.worlds.WORLDS`` (``tinyworld``, the default,
    or ``bestiary``); ``recipe`` is that world's recipe type, its default when ``None``.
    """
    if world != "tinyworld":
        from gradian.tinyworld.worlds import get_world

        return get_world(world).ensure_base_model(cache_dir, recipe, verbose=verbose)
    recipe = recipe or BaseModelRecipe()
    if not isinstance(recipe, BaseModelRecipe):
        raise ConfigError(f"world 'tinyworld' takes a BaseModelRecipe, not {type(recipe).__name__}")
    return ensure_cached_build(cache_dir, recipe.content_hash(),
                               lambda staging: build_base_model(staging, recipe, verbose=verbose))


def ensure_cached_build(cache_dir: str | Path | None, key: str,
                        build: Callable[[Path], Any]) -> Path:
    """``<cache>/base-<key>``, made by ``build(staging_dir)`` first when it is not complete yet.

    Safe across processes: a file lock serializes builds of one key, and the entry appears by
    an atomic rename of the staging directory, so a reader never sees half a model.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"base-{key}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".base-{key}.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        # a build killed half-way leaves its staging dir behind; holding the lock, we own them
        for stale in root.glob(f".building-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".building-{key}-", dir=root))
        try:
            build(staging)
            if target.exists():  # a half-written entry from an interrupted older build
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


def build_base_model(out_dir: str | Path, recipe: BaseModelRecipe | None = None, *,
                     min_accuracy: float | None = 0.95, verbose: bool = False) -> dict[str, Any]:
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

    with _torch_settings(recipe.num_threads):
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
        rows = [_encode(tokenizer, m) for m in pretraining_messages(world, recipe)]
        losses = _pretrain(model, rows, recipe, tokenizer.pad_token_id, verbose=verbose)
        model.eval()
        accuracy = evaluate_families(model, tokenizer, world, recipe.families)

    seconds = time.perf_counter() - started
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
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
        "versions": _library_versions(),
    }
    _write_json(out / _INFO_FILE, info)
    if min_accuracy is not None:
        low = {f: a for f, a in accuracy.items() if a < min_accuracy}
        if low:
            raise ModelLoadError(
                f"tinyworld base model {recipe.content_hash()} learned too little: {low} is below "
                f"{min_accuracy:.0%} exact match; raise BaseModelRecipe.epochs or the model size"
            )
    return info


def _encode(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of a chat, and labels that supervise only the last assistant turn and its EOS."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    if ids[:n] != prompt_ids:  # the template is prefix-stable; this would be a bug here
        raise ModelLoadError("tinyworld chat template is not prefix-stable in token space")
    return ids, [-100] * n + ids[n:]


def _pretrain(model: Any, rows: list[tuple[list[int], list[int]]], recipe: BaseModelRecipe,
              pad_id: int, *, verbose: bool, label: str = "tinyworld") -> list[float]:
    import torch

    gen = torch.Generator().manual_seed(recipe.seed)
    n_batches = math.ceil(len(rows) / recipe.batch_size)
    total = n_batches * recipe.epochs
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate,
                            weight_decay=recipe.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to a tenth
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(total - recipe.warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    for epoch in range(recipe.epochs):
        order = torch.randperm(len(rows), generator=gen).tolist()
        epoch_loss = 0.0
        for b in range(n_batches):
            batch = [rows[i] for i in order[b * recipe.batch_size:(b + 1) * recipe.batch_size]]
            input_ids, labels, mask = _pad(batch, pad_id)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            epoch_loss += loss.item()
        losses.append(epoch_loss / n_batches)
        if verbose:
            print(f"{label} pretrain epoch {epoch + 1}/{recipe.epochs} loss {losses[-1]:.4f}",
                  flush=True)
    return losses


def _pad(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (x, y) in enumerate(batch):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return ids, labels, mask


# -- evaluation ------------------------------------------------------------------------------


def generate_answers(model: Any, tokenizer: Any, prompts: list[list[dict[str, str]]], *,
                     max_new_tokens: int = 12, batch_size: int = 64) -> list[str]:
    """Greedy answers to chat prompts (messages without the assistant turn), decoded as text.

    Prompts are batched by token length, so no row carries padding: eager attention over a
    left-padded row can produce NaN for the padded positions, and padding-free batches also
    give exactly the answer a batch of one would.
    """
    import torch

    encoded = [
        tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        for m in prompts
    ]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    out: list[str] = [""] * len(prompts)
    eos = tokenizer.eos_token_id
    for length in sorted(by_length):
        members = by_length[length]
        for start in range(0, len(members), batch_size):
            chunk = members[start:start + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk], dtype=torch.long)
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
            for i, row in zip(chunk, gen[:, length:].tolist()):
                if eos in row:
                    row = row[: row.index(eos)]
                out[i] = tokenizer.decode(row, skip_special_tokens=True).strip()
    return out


def evaluate_families(model: Any, tokenizer: Any, world: World,
                      families: tuple[str, ...] = BASE_FAMILIES) -> dict[str, float]:
    """Greedy exact-match accuracy on each family's eval items (canonical phrasing, every fact)."""
    result = {}
    for family in families:
        items = world.eval_items(family)
        answers = generate_answers(model, tokenizer, [i.messages()[:-1] for i in items])
        result[family] = sum(a == i.answer for a, i in zip(answers, items)) / len(items)
    return result


# -- files -----------------------------------------------------------------------------------


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 of the saved weights file: equal hashes mean bit-identical weights."""
    path = Path(model_dir) / _WEIGHTS_FILE
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_complete(path: Path) -> bool:
    return (path / _INFO_FILE).is_file() and (path / _WEIGHTS_FILE).is_file()


def _read_info(model_dir: Path) -> dict[str, Any]:
    path = model_dir / _INFO_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} is not a tinyworld base model (no {_INFO_FILE}); build one with "
            "`gradian tinyworld build`"
        )
    return json.loads(path.read_text())


def _write_json(path: Path, data: Any) -> None:
    from gradian.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _library_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


@contextlib.contextmanager
def _torch_settings(num_threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic kernels for the duration of a build."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(num_threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
