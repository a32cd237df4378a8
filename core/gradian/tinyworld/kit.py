"""The kit every offline world is built with: a content-addressed cache, pretraining, checks.

Interface: ``ensure_cached_build(cache_dir, key, build) -> Path`` (``<cache>/base-<key>``, built
once under a file lock and renamed into place whole), ``default_cache_dir()`` (``CACHE_ENV``),
``encode_chat`` (a chat rendered to ids with the prompt masked), ``pretrain`` (the seeded AdamW
loop any ``PretrainRecipe`` describes), ``generate_answers`` / ``evaluate_families`` (greedy
exact match per family), ``weights_sha256``, ``read_info`` / ``write_json`` (the ``INFO_FILE``
beside a built base), ``library_versions`` and ``torch_settings`` (the deterministic settings a
build runs under). For the worlds after tinyworld: ``WorldRecipe`` (a recipe's identity: its
fields, hash and cache key), ``system_prompted`` (pretraining rows with a system prompt on a
share of them), ``load_recorded_world`` (the world a built base records) and ``save_base_model``
(a pretrained model saved with its info and checked). tinyworld's base (``gradian.tinyworld.base``),
the bestiary's and the delta's are peers that all stand on this; none imports another.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Protocol, Sequence, TypeVar

from gradian.errors import ModelLoadError
from gradian.tinyworld.world import BASE_FAMILIES, FactItem
from gradian.transformers_compat import portable_tokenizer_config, save_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


__all__ = ["CACHE_ENV", "INFO_FILE", "WEIGHTS_FILE", "FactWorld", "PretrainRecipe", "WorldRecipe", "default_cache_dir",
           "encode_chat", "ensure_cached_build", "evaluate_families", "generate_answers", "library_versions",
           "load_recorded_world", "pretrain", "read_info", "save_base_model", "system_prompted", "torch_settings",
           "weights_sha256", "write_json"]

_World = TypeVar("_World")


class FactWorld(Protocol):
    """What ``evaluate_families`` reads of a world: each family's eval items."""

    def eval_items(self, family: str) -> list[FactItem]: ...


class WorldRecipe:
    """The identity of a world's recipe (a frozen dataclass with a ``families`` tuple), for the
    worlds after tinyworld: ``to_dict`` (the fields, families as a list), ``content_hash`` (of the
    world's name and the fields) and ``cache_key`` (``<world>-<hash>``). A subclass names its world
    in ``world_name``."""

    world_name: ClassVar[str] = ""

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)  # type: ignore[call-overload]  # a dataclass subclass
        data["families"] = list(data["families"])
        return data

    def content_hash(self) -> str:
        text = json.dumps({"world": self.world_name, **self.to_dict()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def cache_key(self) -> str:
        return f"{self.world_name}-{self.content_hash()}"


def system_prompted(items: Sequence[FactItem], rng: Any, system_prompt: str, every: int) -> list[list[dict[str, str]]]:
    """Each item as chat messages, about one in ``every`` (drawn with ``rng``, one draw per item)
    with ``system_prompt`` first; the canonical phrasing (the eval form) never carries it, so each
    fact is certainly seen in the plain form it is evaluated in."""
    rows = []
    for item in items:
        draw = rng.random()
        with_system = every > 0 and item.phrasing != 0 and draw < 1 / every
        rows.append(item.messages(system_prompt if with_system else None))
    return rows


def load_recorded_world(model_dir: str | Path, world_name: str, generate: Callable[[int, int], _World],
                        count_key: str) -> _World:
    """The world a built base model of ``world_name`` was pretrained on, from its ``tinyworld.json``
    (``generate(seed, recipe[count_key])``); refused, naming the build command, for another world's base."""
    info = read_info(Path(model_dir))
    if info.get("world_name") != world_name:
        raise ModelLoadError(f"{model_dir} is a '{info.get('world_name', 'tinyworld')}' base model, "
                             f"not a {world_name} one; build one with `gradian tinyworld build --world {world_name}`")
    recipe = info["recipe"]
    return generate(recipe["seed"], recipe[count_key])


def save_base_model(out: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, recipe: WorldRecipe, *,
                    world: Mapping[str, object], accuracy: Mapping[str, float], losses: Sequence[float],
                    seconds: float, min_accuracy: float | None) -> dict[str, object]:
    """Save a pretrained base model of ``recipe``'s world to ``out`` (greedy generation, the
    model's own special tokens; a tokenizer both transformers majors load) with its info file
    (``world``: what the world records of itself), and refuse it when a family's ``accuracy``
    ends below ``min_accuracy`` (None: no check). Returns the info."""
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    info: dict[str, object] = {
        "world_name": recipe.world_name,
        "recipe": recipe.to_dict(),
        "recipe_hash": recipe.content_hash(),
        "world": dict(world),
        "accuracy": dict(accuracy),
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
                f"{recipe.world_name} base model {recipe.content_hash()} learned too little: {low} is below "
                f"{min_accuracy:.0%} exact match; raise {type(recipe).__name__}.epochs or the model size"
            )
    return info


class PretrainRecipe(Protocol):
    """What ``pretrain`` reads of a world's recipe (a frozen dataclass: read-only fields)."""

    @property
    def seed(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def epochs(self) -> int: ...
    @property
    def learning_rate(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...


#: environment variable that overrides where built base models are cached
CACHE_ENV = "GRADIAN_TINYWORLD_CACHE"


INFO_FILE = "tinyworld.json"


WEIGHTS_FILE = "model.safetensors"


def default_cache_dir() -> Path:
    """``$GRADIAN_TINYWORLD_CACHE``, else ``~/.cache/gradian/tinyworld``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gradian" / "tinyworld"


def ensure_cached_build(cache_dir: str | Path | None, key: str,
                        build: Callable[[Path], object]) -> Path:
    """``<cache>/base-<key>``, made by ``build(staging_dir)`` first when it is not complete yet.

    Safe across processes: a file lock serializes builds of one key, and the entry appears by
    an atomic rename of the staging directory, so a reader never sees half a model.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"base-{key}"
    if _is_complete(target):
        # an entry saved by transformers 5 before its files were written portably: 4.x could not
        # load its tokenizer; the rewrite is idempotent and atomic, so concurrent readers are safe
        portable_tokenizer_config(target)
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


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of a chat, and labels that supervise only the last assistant turn and its EOS."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    n = len(prompt_ids)
    if ids[:n] != prompt_ids:  # the template is prefix-stable; this would be a bug here
        raise ModelLoadError("tinyworld chat template is not prefix-stable in token space")
    return ids, [-100] * n + ids[n:]


def pretrain(model: PreTrainedModel, rows: list[tuple[list[int], list[int]]], recipe: PretrainRecipe,
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


def _pad(batch: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def generate_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[dict[str, str]]], *,
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


def evaluate_families(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, world: FactWorld,
                      families: tuple[str, ...] = BASE_FAMILIES) -> dict[str, float]:
    """Greedy exact-match accuracy on each family's eval items (canonical phrasing, every fact)."""
    result = {}
    for family in families:
        items = world.eval_items(family)
        answers = generate_answers(model, tokenizer, [i.messages()[:-1] for i in items])
        result[family] = sum(a == i.answer for a, i in zip(answers, items)) / len(items)
    return result


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 of the saved weights file: equal hashes mean bit-identical weights."""
    path = Path(model_dir) / WEIGHTS_FILE
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_complete(path: Path) -> bool:
    return (path / INFO_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def read_info(model_dir: Path) -> dict[str, Any]:
    path = model_dir / INFO_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{model_dir} is not a tinyworld base model (no {INFO_FILE}); build one with "
            "`gradian tinyworld build`"
        )
    return json.loads(path.read_text())


def write_json(path: Path, data: Mapping[str, object]) -> None:
    from gradian.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def library_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


@contextlib.contextmanager
def torch_settings(num_threads: int) -> Iterator[None]:
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
