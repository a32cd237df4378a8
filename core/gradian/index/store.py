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
  removed. Every such repair is said (``log``, else a warning on the ``gradian.index`` logger,
  which Python prints on stderr when logging is not set up), kept as ``index.repairs`` (records
  ``{file, problem, action, at}``; ``index.repaired`` in words) and appended to the manifest's
  ``repairs`` list, so the store, and the report that embeds its manifest, say so too. Two
  builds of one index id take turns on the lock: the second finds the first one's work and
  returns it as a cache hit.

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

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from gradian.errors import IndexCorruptError, IndexMismatchError
from gradian.index.build import (BuiltIndex, RepairRecord, build_local, build_target, index_root, repair_note,
                                 repair_summary)
from gradian.index.integrity import chunk_problem, chunk_problems, file_problem, ids_problem, read_manifest, rebuild_hint, refuse_mismatch
from gradian.index.manifest import ChunkRecord
from gradian.index.sharded import build_sharded

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset
    from gradian.distributed import ShardGroup
    from gradian.grads import GradientModel

__all__ = ["GradientIndex", "index_root"]

_STORAGE = {"float32": np.float32, "float16": np.float16}

_log = logging.getLogger("gradian.index")


class GradientIndex:
    """An opened gradient store (read-only, memory-mapped chunk by chunk)."""

    store = "index"

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self._norms: dict[str, np.ndarray] | None = None
        self._example_ids: list[str] | None = None
        #: chunks whose data file was hashed (or written) by this object
        self._verified: set[int] = set()
        #: True when ``build`` found every chunk stored and intact (no gradient computed)
        self.cache_hit = False
        #: what ``build`` found damaged or left over and replaced or removed: one record a file,
        #: ``{"file", "problem", "action", "at"}`` (and ``"chunk"`` for a chunk's file)
        self.repairs: list[RepairRecord] = []

    # -- reading ------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, expect: Mapping[str, object] | None = None) -> "GradientIndex":
        """Open a complete store; with ``expect`` (an identity), refuse one built from other inputs.

        Raises ``IndexCorruptError`` when the manifest, example_ids.json or a norms file does not
        match its checksum, or a data file is missing or has the wrong size.
        """
        root = Path(path)
        manifest_path = root / "manifest.json"
        if not manifest_path.is_file():
            raise IndexMismatchError(f"{root} is not a gradient index (no manifest.json); build one with `gradian index`")
        manifest = read_manifest(root)
        if expect is not None:
            refuse_mismatch(root, manifest["identity"], expect)
        if manifest.get("status") != "complete":
            raise IndexMismatchError(
                f"{root}: the index build did not finish ({manifest.get('n_chunks_done', 0)} of "
                f"{manifest.get('n_chunks')} chunks); run `gradian index` again to resume it"
            )
        index = cls(root, manifest)
        problem = index._first_problem()
        if problem:
            raise IndexCorruptError(f"{problem}; {rebuild_hint(manifest)}")
        return index

    @property
    def repaired(self) -> list[str]:
        """``repairs`` in words, one a file: ``<file> was <problem>: <action>``."""
        return [repair_note(r) for r in self.repairs]

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
            problem = ids_problem(path, self.manifest)
            if problem:
                raise IndexCorruptError(f"{problem}; {rebuild_hint(self.manifest)}")
            self._example_ids = json.loads(path.read_text(encoding="utf-8"))
        return list(self._example_ids)

    @property
    def identity(self) -> Mapping[str, object]:
        return self.manifest["identity"]

    def _chunk_path(self, k: int) -> Path:
        return self.root / "chunks" / f"{k:05d}.npy"

    def _norms_path(self, k: int) -> Path:
        return self.root / "chunks" / f"{k:05d}.norms.npy"

    def _record(self, k: int) -> ChunkRecord:
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
        problems = chunk_problems(self.root, {k: self._record(k) for k in todo})
        if problems:
            raise IndexCorruptError(f"{problems[min(problems)]}; {rebuild_hint(self.manifest)}")
        self._verified.update(todo)

    def sq_norms(self) -> dict[str, np.ndarray]:
        if self._norms is None:
            parts = []
            for k in range(int(self.manifest["n_chunks"])):
                path = self._norms_path(k)
                problem = file_problem(path, self._record(k)["norms_sha256"], self._record(k)["norms_bytes"])
                if problem:
                    raise IndexCorruptError(f"{problem}; {rebuild_hint(self.manifest)}")
                parts.append(np.load(path))
            stacked = np.concatenate(parts, axis=0) if parts else np.zeros((0, len(self.block_names)))
            self._norms = {name: stacked[:, j] for j, name in enumerate(self.block_names)}
        return self._norms

    @property
    def chunk_size(self) -> int:
        return int(self.manifest["chunk_size"])

    @property
    def widths(self) -> dict[str, int]:
        return {b["name"]: int(b["width"]) for b in self.manifest["blocks"]}

    def rows(self, indices: Iterable[int]) -> dict[str, np.ndarray]:
        """``{block: [len(indices), width]}`` of the rows asked for, in that order, read from their
        chunks (each chunk checked against its sha256 first, as ``iter_chunks`` does)."""
        self._verify_data()
        wanted = np.asarray(list(indices), dtype=np.int64)
        bad = wanted[(wanted < 0) | (wanted >= self.n)]
        if len(bad):
            raise IndexError(f"row {int(bad[0])} is not in the index ({self.n} rows)")
        size = self.chunk_size
        out = {b["name"]: np.zeros((len(wanted), int(b["width"])), dtype=_STORAGE[self.manifest["storage_dtype"]])
               for b in self.manifest["blocks"]}
        for k in sorted(set((wanted // size).tolist())):
            data = np.load(self._chunk_path(k), mmap_mode="r")
            slots = np.flatnonzero(wanted // size == k)
            for b in self.manifest["blocks"]:
                out[b["name"]][slots] = data[wanted[slots] - k * size, b["offset"]: b["offset"] + b["width"]]
        return out

    def block(self, name: str) -> np.ndarray:
        """One block's ``[n, width]`` gradients, read into memory (float32)."""
        return np.concatenate([chunk[name].astype(np.float32) for _, chunk in self.iter_chunks()], axis=0)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "chunks").glob("*.npy"))

    def verify(self) -> None:
        """Hash every file of the store now; ``IndexCorruptError`` names the first damaged one."""
        problem = self._first_problem()
        if problem:
            raise IndexCorruptError(f"{problem}; {rebuild_hint(self.manifest)}")
        self._verify_data()

    def _first_problem(self) -> str | None:
        """The first damaged file among example_ids.json and the norms files (hashed, they are
        small) and the data files (present, of the recorded size; their bytes are hashed by
        ``_verify_data``)."""
        problem = ids_problem(self.root / "example_ids.json", self.manifest)
        if problem:
            return problem
        for k in range(int(self.manifest["n_chunks"])):
            problem = chunk_problem(self.root, k, self._record(k), hash_data=False)
            if problem:
                return problem
        return None

    # -- building -----------------------------------------------------------------------------

    @classmethod
    def build(cls, gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset, config: GradianConfig, *,
              cache_dir: str | Path | None = None,
              force: bool = False, progress: Callable[[int, int], None] | None = None,
              shard: "ShardGroup | None" = None, extra_manifest: Mapping[str, object] | None = None,
              log: Callable[[str], None] | None = None) -> "GradientIndex":
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

        ``log(line)`` is told, in one line (``repair_summary``), what the build repaired, if
        anything: the damaged or leftover files, what was wrong with each and what was done. Without
        ``log`` that line is a warning on the ``gradian.index`` logger.
        """
        target = build_target(gm, tokenizer, dataset, config, cache_dir)
        target.extra_manifest = dict(extra_manifest or {})
        if shard is not None and shard.world_size > 1:
            built = build_sharded(target, shard, force=force, progress=progress)
        else:
            built = build_local(target, force=force, progress=progress)
        index = cls._built(built)
        if index.repairs:
            line = repair_summary(index.index_id, index.root, index.repairs)
            if log is not None:
                log(line)
            else:
                _log.warning(line)
        return index

    @classmethod
    def _built(cls, built: BuiltIndex) -> "GradientIndex":
        index = cls(built.root, built.manifest)
        index._verified.update(built.verified)
        index.cache_hit = built.cache_hit
        index.repairs = list(built.repairs)
        return index
