"""What an index was built from, and the id derived from it.

Interface: ``index_identity(...)`` collects every input that changes the stored numbers (model
and adapter fingerprints, tokenizer and chat-template fingerprint, dataset content hash, gradient
spec, seed, library versions, blocks); ``index_id(identity)`` hashes it; ``first_difference(a,
b)`` names the first field two identities disagree on, for the error that refuses a mismatched
store; ``tokenizer_fingerprint(tokenizer)`` hashes what decides the token ids and loss masks.

Engine settings (damping and the rest) are not part of it: they change no stored number, and a
fitted engine state gets its own id beside the index (``gradian.engines.state``).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence, TypedDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig

__all__ = ["FORMAT_VERSION", "ChunkRecord", "ManifestBlock", "index_identity", "index_id", "first_difference", "library_versions",
           "tokenizer_fingerprint", "GRADS_ID_FIELDS"]

#: 2: chunk checksums and a manifest checksum; tokenizer fingerprint in, engine damping out
#: 3: no damping key at all
FORMAT_VERSION = 3

#: the importable name recorded -> the installed distribution that carries it
_DISTRIBUTIONS = {"gradian": "gradian-mlflow", "torch": "torch", "transformers": "transformers", "peft": "peft",
                  "numpy": "numpy"}

#: grads settings that change stored values or layout (batch_size does not: capture is exact per row)
GRADS_ID_FIELDS = ("strategy", "loss_reduction", "normalization", "max_seq_length", "module_filter",
                   "block_granularity", "projection_dim", "projection_kind", "projection_seed",
                   "storage_dtype", "chunk_size")


class ManifestBlock(TypedDict):
    """One block of the manifest: its names, LoRA shapes and dim, its stored width and its column offset."""

    name: str
    module: str
    shapes: list[list[int]]
    dim: int
    width: int
    offset: int


class ChunkRecord(TypedDict):
    """A chunk's manifest record: its row count, and the sha256 and size of its data and norms files."""

    rows: int
    sha256: str
    bytes: int
    norms_sha256: str
    norms_bytes: int


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name, distribution in _DISTRIBUTIONS.items():
        try:
            out[name] = version(distribution)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def tokenizer_fingerprint(tokenizer: "PreTrainedTokenizerBase | None") -> str:
    """sha256 over what turns a row into token ids and a loss mask: the tokenizer's model
    (vocabulary, merges, normalizer, pre-tokenizer and added tokens, as the fast backend
    serializes them; else the files ``save_pretrained`` writes), its BOS/EOS tokens and its chat
    template. Two tokenizers with the same fingerprint tokenize every row the same way."""
    if tokenizer is None:
        return "none"
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(b"backend\0" + backend.to_str().encode("utf-8"))
    else:
        with tempfile.TemporaryDirectory(prefix="gradian-tokenizer-") as tmp:
            tokenizer.save_pretrained(tmp)
            for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
                digest.update(f"file\0{path.relative_to(tmp).as_posix()}\0".encode("utf-8") + path.read_bytes())
    extras = {"chat_template": getattr(tokenizer, "chat_template", None),
              "bos_token": getattr(tokenizer, "bos_token", None), "eos_token": getattr(tokenizer, "eos_token", None)}
    digest.update(b"extras\0" + json.dumps(extras, sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()


def index_identity(*, base_fingerprint: str, adapter_fingerprint: str, dataset_sha256: str, n_examples: int,
                   config: GradianConfig, blocks: Sequence[Mapping[str, object]], model_dtype: str,
                   tokenizer_fingerprint: str = "unknown") -> dict[str, object]:
    grads = config.grads
    # the base's weights as loaded: a quantized base gives other gradients (the key is absent for
    # none, so the ids of indexes built before it existed still match)
    quantized = {"base_quantization": config.quantization} if config.quantization != "none" else {}
    return {
        **quantized,
        "format_version": FORMAT_VERSION,
        "base": base_fingerprint,
        "adapter": adapter_fingerprint,
        "tokenizer": tokenizer_fingerprint,
        "dataset": {"sha256": dataset_sha256, "n_examples": n_examples},
        "grads": {name: getattr(grads, name) for name in GRADS_ID_FIELDS},
        "seed": config.seed,
        "model_dtype": model_dtype,
        "libraries": library_versions(),
        "blocks": blocks,
    }


def index_id(identity: Mapping[str, object]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


def first_difference(stored: object, given: object, prefix: str = "") -> tuple[str, object, object] | None:
    """``(dotted field, stored value, given value)`` of the first disagreement, or ``None``."""
    if isinstance(stored, Mapping) and isinstance(given, Mapping):
        for key in list(stored) + [k for k in given if k not in stored]:
            found = first_difference(stored.get(key), given.get(key), f"{prefix}{key}.")
            if found:
                return found
        return None
    if isinstance(stored, list) and isinstance(given, list):
        if len(stored) != len(given):
            return (f"{prefix.rstrip('.')} (length)", len(stored), len(given))
        for i, (a, b) in enumerate(zip(stored, given)):
            found = first_difference(a, b, f"{prefix}{i}.")
            if found:
                return found
        return None
    if stored != given:
        return (prefix.rstrip("."), stored, given)
    return None
