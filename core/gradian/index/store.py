"""The gradient index: every training example's per-block gradient, on disk, content-addressed.

Interface: ``GradientIndex.build(gm, tokenizer, dataset, config) -> GradientIndex`` (a cache hit
when the same inputs were indexed before; ``force=True`` rebuilds), ``GradientIndex.open(path,
expect=identity)``, and on an opened index ``n``, ``block_names``, ``example_ids``,
``iter_chunks()``, ``sq_norms()``, ``block(name)`` (the engines read it as ``TrainGradients``).

Layout of ``<cache_dir>/index/<index_id>/``::

    manifest.json          identity (what it was built from), blocks and their column ranges,
                           status building|complete, sizes
    example_ids.json       dataset order
    chunks/NNNNN.npy       [rows, total width] in storage_dtype, blocks side by side
    chunks/NNNNN.norms.npy [rows, blocks] float64 squared norms of the stored values

Every file is written beside its target and renamed into place, and a chunk's data file is
written last, so a chunk either exists whole or not at all. An interrupted build leaves
``status: building`` and its complete chunks; the next build of the same inputs resumes after
the last one. Opening a store whose identity differs from the expected one is refused, naming the
first differing field; a changed dataset, model or setting gets a new id, so a stale store is
never served.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from gradian.atomic import write_text_atomic
from gradian.errors import IndexMismatchError
from gradian.index.manifest import first_difference, index_id, index_identity

__all__ = ["GradientIndex", "index_root"]

_STORAGE = {"float32": np.float32, "float16": np.float16}


def index_root(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "index"


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    from gradian.atomic import atomic_open

    with atomic_open(path) as handle:
        np.save(handle, array)


class GradientIndex:
    """An opened gradient store (read-only, memory-mapped chunk by chunk)."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self._norms: dict[str, np.ndarray] | None = None

    # -- reading ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, expect: dict[str, Any] | None = None) -> "GradientIndex":
        """Open a complete store; with ``expect`` (an identity), refuse one built from other inputs."""
        root = Path(path)
        manifest_path = root / "manifest.json"
        if not manifest_path.is_file():
            raise IndexMismatchError(f"{root} is not a gradient index (no manifest.json); build one with `gradian index`")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if expect is not None:
            _refuse_mismatch(root, manifest["identity"], expect)
        if manifest.get("status") != "complete":
            raise IndexMismatchError(
                f"{root}: the index build did not finish ({manifest.get('n_chunks_done', 0)} of "
                f"{manifest.get('n_chunks')} chunks); run `gradian index` again to resume it"
            )
        return cls(root, manifest)

    @property
    def index_id(self) -> str:
        return self.manifest["index_id"]

    @property
    def n(self) -> int:
        return int(self.manifest["n_examples"])

    @property
    def block_names(self) -> list[str]:
        return [b["name"] for b in self.manifest["blocks"]]

    @property
    def example_ids(self) -> list[str]:
        return json.loads((self.root / "example_ids.json").read_text(encoding="utf-8"))

    @property
    def identity(self) -> dict[str, Any]:
        return self.manifest["identity"]

    def _chunk_path(self, k: int) -> Path:
        return self.root / "chunks" / f"{k:05d}.npy"

    def iter_chunks(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``(start row, {block: [rows, width]})`` views of the memory-mapped chunks."""
        size = int(self.manifest["chunk_size"])
        for k in range(int(self.manifest["n_chunks"])):
            data = np.load(self._chunk_path(k), mmap_mode="r")
            yield k * size, {b["name"]: data[:, b["offset"] : b["offset"] + b["width"]] for b in self.manifest["blocks"]}

    def sq_norms(self) -> dict[str, np.ndarray]:
        if self._norms is None:
            parts = [np.load(self.root / "chunks" / f"{k:05d}.norms.npy") for k in range(int(self.manifest["n_chunks"]))]
            stacked = np.concatenate(parts, axis=0) if parts else np.zeros((0, len(self.block_names)))
            self._norms = {name: stacked[:, j] for j, name in enumerate(self.block_names)}
        return self._norms

    def block(self, name: str) -> np.ndarray:
        """One block's ``[n, width]`` gradients, read into memory (float32)."""
        return np.concatenate([chunk[name].astype(np.float32) for _, chunk in self.iter_chunks()], axis=0)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "chunks").glob("*.npy"))

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def build(cls, gm: Any, tokenizer: Any, dataset: Any, config: Any, *, cache_dir: str | Path | None = None,
              force: bool = False, progress: Callable[[int, int], None] | None = None) -> "GradientIndex":
        """Index ``dataset`` under ``gm`` (a ``GradientModel``) with ``config`` (a ``GradianConfig``).

        Returns the stored index: straight from the cache when these inputs were indexed before,
        resumed when a previous build of them was interrupted, fresh otherwise (or with ``force``).
        ``progress(done, total)`` is called after each chunk.
        """
        from gradian.data import tokenize_examples
        from gradian.grads import gradient_widths, iter_example_gradients, make_projector

        grads = config.grads
        widths = gradient_widths(gm, grads)
        blocks, offset = [], 0
        for spec in gm.spec():
            blocks.append({**spec, "width": widths[spec["name"]], "offset": offset})
            offset += widths[spec["name"]]
        identity = index_identity(
            base_fingerprint=gm.fingerprints.get("base", "in-memory"),
            adapter_fingerprint=gm.fingerprints.get("adapter", "in-memory"),
            dataset_sha256=dataset.sha256, n_examples=len(dataset), config=config,
            blocks=[{k: b[k] for k in ("name", "shapes", "dim", "width")} for b in blocks],
            model_dtype=str(gm.dtype).replace("torch.", ""),
        )
        the_id = index_id(identity)
        root = index_root(cache_dir or config.cache_dir) / the_id
        if force and root.exists():
            shutil.rmtree(root)
        manifest_path = root / "manifest.json"
        if manifest_path.is_file():
            stored = json.loads(manifest_path.read_text(encoding="utf-8"))
            _refuse_mismatch(root, stored["identity"], identity)
            if stored.get("status") == "complete":
                return cls(root, stored)
        chunk_size = int(grads.chunk_size)
        n = len(dataset)
        n_chunks = (n + chunk_size - 1) // chunk_size
        (root / "chunks").mkdir(parents=True, exist_ok=True)
        manifest = {
            "index_id": the_id,
            "status": "building",
            "identity": identity,
            "blocks": blocks,
            "n_examples": n,
            "chunk_size": chunk_size,
            "n_chunks": n_chunks,
            "n_chunks_done": 0,
            "total_width": offset,
            "storage_dtype": grads.storage_dtype,
            "sources": {"dataset": str(getattr(dataset, "path", "")), "base_model": config.base_model,
                        "adapter_path": config.adapter_path},
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_text_atomic(root / "example_ids.json", json.dumps(dataset.ids))
        done = _complete_chunks(root, n_chunks, chunk_size, n, offset, len(blocks))
        manifest["n_chunks_done"] = done
        write_text_atomic(manifest_path, json.dumps(manifest, indent=2))

        started = time.perf_counter()
        first_row = done * chunk_size
        tokenized = tokenize_examples(dataset.examples, tokenizer, grads.max_seq_length)
        manifest["n_examples_without_supervision"] = sum(1 for t in tokenized if t.n_supervised == 0)
        tokenized = tokenized[first_row:]
        storage = _STORAGE[grads.storage_dtype]
        projector = make_projector(grads)
        buffer: list[dict[str, np.ndarray]] = []
        buffered = 0
        k = done
        if progress:
            progress(first_row, n)
        for _, batch in iter_example_gradients(gm, tokenized, grads, tokenizer.pad_token_id, projector=projector):
            buffer.append(batch)
            buffered += next(iter(batch.values())).shape[0]
            while buffered >= chunk_size or (buffered and k * chunk_size + buffered >= n):
                take = min(chunk_size, buffered)
                rows, buffer, buffered = _take_rows(buffer, take, [b["name"] for b in blocks])
                _write_chunk(root, k, rows, storage)
                k += 1
                manifest["n_chunks_done"] = k
                write_text_atomic(manifest_path, json.dumps(manifest, indent=2))
                if progress:
                    progress(min(k * chunk_size, n), n)
        manifest["status"] = "complete"
        manifest["build_seconds"] = round(time.perf_counter() - started, 3)
        index = cls(root, manifest)
        manifest["bytes"] = index.disk_bytes()
        manifest["bytes_per_example"] = manifest["bytes"] / max(n, 1)
        write_text_atomic(manifest_path, json.dumps(manifest, indent=2))
        return index


def _take_rows(buffer: list[dict[str, np.ndarray]], take: int, names: list[str]):
    joined = {b: np.concatenate([part[b] for part in buffer], axis=0) for b in names}
    rows = {b: v[:take] for b, v in joined.items()}
    rest = {b: v[take:] for b, v in joined.items()}
    left = next(iter(rest.values())).shape[0]
    return rows, ([rest] if left else []), left


def _write_chunk(root: Path, k: int, rows: dict[str, np.ndarray], storage: Any) -> None:
    data = np.concatenate([rows[b].astype(storage) for b in rows], axis=1)
    norms = np.stack([np.einsum("ij,ij->i", v, v, dtype=np.float64)
                      for v in (rows[b].astype(storage).astype(np.float64) for b in rows)], axis=1)
    _save_npy_atomic(root / "chunks" / f"{k:05d}.norms.npy", norms)
    _save_npy_atomic(root / "chunks" / f"{k:05d}.npy", data)  # last: its presence marks the chunk done


def _complete_chunks(root: Path, n_chunks: int, chunk_size: int, n: int, width: int, n_blocks: int) -> int:
    """Leading chunks already on disk whole (right shape); everything after them is discarded."""
    done = 0
    for k in range(n_chunks):
        data, norms = root / "chunks" / f"{k:05d}.npy", root / "chunks" / f"{k:05d}.norms.npy"
        rows = min(chunk_size, n - k * chunk_size)
        try:
            ok = (np.load(data, mmap_mode="r").shape == (rows, width)
                  and np.load(norms, mmap_mode="r").shape == (rows, n_blocks))
        except (OSError, ValueError):
            ok = False
        if not ok:
            break
        done += 1
    for stale in (root / "chunks").glob("*.npy"):
        if int(stale.name[:5]) >= done:
            stale.unlink()
    return done


def _refuse_mismatch(root: Path, stored: dict[str, Any], given: dict[str, Any]) -> None:
    diff = first_difference(stored, given)
    if diff is None:
        return
    field, was, now = diff
    hint = {
        "dataset": "the dataset changed since this index was built",
        "base": "the base model differs",
        "adapter": "the adapter differs",
    }.get(field.split(".")[0], f"'{field}' differs")
    raise IndexMismatchError(
        f"index {root} does not match the given inputs: {hint} ({field}: index has {_short(was)}, "
        f"given {_short(now)}); rebuild with `gradian index` (add --force to replace it) or open the index "
        "built from these inputs"
    )


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
