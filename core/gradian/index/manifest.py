"""What an index was built from, and the id derived from it.

Interface: ``index_identity(...)`` collects every input that changes the stored numbers (model
and adapter fingerprints, dataset content hash, gradient spec, seed, damping, library versions,
blocks); ``index_id(identity)`` hashes it; ``first_difference(a, b)`` names the first field two
identities disagree on, for the error that refuses a mismatched store.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

__all__ = ["FORMAT_VERSION", "index_identity", "index_id", "first_difference", "library_versions", "GRADS_ID_FIELDS"]

FORMAT_VERSION = 1

#: grads settings that change stored values or layout (batch_size does not: capture is exact per row)
GRADS_ID_FIELDS = ("strategy", "loss_reduction", "normalization", "max_seq_length", "module_filter",
                   "block_granularity", "projection_dim", "projection_kind", "projection_seed",
                   "storage_dtype", "chunk_size")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("gradian", "torch", "transformers", "peft", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def index_identity(*, base_fingerprint: str, adapter_fingerprint: str, dataset_sha256: str, n_examples: int,
                   config: Any, blocks: list[dict[str, Any]], model_dtype: str) -> dict[str, Any]:
    grads = config.grads
    return {
        "format_version": FORMAT_VERSION,
        "base": base_fingerprint,
        "adapter": adapter_fingerprint,
        "dataset": {"sha256": dataset_sha256, "n_examples": n_examples},
        "grads": {name: getattr(grads, name) for name in GRADS_ID_FIELDS},
        "seed": config.seed,
        "damping": {"lambda_scale": config.engine.lambda_scale, "lambda_override": config.engine.lambda_override},
        "model_dtype": model_dtype,
        "libraries": library_versions(),
        "blocks": blocks,
    }


def index_id(identity: Mapping[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


def first_difference(stored: Any, given: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
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
