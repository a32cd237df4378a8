"""Building a gradient index, step by step: the target, the plan, the chunks, the disk, the lock.

Interface: ``build_target(gm, tokenizer, dataset, config, cache_dir) -> BuildTarget`` (what one
build indexes and where it goes), then, under ``build_lock(target.lock)``: ``prepare_build``
(leftovers removed, what is stored checked, the damaged dropped: a ``BuildPlan``), ``start_build``
(free disk checked, the dataset tokenized, ``status: building`` recorded), ``compute_chunks`` (each
missing chunk captured and written, reported as it lands) and ``finish_build``. ``build_local``
runs those steps in one process and returns a ``BuiltIndex``; the sharded build
(``gradian.index.sharded``) runs the same steps over several. Chunk records
(``write_chunk_record``, ``chunk_records``, ``remove_chunk_records``) hold a chunk's manifest entry
beside it until the manifest takes it in. ``index_root(cache_dir)`` is where stores live.

Repairs: whatever ``prepare_build`` finds damaged or left over and replaces or removes is one
repair record, ``{"file", "problem", "action", "at"}`` (``"chunk"`` too for a chunk's file), in
``BuildPlan.repairs`` and ``BuiltIndex.repairs``, and appended to the manifest's ``repairs`` list
(the latest ``MAX_REPAIRS`` kept), so the store itself says it was repaired. ``repair_note`` is
one record in words, ``repair_summary`` the one line a command prints for a build's records.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as _field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypedDict

import numpy as np

from gradian.atomic import write_bytes_atomic, write_text_atomic
from gradian.errors import DiskFullError, IndexMismatchError
from gradian.index.integrity import (
    chunk_faults,
    ids_fault,
    manifest_checksum,
    npy_bytes,
    read_manifest,
    refuse_mismatch,
    sha256_bytes,
    write_manifest,
)
from gradian.index.manifest import ChunkRecord, ManifestBlock, index_id, index_identity, tokenizer_fingerprint
from gradian.sizes import format_size

if TYPE_CHECKING:
    import numpy.typing as npt
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset, TokenizedExample
    from gradian.grads import BlockProjector, GradientModel
    from gradian.grads.projection import KroneckerProjector

__all__ = ["BuildPlan", "BuildTarget", "BuiltIndex", "MAX_REPAIRS", "RepairRecord", "build_local", "build_lock",
           "build_target",
           "capture_rows", "chunk_records", "compute_chunks", "finish_build", "index_root", "prepare_build", "remove_chunk_records",
           "repair_note", "repair_summary", "start_build", "stored_norms", "write_chunk_record"]


class _RepairFields(TypedDict):
    file: str
    problem: str
    action: str
    at: str


class RepairRecord(_RepairFields, total=False):
    """One repair (see the module's docstring): the file, what was wrong, what was done and when; the
    chunk too for a chunk's file."""

    chunk: int


@dataclass
class BuiltIndex:
    """What a build leaves: the store's folder and manifest, the chunks whose bytes were checked
    or written by it, what it repaired (repair records, see the module's docstring), and whether
    everything came from the cache."""

    root: Path
    manifest: dict[str, Any]
    verified: set[int]
    repairs: list[RepairRecord]
    cache_hit: bool

    @property
    def repaired(self) -> list[str]:
        """This build's repairs in words, one a file (``repair_note``)."""
        return [repair_note(r) for r in self.repairs]


#: repair records a manifest keeps, the latest (a disk that damaged every chunk is not listed whole)
MAX_REPAIRS = 100


def _repair(path: Path, problem: str, action: str, chunk: int | None = None) -> RepairRecord:
    at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if chunk is None:
        return {"file": str(path), "problem": problem, "action": action, "at": at}
    return {"file": str(path), "problem": problem, "action": action, "chunk": chunk, "at": at}


def repair_note(repair: RepairRecord, root: Path | None = None) -> str:
    """One repair record in words: ``<file> was <problem>: <action>``, the file relative to
    ``root`` when it lies under it."""
    path = Path(repair["file"])
    if root is not None and path.is_relative_to(root):
        path = path.relative_to(root)
    return f"{path} was {repair['problem']}: {repair['action']}"


def repair_summary(index_id: str, root: Path, repairs: Sequence[RepairRecord], shown: int = 3) -> str:
    """The line a command prints after a build that repaired ``repairs``: which files, what was
    wrong and what was done, the first ``shown`` of them (the manifest lists them all)."""
    notes = [repair_note(r, root) for r in repairs]
    more = len(notes) - shown
    tail = f"; and {more} more (listed under 'repairs' in {root / 'manifest.json'})" if more > 0 else ""
    return f"repaired index {index_id}: " + "; ".join(notes[:shown]) + tail


_STORAGE = {"float32": np.float32, "float16": np.float16}


def index_root(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "index"


@dataclass
class BuildTarget:
    """What one build indexes and where it goes."""

    root: Path
    lock: Path
    index_id: str
    identity: dict[str, object]
    #: the manifest's blocks: name, shapes, dim, stored width and column offset
    blocks: list[ManifestBlock]
    total_width: int
    gm: GradientModel
    tokenizer: PreTrainedTokenizerBase
    dataset: Dataset
    config: GradianConfig
    #: keys the manifest of a fresh build gets besides the computed ones
    extra_manifest: dict[str, object] = _field(default_factory=dict)

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
class BuildPlan:
    """What ``prepare_build`` found: the manifest to build under, the chunks already whole, what it
    repaired (repair records), and the stored manifest itself when every chunk is whole and it is
    complete."""

    manifest: dict[str, Any]
    good: set[int]
    repairs: list[RepairRecord]
    cached: dict[str, Any] | None


def build_target(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset, config: GradianConfig,
                 cache_dir: str | Path | None,
                 make_dirs: bool = True) -> BuildTarget:
    """What a build of ``dataset`` under ``gm`` indexes, and where; ``make_dirs`` false leaves the
    disk untouched (a stream computes the same id without writing anything)."""
    from gradian.grads import gradient_widths

    widths = gradient_widths(gm, config.grads)
    blocks: list[ManifestBlock] = []
    offset = 0
    for spec in gm.spec():
        blocks.append({**spec, "width": widths[spec["name"]], "offset": offset})
        offset += widths[spec["name"]]
    identity = index_identity(
        base_fingerprint=gm.fingerprints.get("base", "in-memory"),
        adapter_fingerprint=gm.fingerprints.get("adapter", "in-memory"),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        dataset_sha256=dataset.sha256, n_examples=len(dataset), config=config,
        blocks=[{"name": b["name"], "shapes": b["shapes"], "dim": b["dim"], "width": b["width"]} for b in blocks],
        model_dtype=str(gm.dtype).replace("torch.", ""),
    )
    the_id = index_id(identity)
    parent = index_root(cache_dir or config.cache_dir)
    if make_dirs:
        parent.mkdir(parents=True, exist_ok=True)
    return BuildTarget(root=parent / the_id, lock=parent / f".{the_id}.lock", index_id=the_id, identity=identity,
                   blocks=blocks, total_width=offset, gm=gm, tokenizer=tokenizer, dataset=dataset, config=config)


def prepare_build(target: BuildTarget) -> BuildPlan:
    """Under the build lock: remove leftovers, read and check what is stored, drop what is damaged.

    The chunks counted whole are those the stored manifest records, or a chunk record beside its
    files records (what a sharded build's ranks leave until rank 0 commits), with every byte as
    recorded. Writes example_ids.json when it is missing or damaged; the caller writes the
    manifest (``start_build``), except on a cache hit: then chunk records left by a commit that was
    cut short are removed, and the stored manifest is written again when something was repaired,
    so its ``repairs`` list says so. Every repair is a record in ``BuildPlan.repairs`` and in the
    manifest's ``repairs`` (after those of earlier builds of the store).
    """
    root = target.root
    repairs = _remove_leftovers(root)
    manifest_path = root / "manifest.json"
    stored: dict[str, Any] | None = None
    if manifest_path.is_file():
        try:
            stored = read_manifest(root)
        except IndexMismatchError as err:
            # without a trustworthy manifest no chunk can be checked: start over
            repairs.append(_repair(manifest_path, _manifest_fault(root, err),
                                   "the whole index was rebuilt (no chunk could be checked without it)"))
            shutil.rmtree(root)
            stored = None
    if stored is not None:
        refuse_mismatch(root, stored["identity"], target.identity)

    grads = target.config.grads
    dataset = target.dataset
    n_chunks = target.n_chunks
    ids_bytes = json.dumps(dataset.ids).encode("utf-8")
    manifest: dict[str, Any] = {
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
        "example_ids_sha256": sha256_bytes(ids_bytes),
        "total_width": target.total_width,
        "storage_dtype": grads.storage_dtype,
        "sources": {"dataset": str(getattr(dataset, "path", "")), "base_model": target.config.base_model,
                    "adapter_path": target.config.adapter_path},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **target.extra_manifest,
    }
    ids_wrong = ids_fault(root / "example_ids.json", manifest)
    if ids_wrong:
        if stored is not None:
            repairs.append(_repair(root / "example_ids.json", ids_wrong, "written again from the dataset"))
        write_bytes_atomic(root / "example_ids.json", ids_bytes)

    # which stored chunks are whole: recorded (in the manifest, else beside the chunk when the
    # manifest exists to vouch for the identity), and every byte as recorded
    recorded = chunk_records(root, n_chunks) if stored is not None else {}
    recorded.update({k: record for k, record in enumerate(stored.get("chunks") or [])
                     if k < n_chunks and record is not None} if stored is not None else {})
    faults = chunk_faults(root, recorded)
    good = set(recorded) - set(faults)
    for k in good:
        manifest["chunks"][k] = recorded[k]
    repairs += [_repair(faults[k][0], faults[k][1], f"recomputed (chunk {k}: its data and norms files)", chunk=k)
                for k in sorted(faults)]
    (root / "chunks").mkdir(parents=True, exist_ok=True)
    for path in (root / "chunks").glob("*.npy"):
        if int(path.name[:5]) not in good:
            path.unlink()
    manifest["n_chunks_done"] = len(good)
    # the repairs of earlier builds of this store stay on record, this build's after them
    history = list(stored.get("repairs") or []) if stored is not None else []
    manifest["repairs"] = (history + repairs)[-MAX_REPAIRS:]
    cached = stored if (stored is not None and stored.get("status") == "complete" and len(good) == n_chunks) else None
    if cached is not None:
        remove_chunk_records(root)
        if repairs:
            cached["repairs"] = manifest["repairs"]
            write_manifest(manifest_path, cached)
    return BuildPlan(manifest=manifest, good=good, repairs=repairs, cached=cached)


def _manifest_fault(root: Path, err: Exception) -> str:
    """What ``read_manifest``'s error says is wrong with the manifest, without its path and the
    rebuild hint: ``damaged (its content does not match its checksum)`` and the like."""
    text = str(err).split("; run `", 1)[0]
    for prefix in (f"{root / 'manifest.json'} is ", f"{root} "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def start_build(target: BuildTarget, manifest: dict[str, Any]) -> list[TokenizedExample]:
    """Record the build as started (``status: building`` with the chunks already whole) and return
    the tokenized dataset; chunk records beside the chunks are folded into that manifest, so
    they are removed once it is written."""
    from gradian.data import tokenize_examples

    _check_free_disk(target, [k for k, record in enumerate(manifest["chunks"]) if record is None])
    tokenized = tokenize_examples(target.dataset.examples, target.tokenizer, target.config.grads.max_seq_length)
    manifest["n_examples_without_supervision"] = sum(1 for t in tokenized if t.n_supervised == 0)
    write_manifest(target.root / "manifest.json", manifest)
    remove_chunk_records(target.root)
    return tokenized


def finish_build(target: BuildTarget, manifest: dict[str, Any], seconds: float) -> None:
    """Mark the build complete, with its time and size, in one atomic manifest write."""
    manifest["status"] = "complete"
    manifest["n_chunks_done"] = sum(1 for c in manifest["chunks"] if c is not None)
    manifest["build_seconds"] = round(seconds, 3)
    manifest["bytes"] = sum(p.stat().st_size for p in (target.root / "chunks").glob("*.npy"))
    manifest["bytes_per_example"] = manifest["bytes"] / max(target.n, 1)
    write_manifest(target.root / "manifest.json", manifest)


def compute_chunks(target: BuildTarget, todo: list[int], tokenized: Sequence[TokenizedExample],
                    written: Callable[[int, ChunkRecord], None]) -> None:
    """Capture and write chunks ``todo``, calling ``written(k, record)`` as each one lands.

    Each chunk is captured on its own, in batches that start at its first row, so a chunk's
    bytes depend on its rows alone (batches decide the padding, and padding can move the last
    bit of a float32 sum): a resumed build and every rank of a sharded one store exactly what a
    single uninterrupted build stores.
    """
    from gradian.grads import make_projector

    grads = target.config.grads
    storage = _STORAGE[grads.storage_dtype]
    projector = make_projector(grads, target.gm)
    for k in todo:
        first = k * target.chunk_size
        rows = capture_rows(target, tokenized[first : first + target.chunk_rows(k)], projector)
        try:
            written(k, _write_chunk(target.root, k, rows, storage))
        except OSError as err:
            if err.errno not in _DISK_FULL:
                raise
            raise _disk_filled_up(target, todo, k) from None


def capture_rows(target: BuildTarget, rows: Sequence[TokenizedExample],
                 projector: BlockProjector | KroneckerProjector | None) -> dict[str, np.ndarray]:
    """``{block: [len(rows), width]}``: the per-example gradients of ``rows`` (tokenized, batched
    from the first) under ``target.gm``, in the store's dtype: what a chunk holds. The index build
    and a stream (``gradian.index.stream``) both capture through it, so they hold the same numbers."""
    from gradian.grads import iter_example_gradients

    grads = target.config.grads
    parts = [batch for _, batch in iter_example_gradients(target.gm, rows, grads, target.tokenizer.pad_token_id,
                                                          projector=projector)]
    storage = _STORAGE[grads.storage_dtype]
    return {b["name"]: np.concatenate([part[b["name"]] for part in parts], axis=0).astype(storage)
            for b in target.blocks}


def stored_norms(rows: dict[str, np.ndarray], storage: npt.DTypeLike) -> dict[str, np.ndarray]:
    """``{block: [rows]}`` float64 squared norms of the values as stored in ``storage``."""
    return {b: np.einsum("ij,ij->i", v, v, dtype=np.float64)
            for b, v in ((b, rows[b].astype(storage).astype(np.float64)) for b in rows)}


#: errnos of a write refused for space: the disk is full, or the user's quota is
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


#: bytes of an .npy header: a 2-d array's header is padded to 128 bytes
_NPY_HEADER = 128


def _chunk_bytes(target: BuildTarget, k: int) -> int:
    """Bytes chunk ``k`` takes on disk: its data file (rows x total width in storage_dtype) and its
    norms file (rows x blocks float64)."""
    rows = target.chunk_rows(k)
    itemsize = np.dtype(_STORAGE[target.config.grads.storage_dtype]).itemsize
    return 2 * _NPY_HEADER + rows * target.total_width * itemsize + rows * len(target.blocks) * 8


def _cache_dir(target: BuildTarget) -> Path:
    return target.root.parent.parent  # <cache_dir>/index/<index_id>


def _shrink_hint(target: BuildTarget) -> str:
    grads = target.config.grads
    ways = ["set cache_dir to a folder on a bigger disk"]
    if grads.storage_dtype != "float16":
        ways.append("set grads.storage_dtype: float16 (half the bytes)")
    if not grads.projection_dim:
        ways.append("set grads.projection_dim with engine.name: datainf (a fixed width per block)")
    ways.append("`gradian plan --disk <size>` proposes settings that fit a size")
    return "; ".join(ways)


def _check_free_disk(target: BuildTarget, todo: list[int]) -> None:
    """Refuse a build whose missing chunks need more bytes than the cache folder's disk has free
    (chunks already stored are not counted: they stay)."""
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


def _disk_filled_up(target: BuildTarget, todo: list[int], k: int) -> DiskFullError:
    """The error of a disk that filled up while chunk ``k`` was written. The chunk's files are
    removed (whatever landed of them; the atomic write already removed its .tmp), so the folder
    holds only chunks that are whole and recorded."""
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


def _write_chunk(root: Path, k: int, rows: dict[str, np.ndarray], storage: npt.DTypeLike) -> ChunkRecord:
    """Write chunk ``k`` (norms first, data last) and return its manifest record: row count, and
    the sha256 and size of both files, hashed from the bytes written."""
    data = np.concatenate([rows[b].astype(storage) for b in rows], axis=1)
    norms = np.stack(list(stored_norms(rows, storage).values()), axis=1)
    data_bytes, norms_bytes = npy_bytes(data), npy_bytes(norms)
    write_bytes_atomic(root / "chunks" / f"{k:05d}.norms.npy", norms_bytes)
    write_bytes_atomic(root / "chunks" / f"{k:05d}.npy", data_bytes)
    return {"rows": int(data.shape[0]), "sha256": sha256_bytes(data_bytes), "bytes": len(data_bytes),
            "norms_sha256": sha256_bytes(norms_bytes), "norms_bytes": len(norms_bytes)}


def _chunk_record_path(root: Path, k: int) -> Path:
    return root / "chunks" / f"{k:05d}.record.json"


def write_chunk_record(root: Path, k: int, record: ChunkRecord) -> None:
    """Record chunk ``k`` beside its files (after them), checksummed like the manifest; a sharded
    build's rank writes these instead of the manifest, which only rank 0 writes."""
    payload = {"chunk": k, "record": record}
    payload["checksum"] = manifest_checksum(payload)
    write_text_atomic(_chunk_record_path(root, k), json.dumps(payload))


def chunk_records(root: Path, n_chunks: int) -> dict[int, ChunkRecord]:
    """``{chunk: record}`` from the chunk records found; an unreadable one is ignored (its chunk
    is then computed again)."""
    found: dict[int, ChunkRecord] = {}
    for path in sorted((root / "chunks").glob("?????.record.json")):
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            k = int(path.name[:5])
            if payload.get("checksum") == manifest_checksum(payload) and payload.get("chunk") == k < n_chunks:
                found[k] = payload["record"]
        except (OSError, ValueError, AttributeError, KeyError):
            continue
    return found


def remove_chunk_records(root: Path) -> None:
    for path in (root / "chunks").glob("?????.record.json"):
        path.unlink(missing_ok=True)


def _remove_leftovers(root: Path) -> list[RepairRecord]:
    """Delete the ``.tmp`` files a killed atomic write leaves beside its target; a repair record each."""
    removed = []
    for pattern in (".*.tmp", "chunks/.*.tmp"):
        for path in root.glob(pattern):
            path.unlink(missing_ok=True)
            removed.append(_repair(path, "left by an interrupted write", "removed"))
    return removed


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
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


def build_local(target: BuildTarget, force: bool = False,
                progress: Callable[[int, int], None] | None = None) -> BuiltIndex:
    """Build ``target`` in this process: only the chunks not stored whole are computed."""
    with build_lock(target.lock):
            if force and target.root.exists():
                shutil.rmtree(target.root)
            plan = prepare_build(target)
            if plan.cached is not None:
                return BuiltIndex(target.root, plan.cached, plan.good, plan.repairs, cache_hit=True)
            tokenized = start_build(target, plan.manifest)
            manifest = plan.manifest
            manifest_path = target.root / "manifest.json"
            todo = [k for k in range(target.n_chunks) if k not in plan.good]
            rows_done = target.n - sum(target.chunk_rows(k) for k in todo)
            if progress:
                progress(rows_done, target.n)
            started = time.perf_counter()

            def record(k: int, chunk_record: ChunkRecord) -> None:
                nonlocal rows_done
                manifest["chunks"][k] = chunk_record
                manifest["n_chunks_done"] = sum(1 for c in manifest["chunks"] if c is not None)
                write_manifest(manifest_path, manifest)
                rows_done += target.chunk_rows(k)
                if progress:
                    progress(rows_done, target.n)

            compute_chunks(target, todo, tokenized, record)
            finish_build(target, manifest, time.perf_counter() - started)
            return BuiltIndex(target.root, manifest, plan.good | set(todo), plan.repairs, cache_hit=False)
