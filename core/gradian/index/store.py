"""The gradient index: every training example's per-block gradient, on disk, content-addressed.

Interface: ``GradientIndex.build(gm, tokenizer, dataset, config) -> GradientIndex`` (a cache hit
when the same inputs were indexed before, ``index.cache_hit`` says so; ``force=True`` rebuilds),
``GradientIndex.open(path, expect=identity)``, and on an opened index ``n``, ``block_names``,
``example_ids``, ``iter_chunks()``, ``sq_norms()``, ``block(name)`` (the engines read it as
``TrainGradients``), ``verify()``.

Layout of ``<cache_dir>/index/<index_id>/``::

    manifest.json          identity (what it was built from), blocks and their column ranges,
                           status building|complete, sizes, a sha256 per chunk file and one for
                           example_ids.json, and a checksum of the manifest itself
    example_ids.json       dataset order
    chunks/NNNNN.npy       [rows, total width] in storage_dtype, blocks side by side
    chunks/NNNNN.norms.npy [rows, blocks] float64 squared norms of the stored values

and ``<cache_dir>/index/.<index_id>.lock``, held (``fcntl.flock``) by whichever process builds it
(rank 0 of a sharded build). While a sharded build runs, ``chunks/NNNNN.record.json`` beside a
chunk holds its manifest record until rank 0 commits the manifest (``gradian.index.sharded``).

Every file is written beside its target and renamed into place, a chunk's data file last, and a
chunk counts as done once the manifest (or its chunk record) records its checksums. An
interrupted build leaves ``status: building`` and its recorded chunks; the next build of the same
inputs, with any number of processes, computes only the chunks that are missing. Damage is
found before any score is produced:

- ``open`` checks the manifest's own checksum, that example_ids.json and every norms file match
  their recorded sha256 and that every data file has its recorded size (a missing or truncated
  file); a data file's bytes are hashed the first time ``iter_chunks`` reads it, so scoring pays
  one sha256 pass over the store per opened index. A mismatch raises ``IndexCorruptError``
  naming the file and the command that rebuilds it.
- ``build`` of inputs already indexed hashes every file; a damaged chunk is discarded and
  computed again (the store is content-addressed, so the same inputs give the same numbers), a
  damaged manifest discards the whole store, and ``.tmp`` files left by a killed write are
  removed. Two builds of one index id take turns on the lock: the second finds the first one's
  work and returns it as a cache hit.

Disk space: before a build computes anything, the bytes of the chunks still to compute are
compared with the free space of the cache folder, and a build that cannot fit stops there
(``DiskFullError``, exit code 3). A disk that fills up anyway (another writer) stops the build at
the chunk being written: its partial files are removed, the chunks already recorded are kept, and
the next build resumes from them.

Opening a store whose identity differs from the expected one is refused, naming the first
differing field; a changed dataset, model, tokenizer or setting gets a new id, so a stale store
is never served.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as _field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from gradian.atomic import write_bytes_atomic, write_text_atomic
from gradian.errors import DiskFullError, IndexCorruptError, IndexMismatchError
from gradian.index.manifest import FORMAT_VERSION, first_difference, index_id, index_identity, tokenizer_fingerprint

if TYPE_CHECKING:
    from gradian.distributed import ShardGroup

__all__ = ["GradientIndex", "index_root"]

_STORAGE = {"float32": np.float32, "float16": np.float16}


def index_root(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "index"


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# -- the manifest and its checksum ---------------------------------------------------------------

def _manifest_checksum(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return _sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8"))


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    manifest["checksum"] = _manifest_checksum(manifest)
    write_text_atomic(path, json.dumps(manifest, indent=2))


def _read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of ``root``, its checksum checked; ``IndexCorruptError`` when it is damaged."""
    path = root / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IndexCorruptError(f"{path} is damaged (not valid JSON: {err}); {_rebuild_hint(None)}") from None
    if not isinstance(manifest, dict):
        raise IndexCorruptError(f"{path} is damaged (not a JSON object); {_rebuild_hint(None)}")
    if "checksum" in manifest:
        if manifest["checksum"] != _manifest_checksum(manifest):
            raise IndexCorruptError(f"{path} is damaged (its content does not match its checksum); {_rebuild_hint(None)}")
        return manifest
    identity = manifest.get("identity")
    version = identity.get("format_version") if isinstance(identity, dict) else None
    if isinstance(version, int) and version < FORMAT_VERSION:
        raise IndexMismatchError(
            f"{root} was written in index format {version}, which records no checksums (this version reads "
            f"{FORMAT_VERSION}); {_rebuild_hint(manifest)}"
        )
    raise IndexCorruptError(f"{path} is damaged (no checksum); {_rebuild_hint(None)}")


def _rebuild_hint(manifest: dict[str, Any] | None) -> str:
    """The command that rebuilds this index, with the inputs it was built from when known."""
    sources = (manifest or {}).get("sources") or {}
    flags = [f"{flag} {sources[key]}" for flag, key in (("-d", "dataset"), ("-m", "base_model"), ("-a", "adapter_path"))
             if sources.get(key) and not str(sources[key]).startswith("<")]
    command = "gradian index -c <its config> " + (" ".join(flags) if flags else "<the same inputs>")
    return (f"run `{command}` to recompute what is damaged, or the same with --force to rebuild the "
            "whole index")


# -- the store -----------------------------------------------------------------------------------

class GradientIndex:
    """An opened gradient store (read-only, memory-mapped chunk by chunk)."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self._norms: dict[str, np.ndarray] | None = None
        self._example_ids: list[str] | None = None
        #: chunks whose data file was hashed (or written) by this object
        self._verified: set[int] = set()
        #: True when ``build`` found every chunk stored and intact (no gradient computed)
        self.cache_hit = False
        #: files ``build`` found damaged or left over and replaced or removed
        self.repaired: list[str] = []

    # -- reading ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, expect: dict[str, Any] | None = None) -> "GradientIndex":
        """Open a complete store; with ``expect`` (an identity), refuse one built from other inputs.

        Raises ``IndexCorruptError`` when the manifest, example_ids.json or a norms file does not
        match its checksum, or a data file is missing or has the wrong size.
        """
        root = Path(path)
        manifest_path = root / "manifest.json"
        if not manifest_path.is_file():
            raise IndexMismatchError(f"{root} is not a gradient index (no manifest.json); build one with `gradian index`")
        manifest = _read_manifest(root)
        if expect is not None:
            _refuse_mismatch(root, manifest["identity"], expect)
        if manifest.get("status") != "complete":
            raise IndexMismatchError(
                f"{root}: the index build did not finish ({manifest.get('n_chunks_done', 0)} of "
                f"{manifest.get('n_chunks')} chunks); run `gradian index` again to resume it"
            )
        index = cls(root, manifest)
        problem = index._first_problem()
        if problem:
            raise IndexCorruptError(f"{problem}; {_rebuild_hint(manifest)}")
        return index

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
        if self._example_ids is None:
            path = self.root / "example_ids.json"
            problem = _ids_problem(path, self.manifest)
            if problem:
                raise IndexCorruptError(f"{problem}; {_rebuild_hint(self.manifest)}")
            self._example_ids = json.loads(path.read_text(encoding="utf-8"))
        return list(self._example_ids)

    @property
    def identity(self) -> dict[str, Any]:
        return self.manifest["identity"]

    def _chunk_path(self, k: int) -> Path:
        return self.root / "chunks" / f"{k:05d}.npy"

    def _norms_path(self, k: int) -> Path:
        return self.root / "chunks" / f"{k:05d}.norms.npy"

    def _record(self, k: int) -> dict[str, Any]:
        return self.manifest["chunks"][k]

    def iter_chunks(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``(start row, {block: [rows, width]})`` views of the memory-mapped chunks.

        The first call checks every data file against its recorded sha256 (in parallel threads)
        before it yields anything, so a damaged store produces no partial scores.
        """
        self._verify_data()
        size = int(self.manifest["chunk_size"])
        for k in range(int(self.manifest["n_chunks"])):
            data = np.load(self._chunk_path(k), mmap_mode="r")
            yield k * size, {b["name"]: data[:, b["offset"] : b["offset"] + b["width"]] for b in self.manifest["blocks"]}

    def _verify_data(self) -> None:
        todo = [k for k in range(int(self.manifest["n_chunks"])) if k not in self._verified]
        if not todo:
            return
        problems = _chunk_problems(self.root, {k: self._record(k) for k in todo})
        if problems:
            raise IndexCorruptError(f"{problems[min(problems)]}; {_rebuild_hint(self.manifest)}")
        self._verified.update(todo)

    def sq_norms(self) -> dict[str, np.ndarray]:
        if self._norms is None:
            parts = []
            for k in range(int(self.manifest["n_chunks"])):
                path = self._norms_path(k)
                problem = _file_problem(path, self._record(k)["norms_sha256"], self._record(k)["norms_bytes"])
                if problem:
                    raise IndexCorruptError(f"{problem}; {_rebuild_hint(self.manifest)}")
                parts.append(np.load(path))
            stacked = np.concatenate(parts, axis=0) if parts else np.zeros((0, len(self.block_names)))
            self._norms = {name: stacked[:, j] for j, name in enumerate(self.block_names)}
        return self._norms

    def block(self, name: str) -> np.ndarray:
        """One block's ``[n, width]`` gradients, read into memory (float32)."""
        return np.concatenate([chunk[name].astype(np.float32) for _, chunk in self.iter_chunks()], axis=0)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "chunks").glob("*.npy"))

    def verify(self) -> None:
        """Hash every file of the store now; ``IndexCorruptError`` names the first damaged one."""
        problem = self._first_problem()
        if problem:
            raise IndexCorruptError(f"{problem}; {_rebuild_hint(self.manifest)}")
        self._verify_data()

    def _first_problem(self) -> str | None:
        """The first damaged file among example_ids.json and the norms files (hashed, they are
        small) and the data files (present, of the recorded size; their bytes are hashed by
        ``_verify_data``)."""
        problem = _ids_problem(self.root / "example_ids.json", self.manifest)
        if problem:
            return problem
        for k in range(int(self.manifest["n_chunks"])):
            problem = _chunk_problem(self.root, k, self._record(k), hash_data=False)
            if problem:
                return problem
        return None

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def build(cls, gm: Any, tokenizer: Any, dataset: Any, config: Any, *, cache_dir: str | Path | None = None,
              force: bool = False, progress: Callable[[int, int], None] | None = None,
              shard: "ShardGroup | None" = None, extra_manifest: dict[str, Any] | None = None) -> "GradientIndex":
        """Index ``dataset`` under ``gm`` (a ``GradientModel``) with ``config`` (a ``GradianConfig``).

        Returns the stored index: straight from the cache when these inputs were indexed before
        and every file checks out (``index.cache_hit``), with only the missing or damaged chunks
        computed when a previous build was interrupted or a file was damaged since, fresh
        otherwise (or with ``force``). ``progress(done, total)`` is called before the first
        chunk computed and after each one; never on a cache hit.

        ``shard``, a ``gradian.distributed.ShardGroup`` of several processes, splits the work:
        every rank calls ``build`` with the same inputs, computes its contiguous share of the
        chunks to do, and rank 0 commits the manifest (``gradian.index.sharded``).

        ``extra_manifest``: more keys for the manifest of a fresh build (e.g. ``projection_auto``,
        the decision of ``gradian.index.sizing.auto_projection``); not part of the identity.
        """
        target = _target(gm, tokenizer, dataset, config, cache_dir)
        target.extra_manifest = dict(extra_manifest or {})
        if shard is not None and shard.world_size > 1:
            from gradian.index.sharded import build_sharded

            return build_sharded(cls, target, shard, force=force, progress=progress)
        with _build_lock(target.lock):
            if force and target.root.exists():
                shutil.rmtree(target.root)
            plan = _prepare(target)
            if plan.cached is not None:
                return cls._built(target.root, plan.cached, plan.good, plan.repaired, cache_hit=True)
            tokenized = _start(target, plan.manifest)
            manifest = plan.manifest
            manifest_path = target.root / "manifest.json"
            todo = [k for k in range(target.n_chunks) if k not in plan.good]
            rows_done = target.n - sum(target.chunk_rows(k) for k in todo)
            if progress:
                progress(rows_done, target.n)
            started = time.perf_counter()

            def record(k: int, chunk_record: dict[str, Any]) -> None:
                nonlocal rows_done
                manifest["chunks"][k] = chunk_record
                manifest["n_chunks_done"] = sum(1 for c in manifest["chunks"] if c is not None)
                _write_manifest(manifest_path, manifest)
                rows_done += target.chunk_rows(k)
                if progress:
                    progress(rows_done, target.n)

            _compute_chunks(target, todo, tokenized, record)
            _finish(target, manifest, time.perf_counter() - started)
            return cls._built(target.root, manifest, plan.good | set(todo), plan.repaired, cache_hit=False)

    @classmethod
    def _built(cls, root: Path, manifest: dict[str, Any], verified: set[int], repaired: list[str],
               cache_hit: bool) -> "GradientIndex":
        index = cls(root, manifest)
        index._verified.update(verified)
        index.cache_hit = cache_hit
        index.repaired = repaired
        return index


# -- building, step by step (the sharded build in gradian.index.sharded runs the same steps) --------

@dataclass
class _Target:
    """What one build indexes and where it goes."""

    root: Path
    lock: Path
    index_id: str
    identity: dict[str, Any]
    #: the manifest's blocks: name, shapes, dim, stored width and column offset
    blocks: list[dict[str, Any]]
    total_width: int
    gm: Any
    tokenizer: Any
    dataset: Any
    config: Any
    #: keys the manifest of a fresh build gets besides the computed ones
    extra_manifest: dict[str, Any] = _field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.dataset)

    @property
    def chunk_size(self) -> int:
        return int(self.config.grads.chunk_size)

    @property
    def n_chunks(self) -> int:
        return (self.n + self.chunk_size - 1) // self.chunk_size

    def chunk_rows(self, k: int) -> int:
        return min(self.chunk_size, self.n - k * self.chunk_size)


@dataclass
class _Plan:
    """What ``_prepare`` found: the manifest to build under, the chunks already whole, what it
    repaired, and the stored manifest itself when every chunk is whole and it is complete."""

    manifest: dict[str, Any]
    good: set[int]
    repaired: list[str]
    cached: dict[str, Any] | None


def _target(gm: Any, tokenizer: Any, dataset: Any, config: Any, cache_dir: str | Path | None) -> _Target:
    from gradian.grads import gradient_widths

    widths = gradient_widths(gm, config.grads)
    blocks, offset = [], 0
    for spec in gm.spec():
        blocks.append({**spec, "width": widths[spec["name"]], "offset": offset})
        offset += widths[spec["name"]]
    identity = index_identity(
        base_fingerprint=gm.fingerprints.get("base", "in-memory"),
        adapter_fingerprint=gm.fingerprints.get("adapter", "in-memory"),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        dataset_sha256=dataset.sha256, n_examples=len(dataset), config=config,
        blocks=[{k: b[k] for k in ("name", "shapes", "dim", "width")} for b in blocks],
        model_dtype=str(gm.dtype).replace("torch.", ""),
    )
    the_id = index_id(identity)
    parent = index_root(cache_dir or config.cache_dir)
    parent.mkdir(parents=True, exist_ok=True)
    return _Target(root=parent / the_id, lock=parent / f".{the_id}.lock", index_id=the_id, identity=identity,
                   blocks=blocks, total_width=offset, gm=gm, tokenizer=tokenizer, dataset=dataset, config=config)


def _prepare(target: _Target) -> _Plan:
    """Under the build lock: remove leftovers, read and check what is stored, drop what is damaged.

    The chunks counted whole are those the stored manifest records, or a chunk record beside its
    files records (what a sharded build's ranks leave until rank 0 commits), with every byte as
    recorded. Writes example_ids.json when it is missing or damaged, and nothing else; the caller
    writes the manifest (``_start``). On a cache hit, chunk records left by a commit that was cut
    short are removed.
    """
    root = target.root
    repaired = _remove_leftovers(root)
    manifest_path = root / "manifest.json"
    stored: dict[str, Any] | None = None
    if manifest_path.is_file():
        try:
            stored = _read_manifest(root)
        except IndexMismatchError:
            # without a trustworthy manifest no chunk can be checked: start over
            repaired.append(f"{manifest_path} (unreadable: the whole index was rebuilt)")
            shutil.rmtree(root)
            stored = None
    if stored is not None:
        _refuse_mismatch(root, stored["identity"], target.identity)

    grads = target.config.grads
    dataset = target.dataset
    n_chunks = target.n_chunks
    ids_bytes = json.dumps(dataset.ids).encode("utf-8")
    manifest = {
        "index_id": target.index_id,
        "status": "building",
        "identity": target.identity,
        "blocks": target.blocks,
        # LoRA modules of the adapter with no block (embedding, convolution, DoRA): not in the index
        "skipped_modules": list(getattr(target.gm, "skipped", [])),
        "n_examples": target.n,
        "chunk_size": target.chunk_size,
        "n_chunks": n_chunks,
        "n_chunks_done": 0,
        "chunks": [None] * n_chunks,
        "example_ids_sha256": _sha256_bytes(ids_bytes),
        "total_width": target.total_width,
        "storage_dtype": grads.storage_dtype,
        "sources": {"dataset": str(getattr(dataset, "path", "")), "base_model": target.config.base_model,
                    "adapter_path": target.config.adapter_path},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **target.extra_manifest,
    }
    if _ids_problem(root / "example_ids.json", manifest):
        if stored is not None and (root / "example_ids.json").exists():
            repaired.append(f"{root / 'example_ids.json'} was damaged: written again")
        write_bytes_atomic(root / "example_ids.json", ids_bytes)

    # which stored chunks are whole: recorded (in the manifest, else beside the chunk when the
    # manifest exists to vouch for the identity), and every byte as recorded
    recorded = _chunk_records(root, n_chunks) if stored is not None else {}
    recorded.update({k: record for k, record in enumerate(stored.get("chunks") or [])
                     if k < n_chunks and record is not None} if stored is not None else {})
    problems = _chunk_problems(root, recorded)
    good = set(recorded) - set(problems)
    for k in good:
        manifest["chunks"][k] = recorded[k]
    repaired += [f"{problems[k]}: computed again" for k in sorted(problems)]
    (root / "chunks").mkdir(parents=True, exist_ok=True)
    for path in (root / "chunks").glob("*.npy"):
        if int(path.name[:5]) not in good:
            path.unlink()
    manifest["n_chunks_done"] = len(good)
    cached = stored if (stored is not None and stored.get("status") == "complete" and len(good) == n_chunks) else None
    if cached is not None:
        _remove_chunk_records(root)
    return _Plan(manifest=manifest, good=good, repaired=repaired, cached=cached)


def _start(target: _Target, manifest: dict[str, Any]) -> list[Any]:
    """Record the build as started (``status: building`` with the chunks already whole) and return
    the tokenized dataset; chunk records beside the chunks are folded into that manifest, so
    they are removed once it is written."""
    from gradian.data import tokenize_examples

    _check_free_disk(target, [k for k, record in enumerate(manifest["chunks"]) if record is None])
    tokenized = tokenize_examples(target.dataset.examples, target.tokenizer, target.config.grads.max_seq_length)
    manifest["n_examples_without_supervision"] = sum(1 for t in tokenized if t.n_supervised == 0)
    _write_manifest(target.root / "manifest.json", manifest)
    _remove_chunk_records(target.root)
    return tokenized


def _finish(target: _Target, manifest: dict[str, Any], seconds: float) -> None:
    """Mark the build complete, with its time and size, in one atomic manifest write."""
    manifest["status"] = "complete"
    manifest["n_chunks_done"] = sum(1 for c in manifest["chunks"] if c is not None)
    manifest["build_seconds"] = round(seconds, 3)
    manifest["bytes"] = sum(p.stat().st_size for p in (target.root / "chunks").glob("*.npy"))
    manifest["bytes_per_example"] = manifest["bytes"] / max(target.n, 1)
    _write_manifest(target.root / "manifest.json", manifest)


def _compute_chunks(target: _Target, todo: list[int], tokenized: list[Any],
                    written: Callable[[int, dict[str, Any]], None]) -> None:
    """Capture and write chunks ``todo``, calling ``written(k, record)`` as each one lands.

    Each chunk is captured on its own, in batches that start at its first row, so a chunk's
    bytes depend on its rows alone (batches decide the padding, and padding can move the last
    bit of a float32 sum): a resumed build and every rank of a sharded one store exactly what a
    single uninterrupted build stores.
    """
    from gradian.grads import iter_example_gradients, make_projector

    grads = target.config.grads
    storage = _STORAGE[grads.storage_dtype]
    projector = make_projector(grads)
    names = [b["name"] for b in target.blocks]
    pad_id = target.tokenizer.pad_token_id
    for k in todo:
        first = k * target.chunk_size
        parts = [batch for _, batch in iter_example_gradients(
            target.gm, tokenized[first : first + target.chunk_rows(k)], grads, pad_id, projector=projector)]
        rows = {b: np.concatenate([part[b] for part in parts], axis=0) for b in names}
        try:
            written(k, _write_chunk(target.root, k, rows, storage))
        except OSError as err:
            if err.errno not in _DISK_FULL:
                raise
            raise _disk_filled_up(target, todo, k) from None


# -- disk space ------------------------------------------------------------------------------------

#: errnos of a write refused for space: the disk is full, or the user's quota is
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
#: bytes of an .npy header: a 2-d array's header is padded to 128 bytes
_NPY_HEADER = 128


def _chunk_bytes(target: _Target, k: int) -> int:
    """Bytes chunk ``k`` takes on disk: its data file (rows x total width in storage_dtype) and its
    norms file (rows x blocks float64)."""
    rows = target.chunk_rows(k)
    itemsize = np.dtype(_STORAGE[target.config.grads.storage_dtype]).itemsize
    return 2 * _NPY_HEADER + rows * target.total_width * itemsize + rows * len(target.blocks) * 8


def _cache_dir(target: _Target) -> Path:
    return target.root.parent.parent  # <cache_dir>/index/<index_id>


def _shrink_hint(target: _Target) -> str:
    grads = target.config.grads
    ways = ["set cache_dir to a folder on a bigger disk"]
    if grads.storage_dtype != "float16":
        ways.append("set grads.storage_dtype: float16 (half the bytes)")
    if not grads.projection_dim:
        ways.append("set grads.projection_dim with engine.name: datainf (a fixed width per block)")
    ways.append("`gradian plan --disk <size>` proposes settings that fit a size")
    return "; ".join(ways)


def _check_free_disk(target: _Target, todo: list[int]) -> None:
    """Refuse a build whose missing chunks need more bytes than the cache folder's disk has free
    (chunks already stored are not counted: they stay)."""
    from gradian.plan.planner import format_size

    need = sum(_chunk_bytes(target, k) for k in todo)
    free = shutil.disk_usage(target.root).free
    if need <= free:
        return
    kept = target.n_chunks - len(todo)
    raise DiskFullError(
        f"not enough free disk for the gradient index under cache_dir {_cache_dir(target)}: its "
        f"{len(todo)} chunk(s) still to compute need {format_size(need)} ({target.n} examples x "
        f"{target.total_width} values in {target.config.grads.storage_dtype}"
        + (f", {kept} chunk(s) already stored" if kept else "")
        + f") and {format_size(free)} is free; nothing was computed. Free space, or {_shrink_hint(target)}"
    )


def _disk_filled_up(target: _Target, todo: list[int], k: int) -> DiskFullError:
    """The error of a disk that filled up while chunk ``k`` was written. The chunk's files are
    removed (whatever landed of them; the atomic write already removed its .tmp), so the folder
    holds only chunks that are whole and recorded."""
    from gradian.plan.planner import format_size

    for path in (target.root / "chunks" / f"{k:05d}.npy", target.root / "chunks" / f"{k:05d}.norms.npy"):
        path.unlink(missing_ok=True)
    left = todo[todo.index(k):]
    kept = target.n_chunks - len(left)
    free = shutil.disk_usage(target.root).free
    return DiskFullError(
        f"the disk under cache_dir {_cache_dir(target)} filled up while chunk {k} of the gradient index "
        f"{target.root} was written: the partial chunk was removed and the {kept} of {target.n_chunks} chunks "
        f"already written are kept; free {format_size(sum(_chunk_bytes(target, j) for j in left))} for the "
        f"{len(left)} chunk(s) left ({format_size(free)} is free now) and run the same command again to resume "
        f"from them, or {_shrink_hint(target)}"
    )


def _write_chunk(root: Path, k: int, rows: dict[str, np.ndarray], storage: Any) -> dict[str, Any]:
    """Write chunk ``k`` (norms first, data last) and return its manifest record: row count, and
    the sha256 and size of both files, hashed from the bytes written."""
    data = np.concatenate([rows[b].astype(storage) for b in rows], axis=1)
    norms = np.stack([np.einsum("ij,ij->i", v, v, dtype=np.float64)
                      for v in (rows[b].astype(storage).astype(np.float64) for b in rows)], axis=1)
    data_bytes, norms_bytes = _npy_bytes(data), _npy_bytes(norms)
    write_bytes_atomic(root / "chunks" / f"{k:05d}.norms.npy", norms_bytes)
    write_bytes_atomic(root / "chunks" / f"{k:05d}.npy", data_bytes)
    return {"rows": int(data.shape[0]), "sha256": _sha256_bytes(data_bytes), "bytes": len(data_bytes),
            "norms_sha256": _sha256_bytes(norms_bytes), "norms_bytes": len(norms_bytes)}


# -- chunk records: a chunk's manifest entry beside it, until the manifest takes it in ----------------

def _chunk_record_path(root: Path, k: int) -> Path:
    return root / "chunks" / f"{k:05d}.record.json"


def _write_chunk_record(root: Path, k: int, record: dict[str, Any]) -> None:
    """Record chunk ``k`` beside its files (after them), checksummed like the manifest; a sharded
    build's rank writes these instead of the manifest, which only rank 0 writes."""
    payload = {"chunk": k, "record": record}
    payload["checksum"] = _manifest_checksum(payload)
    write_text_atomic(_chunk_record_path(root, k), json.dumps(payload))


def _chunk_records(root: Path, n_chunks: int) -> dict[int, dict[str, Any]]:
    """``{chunk: record}`` from the chunk records found; an unreadable one is ignored (its chunk
    is then computed again)."""
    found: dict[int, dict[str, Any]] = {}
    for path in sorted((root / "chunks").glob("?????.record.json")):
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            k = int(path.name[:5])
            if payload.get("checksum") == _manifest_checksum(payload) and payload.get("chunk") == k < n_chunks:
                found[k] = payload["record"]
        except (OSError, ValueError, AttributeError, KeyError):
            continue
    return found


def _remove_chunk_records(root: Path) -> None:
    for path in (root / "chunks").glob("?????.record.json"):
        path.unlink(missing_ok=True)


# -- checks ----------------------------------------------------------------------------------------

def _file_problem(path: Path, sha256: str, size: int, hash_data: bool = True) -> str | None:
    """Why ``path`` is not the file recorded (missing, wrong size, other bytes), or ``None``."""
    if not path.is_file():
        return f"{path} is missing"
    actual = path.stat().st_size
    if actual != size:
        return f"{path} is damaged ({actual} bytes, {size} were written: truncated or overwritten)"
    if hash_data and _sha256_file(path) != sha256:
        return f"{path} is damaged (its bytes do not match the sha256 recorded when it was written)"
    return None


def _chunk_problem(root: Path, k: int, record: dict[str, Any] | None, hash_data: bool) -> str | None:
    data, norms = root / "chunks" / f"{k:05d}.npy", root / "chunks" / f"{k:05d}.norms.npy"
    if record is None:
        return f"{data} was never completed"
    return (_file_problem(norms, record["norms_sha256"], record["norms_bytes"])
            or _file_problem(data, record["sha256"], record["bytes"], hash_data=hash_data))


def _chunk_problems(root: Path, records: dict[int, dict[str, Any]]) -> dict[int, str]:
    """``{chunk: problem}`` for the chunks in ``records`` whose files are not as recorded, every
    byte hashed. Threads: hashlib releases the GIL on large buffers, so this runs at the speed of
    the disk or of several cores' sha256, not one."""
    from concurrent.futures import ThreadPoolExecutor

    if not records:
        return {}
    workers = max(1, min(len(records), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = dict(zip(records, pool.map(lambda k: _chunk_problem(root, k, records[k], hash_data=True), records)))
    return {k: problem for k, problem in found.items() if problem}


def _ids_problem(path: Path, manifest: dict[str, Any]) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    if _sha256_file(path) != manifest["example_ids_sha256"]:
        return f"{path} is damaged (its bytes do not match the sha256 recorded when it was written)"
    return None


def _remove_leftovers(root: Path) -> list[str]:
    """Delete the ``.tmp`` files a killed atomic write leaves beside its target."""
    removed = []
    for pattern in (".*.tmp", "chunks/.*.tmp"):
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)
            removed.append(f"{path} (left by an interrupted write, removed)")
    return removed


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` for the duration of one index build (a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: builds of one index are not serialized
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _refuse_mismatch(root: Path, stored: dict[str, Any], given: dict[str, Any]) -> None:
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


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
