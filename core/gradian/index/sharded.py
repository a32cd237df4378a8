"""One index built by several processes (``torchrun``): each rank computes a contiguous share of the chunks.

Interface: ``build_sharded(target, shard, force, progress) -> BuiltIndex``, called by
``GradientIndex.build`` on every rank of a ``ShardGroup`` with the same inputs.

The protocol, in the build's own steps (``gradian.index.build``):

1. Rank 0 takes the build lock (``<cache_dir>/index/.<index_id>.lock``) and holds it to the end:
   it alone prepares (removes ``.tmp`` leftovers, checks every stored chunk, drops damaged ones)
   and writes the ``building`` manifest, then broadcasts the plan: the index id and identity and
   the chunks still to compute, or "cached" on a cache hit. The other ranks take no lock: they
   only write the chunks rank 0 assigned them, so one lock per build serializes this build
   against any other build of the same index (sharded or not) and nothing finer is needed.
2. Every rank computes ``todo[r * len // W : (r + 1) * len // W]``: contiguous chunk indices, so
   a rank's rows are a contiguous range of the dataset. A chunk's bytes depend on its rows alone
   (``compute_chunks`` batches inside the chunk), so the store equals the single-process one.
   After each chunk a rank writes a chunk record (``chunks/NNNNN.record.json``) beside it.
3. All ranks meet in one gather of their records (or their error). Rank 0 writes the complete
   manifest in one atomic rename, removes the chunk records and broadcasts the manifest.

A killed rank leaves its finished chunks and their records; the next build, with any number of
processes or one, takes those chunks as done once their bytes check out and computes the rest.
A rank whose inputs give another index id than rank 0's (another library version on another
node, another dataset file) reports it in the gather, and every rank stops with that message.

Multi-node: ``cache_dir`` must be one shared filesystem, since rank 0 checks and scoring reads
every rank's chunks (and ``flock`` must work on it, as on local disks and NFSv4).
"""

from __future__ import annotations

import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypedDict, TypeVar

import numpy as np

from gradian.errors import GradianError, IndexMismatchError
from gradian.index.manifest import ChunkRecord, first_difference
from gradian.index.build import (
    BuildTarget,
    BuiltIndex,
    build_lock,
    compute_chunks,
    finish_build,
    prepare_build,
    remove_chunk_records,
    start_build,
    write_chunk_record,
)

if TYPE_CHECKING:
    from gradian.data import TokenizedExample
    from gradian.distributed import ShardGroup
    from gradian.grads.collectors import KroneckerCollector

T = TypeVar("T")

__all__ = ["build_sharded", "gather_factor_sums", "gather_outcomes", "ShardedBuildError", "shard_of"]


class _Plan(TypedDict, total=False):
    """What rank 0 broadcasts: ``kind`` (``failed``, ``cached``, ``build``, ``complete``) and what goes with it."""

    kind: str
    index_id: str
    identity: dict[str, object]
    todo: list[int]
    manifest: dict[str, Any]
    error: str
    exit_code: int


class _Failure(TypedDict, total=False):
    """A rank's error in a gather (None: it had none), and the exit code it carries."""

    error: str | None
    exit_code: int


class _Computed(_Failure, total=False):
    """What a rank reports of its chunks to the gather: their records, and its error."""

    records: dict[int, ChunkRecord]


class ShardedBuildError(GradianError, RuntimeError):
    """Another rank of a sharded index build (or streamed pass) failed; this rank stops with its
    message and the exit code that rank's error carries (3 for a full disk, 2 for bad input)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _exit_code(err: BaseException) -> int:
    return int(getattr(err, "exit_code", 2)) if isinstance(err, GradianError) else 70


def shard_of(todo: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous share of the chunk indices ``todo`` (sizes differ by one at most)."""
    return todo[rank * len(todo) // world_size : (rank + 1) * len(todo) // world_size]


def build_sharded(target: BuildTarget, shard: "ShardGroup", *, force: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> BuiltIndex:
    if shard.is_main:
        with build_lock(target.lock):
            return _lead(target, shard, force, progress)
    return _follow(target, shard)


def _lead(target: BuildTarget, shard: "ShardGroup", force: bool,
          progress: Callable[[int, int], None] | None) -> BuiltIndex:
    import shutil

    try:
        if force and target.root.exists():
            shutil.rmtree(target.root)
        plan = prepare_build(target)
        tokenized = start_build(target, plan.manifest) if plan.cached is None else None
    except BaseException as err:
        shard.broadcast({"kind": "failed", "error": _describe(err, shard.rank), "exit_code": _exit_code(err)})
        raise
    if plan.cached is not None:
        shard.broadcast({"kind": "cached", "index_id": target.index_id, "identity": target.identity,
                         "manifest": plan.cached})
        return BuiltIndex(target.root, plan.cached, plan.good, plan.repairs, cache_hit=True)

    todo = [k for k in range(target.n_chunks) if k not in plan.good]
    shard.broadcast({"kind": "build", "index_id": target.index_id, "identity": target.identity, "todo": todo})
    rows_before = target.n - sum(target.chunk_rows(k) for k in todo)
    if progress:
        progress(rows_before, target.n)

    seen = {"at": 0.0, "rows": 0}

    def written(k: int, record: ChunkRecord) -> None:
        write_chunk_record(target.root, k, record)
        now = time.perf_counter()
        if progress and now - seen["at"] >= 1.0:
            # every rank's finished chunks, as their records on the shared disk say (one listing
            # a second at most: a million rows are four thousand chunks)
            recorded = {int(p.name[:5]) for p in (target.root / "chunks").glob("?????.record.json")}
            seen["at"], seen["rows"] = now, sum(target.chunk_rows(j) for j in todo if j in recorded)
            progress(rows_before + int(seen["rows"]), target.n)

    started = time.perf_counter()
    mine = shard_of(todo, shard.rank, shard.world_size)
    outcome, own_error = _compute(target, mine, tokenized, written, shard.rank)
    outcomes: list[_Computed] = shard.gather(outcome)
    try:
        if own_error is not None:
            raise own_error
        _raise_first_failure(outcomes)
        manifest = plan.manifest
        for records in outcomes:
            for k, record in records["records"].items():
                manifest["chunks"][int(k)] = record
        finish_build(target, manifest, time.perf_counter() - started)
        remove_chunk_records(target.root)
    except BaseException as err:
        shard.broadcast({"kind": "failed", "error": _describe(err, shard.rank), "exit_code": _exit_code(err)})
        raise
    shard.broadcast({"kind": "complete", "manifest": manifest})
    if progress:
        progress(target.n, target.n)
    return BuiltIndex(target.root, manifest, set(range(target.n_chunks)), plan.repairs, cache_hit=False)


def _follow(target: BuildTarget, shard: "ShardGroup") -> BuiltIndex:
    from gradian.data import tokenize_examples

    # tokenized while rank 0 checks the store
    tokenized = tokenize_examples(target.dataset.examples, target.tokenizer, target.config.grads.max_seq_length)
    plan: _Plan = shard.broadcast()
    if plan["kind"] == "failed":
        raise ShardedBuildError(plan["error"], plan.get("exit_code", 2))
    mismatch = _mismatch(plan, target, shard.rank)
    if plan["kind"] == "cached":
        if mismatch:
            raise IndexMismatchError(mismatch)
        return BuiltIndex(target.root, plan["manifest"], set(), [], cache_hit=True)
    own_error: BaseException | None = None
    outcome: _Computed
    if mismatch:
        outcome, own_error = {"error": mismatch, "records": {}}, IndexMismatchError(mismatch)
    else:
        mine = shard_of(plan["todo"], shard.rank, shard.world_size)
        outcome, own_error = _compute(target, mine, tokenized,
                                      lambda k, record: write_chunk_record(target.root, k, record), shard.rank)
    shard.gather(outcome)
    result: _Plan = shard.broadcast()
    if own_error is not None:
        raise own_error
    if result["kind"] == "failed":
        raise ShardedBuildError(result["error"], result.get("exit_code", 2))
    return BuiltIndex(target.root, result["manifest"], set(), [], cache_hit=False)


def _compute(target: BuildTarget, mine: list[int], tokenized: Sequence[TokenizedExample] | None,
             written: Callable[[int, ChunkRecord], None],
             rank: int) -> tuple[_Computed, Exception | None]:
    """This rank's chunks: ``({"records": {chunk: record}, "error": None | message}, the exception)``.
    An exception is reported to the gather, not raised, so no rank waits for one that left; an
    interrupt (KeyboardInterrupt, SIGTERM) still ends the process, and torchrun the others."""
    records: dict[int, ChunkRecord] = {}

    def keep(k: int, record: ChunkRecord) -> None:
        records[k] = record
        written(k, record)

    try:
        compute_chunks(target, mine, tokenized or [], keep)
    except Exception as err:
        return {"records": records, "error": _describe(err, rank), "exit_code": _exit_code(err)}, err
    return {"records": records, "error": None}, None


def gather_outcomes(shard: "ShardGroup", work: Callable[[], T], what: str) -> list[T]:
    """Every rank's ``work()``, in rank order, on every rank; when any rank's ``work`` raised, every
    rank raises (that rank its own error, the others a ``ShardedBuildError`` naming it and
    ``what``), so no rank waits in a collective for one that left. An interrupt still ends the
    process, and torchrun the others."""
    try:
        outcome: dict[str, Any] = {"value": work(), "error": None}
        own_error: Exception | None = None
    except Exception as err:
        outcome, own_error = {"error": _describe(err, shard.rank), "exit_code": _exit_code(err)}, err
    outcomes = shard.gather(outcome)
    if own_error is not None:
        raise own_error
    _raise_first_failure(outcomes, what)
    return [o["value"] for o in outcomes]


def _mismatch(plan: _Plan, target: BuildTarget, rank: int) -> str | None:
    if plan["index_id"] == target.index_id:
        return None
    field, lead, here = first_difference(plan["identity"], target.identity) or ("?", "?", "?")
    return (f"rank {rank} indexes other inputs than rank 0 ({field}: rank 0 has {lead!r}, rank {rank} has "
            f"{here!r}); every process must see the same dataset, model, adapter, config and library versions")


def _raise_first_failure(outcomes: Sequence[_Failure], what: str = "index build") -> None:
    failed = [(r, o["error"], o.get("exit_code", 2)) for r, o in enumerate(outcomes) if o.get("error")]
    if failed:
        r, message, code = failed[0]
        raise ShardedBuildError(f"rank {r} of the sharded {what} failed: {message}", code)


def _describe(err: BaseException, rank: int) -> str:
    if isinstance(err, GradianError):
        return str(err)
    last = traceback.extract_tb(err.__traceback__)[-1:] if err.__traceback__ else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(err).__name__}: {err}{where} (rank {rank})"


def gather_factor_sums(shard: "ShardGroup", collector: "KroneckerCollector") -> None:
    """The Kronecker factor sums every rank's ``collector`` gathered over its share of a sharded
    build, added up in rank order into rank 0's collector (the other ranks' are emptied), so the
    fit on rank 0 needs no factor pass of its own. A rank that computed no chunk (a build found
    stored, or resumed) adds nothing, and rank 0's ``collector.complete(n)`` then says the sums do
    not cover the data, as after a resumed single-process build."""
    parts = gather_outcomes(shard, collector.take, "Kronecker factor sums")
    if not shard.is_main:
        return
    total: dict[str, np.ndarray] = {}
    for part in parts:  # rank order: every rank adds the same sums in the same order
        for name, value in part.items():
            total[name] = total[name] + value if name in total else np.array(value, copy=True)
    collector.restore(total)

