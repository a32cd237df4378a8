"""Integrity of a stored gradient index: checksums, the manifest's own checksum, file checks.

Interface: ``sha256_bytes`` / ``sha256_file`` / ``npy_bytes`` (what a chunk's recorded checksum is
taken over), ``manifest_checksum``, ``write_manifest`` / ``read_manifest`` (a manifest whose own
checksum does not match is an ``IndexMismatchError``), ``file_problem`` / ``chunk_problem`` /
``chunk_problems`` / ``ids_problem`` (``None`` when a file is as recorded, else what is wrong with
it, in words, the file's path first), ``file_fault`` / ``chunk_fault`` / ``chunk_faults`` /
``ids_fault`` (the same without the path, or as ``(path, what is wrong)``: the repair records of a
build), ``refuse_mismatch`` (a stored identity that differs from the one expected) and
``rebuild_hint`` (the command that rebuilds a store). Both the reader (``gradian.index.store``)
and the build steps (``gradian.index.build``) check files through these.
"""

from __future__ import annotations

import hashlib
import io
import os
import json
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import numpy as np

from gradian.atomic import write_text_atomic
from gradian.errors import IndexCorruptError, IndexMismatchError
from gradian.index.manifest import FORMAT_VERSION, ChunkRecord, first_difference

__all__ = ["chunk_fault", "chunk_faults", "chunk_problem", "chunk_problems", "file_fault", "file_problem", "ids_fault",
           "ids_problem", "manifest_checksum", "npy_bytes", "read_manifest", "rebuild_hint", "refuse_mismatch",
           "sha256_bytes", "sha256_file", "write_manifest"]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def manifest_checksum(manifest: Mapping[str, object]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8"))


def write_manifest(path: Path, manifest: MutableMapping[str, object]) -> None:
    manifest["checksum"] = manifest_checksum(manifest)
    write_text_atomic(path, json.dumps(manifest, indent=2))


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of ``root``, its checksum checked; ``IndexCorruptError`` when it is damaged."""
    path = root / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IndexCorruptError(f"{path} is damaged (not valid JSON: {err}); {rebuild_hint(None)}") from None
    if not isinstance(manifest, dict):
        raise IndexCorruptError(f"{path} is damaged (not a JSON object); {rebuild_hint(None)}")
    if "checksum" in manifest:
        if manifest["checksum"] != manifest_checksum(manifest):
            raise IndexCorruptError(f"{path} is damaged (its content does not match its checksum); {rebuild_hint(None)}")
        return manifest
    identity = manifest.get("identity")
    version = identity.get("format_version") if isinstance(identity, dict) else None
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise IndexMismatchError(
            f"{root} was written in index format {version}, which records no checksums (this version reads "
            f"{FORMAT_VERSION}); {rebuild_hint(manifest)}"
        )
    raise IndexCorruptError(f"{path} is damaged (no checksum); {rebuild_hint(None)}")


def rebuild_hint(manifest: dict[str, Any] | None) -> str:
    """The command that rebuilds this index, with the inputs it was built from when known."""
    sources = (manifest or {}).get("sources") or {}
    flags = [f"{flag} {sources[key]}" for flag, key in (("-d", "dataset"), ("-m", "base_model"), ("-a", "adapter_path"))
             if sources.get(key) and not str(sources[key]).startswith("<")]
    command = "gradian index -c <its config> " + (" ".join(flags) if flags else "<the same inputs>")
    return (f"run `{command}` to recompute what is damaged, or the same with --force to rebuild the "
            "whole index")


def file_fault(path: Path, sha256: str, size: int, hash_data: bool = True) -> str | None:
    """What is wrong with ``path`` (``missing``, ``damaged (...)``), without its name, or ``None``."""
    if not path.is_file():
        return "missing"
    actual = path.stat().st_size
    if actual != size:
        return f"damaged ({actual} bytes, {size} were written: truncated or overwritten)"
    if hash_data and sha256_file(path) != sha256:
        return "damaged (its bytes do not match the sha256 recorded when it was written)"
    return None


def file_problem(path: Path, sha256: str, size: int, hash_data: bool = True) -> str | None:
    """Why ``path`` is not the file recorded (missing, wrong size, other bytes), or ``None``."""
    fault = file_fault(path, sha256, size, hash_data)
    return f"{path} is {fault}" if fault else None


def chunk_fault(root: Path, k: int, record: ChunkRecord, hash_data: bool) -> tuple[Path, str] | None:
    """``(file, what is wrong)`` for the first file of recorded chunk ``k`` not as recorded (the
    norms file first), or ``None``."""
    data, norms = root / "chunks" / f"{k:05d}.npy", root / "chunks" / f"{k:05d}.norms.npy"
    fault = file_fault(norms, record["norms_sha256"], record["norms_bytes"])
    if fault:
        return norms, fault
    fault = file_fault(data, record["sha256"], record["bytes"], hash_data=hash_data)
    return (data, fault) if fault else None


def chunk_problem(root: Path, k: int, record: ChunkRecord | None, hash_data: bool) -> str | None:
    if record is None:
        return f"{root / 'chunks' / f'{k:05d}.npy'} was never completed"
    found = chunk_fault(root, k, record, hash_data)
    return f"{found[0]} is {found[1]}" if found else None


def chunk_faults(root: Path, records: Mapping[int, ChunkRecord]) -> dict[int, tuple[Path, str]]:
    """``{chunk: (file, what is wrong)}`` for the chunks in ``records`` whose files are not as
    recorded, every byte hashed. Threads: hashlib releases the GIL on large buffers, so this runs
    at the speed of the disk or of several cores' sha256, not one."""
    from concurrent.futures import ThreadPoolExecutor

    if not records:
        return {}
    workers = max(1, min(len(records), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = dict(zip(records, pool.map(lambda k: chunk_fault(root, k, records[k], hash_data=True), records)))
    return {k: fault for k, fault in found.items() if fault}


def chunk_problems(root: Path, records: Mapping[int, ChunkRecord]) -> dict[int, str]:
    """``{chunk: problem}`` for the chunks in ``records`` whose files are not as recorded, every
    byte hashed (``chunk_faults``, in words)."""
    return {k: f"{path} is {fault}" for k, (path, fault) in chunk_faults(root, records).items()}


def ids_fault(path: Path, manifest: Mapping[str, object]) -> str | None:
    """What is wrong with example_ids.json, without its name, or ``None``."""
    if not path.is_file():
        return "missing"
    if sha256_file(path) != manifest["example_ids_sha256"]:
        return "damaged (its bytes do not match the sha256 recorded when it was written)"
    return None


def ids_problem(path: Path, manifest: Mapping[str, object]) -> str | None:
    fault = ids_fault(path, manifest)
    return f"{path} is {fault}" if fault else None


def refuse_mismatch(root: Path, stored: Mapping[str, object], given: Mapping[str, object]) -> None:
    diff = first_difference(stored, given)
    if diff is None:
        return
    field, was, now = diff
    hint = {
        "dataset": "the dataset changed since this index was built",
        "base": "the base model differs",
        "adapter": "the adapter differs",
        "tokenizer": "the tokenizer or its chat template differs",
    }.get(field.split(".")[0], f"'{field}' differs")
    raise IndexMismatchError(
        f"index {root} does not match the given inputs: {hint} ({field}: index has {_short(was)}, "
        f"given {_short(now)}); rebuild with `gradian index` (add --force to replace it) or open the index "
        "built from these inputs"
    )


def _short(value: object) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
