"""Training gradients streamed from the model: what the index would hold, recomputed in each pass.

Interface:

- ``GradientStream(gm, tokenizer, dataset, config, tokenized=None, progress=None, shard=None)`` is a ``TrainGradients``
  (``n``, ``block_names``, ``widths``, ``iter_chunks()``, ``sq_norms()``, ``rows(indices)``) that
  writes nothing: every pass over it captures the per-example gradients again, chunk by chunk,
  exactly as an index build of the same inputs computes them (each chunk in batches that start at
  its first row, the values rounded to ``grads.storage_dtype``), so an engine scores the same
  numbers from a stream as from the index. Its ``index_id`` is the id that index would have, so a
  fitted engine state is stored, found and reused under the same id whichever store produced it.
  ``passes`` counts the full passes made; ``prime(collector)`` makes one, keeping the squared
  norms and (given the active ``KroneckerCollector``) the Kronecker factors. ``fold_chunks`` is
  the resumable pass every engine's folded pass goes through (``gradian.engines.base.chunk_pass``):
  each chunk's outputs are kept under ``<cache_dir>/stream/<index id>/passes/`` by
  ``gradian.index.passes``, so an interrupted pass resumes at the first chunk it had not finished.
  The first pass that forms per-example gradients keeps their squared norms there too
  (``norms.npz``), which ``sq_norms`` reads back in a later run.
  Given ``shard`` (a ``gradian.distributed.ShardGroup`` of a torchrun launch), every folded pass
  is sharded: each rank computes a contiguous span of the chunks and every rank gets the whole
  fold (``_fold_sharded``); every rank must then make the same passes in the same order.
- ``choose_store(config, gm, tokenizer, dataset, whole) -> (config, StoreChoice)`` reads
  ``engine.store``: ``index``, ``stream``, or ``auto`` (the index when it is stored already, or
  when the full-width index fits ``grads.max_index_gb`` and the free disk of ``cache_dir``; the
  stream otherwise). Under ``index`` an index over the limit is projected as before
  (``gradian.index.sizing.auto_projection``).
- ``training_gradients(gm, tokenizer, dataset, config, choice, ..., shard=None)``: the built index or a stream;
  ``capture_training_gradients(..., collect=True)`` also gathers the Kronecker sums of their first
  pass (the index build's, or a stream's first pass, made then).
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypedDict

import numpy as np

from gradian.chunks import accumulate, pass_key
from gradian.grads import make_projector
from gradian.grads.collectors import KroneckerCollector, factor_rows_of, factor_share, structured_projector
from gradian.index.build import _STORAGE, build_target, capture_rows, stored_norms
from gradian.index.passes import PassProgress, keep_arrays, kept_arrays
from gradian.index.sharded import ShardedBuildError, gather_outcomes, shard_of
from gradian.index.sizing import AutoProjection, auto_projection, index_bytes, store_rule

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig
    from gradian.data import Dataset, TokenizedExample
    from gradian.distributed import ShardGroup
    from gradian.grads import GradientModel
    from gradian.index.build import RepairRecord
    from gradian.index.store import GradientIndex

__all__ = ["GradientStream", "StoreChoice", "capture_training_gradients", "choose_store",
           "training_gradients"]


class _Span(TypedDict):
    """One rank's share of a sharded pass: per-row outputs of its rows, its sums, where its rows start,
    and the checksums of its chunks' files."""

    rows: dict[str, np.ndarray]
    sums: dict[str, np.ndarray]
    first_row: int
    checksums: dict[int, str | None]


def _raise_other_pass(key: str, seen: list[tuple[str, bool]]) -> None:
    """Every rank of a sharded pass must make the same pass (the same content key)."""
    for rank, (other, _) in enumerate(seen):
        if other != seen[0][0]:
            raise ShardedBuildError(
                f"rank {rank} makes the streamed pass {other} where rank 0 makes {seen[0][0]}: the ranks compute "
                "from different numbers (another query, dataset, adapter, config or library version); every "
                "process must see the same inputs")


class GradientStream:
    """Per-example training gradients recomputed from ``gm`` in every pass (see the module doc)."""

    store = "stream"
    cache_hit = False
    root: Path | None = None

    def __init__(self, gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset, config: GradianConfig,
                 tokenized: Sequence[TokenizedExample] | None = None,
                 progress: Callable[[int, int], None] | None = None, shard: "ShardGroup | None" = None) -> None:
        self.gm, self.tokenizer, self.dataset, self.config = gm, tokenizer, dataset, config
        #: the processes of a torchrun launch every pass is sharded over (None: this one alone)
        self.shard = shard
        self.target = build_target(gm, tokenizer, dataset, config, None, make_dirs=False)
        self._tokenized = list(tokenized) if tokenized is not None else None
        self._norms: dict[str, np.ndarray] | None = None
        self._projector = make_projector(config.grads, gm)
        self.progress = progress
        self.passes = 0
        self.pass_seconds: list[float] = []
        self.rows_computed = 0
        self.repairs: list[RepairRecord] = []
        self.repaired: list[str] = []
        #: chunks whose outputs a pass read back from an earlier, interrupted or finished run
        self.chunks_resumed = 0
        self.notes: list[str] = []
        self._keep_partials = True
        #: an engine to come reads every row's squared norm (DataInf): a pass over a share of the
        #: rows still captures every row while no pass has kept them (``fold_chunks``)
        self.norms_wanted = True

    # -- what it is ---------------------------------------------------------------------------

    @property
    def index_id(self) -> str:
        return self.target.index_id

    @property
    def n(self) -> int:
        return self.target.n

    @property
    def block_names(self) -> list[str]:
        return [b["name"] for b in self.target.blocks]

    @property
    def widths(self) -> dict[str, int]:
        return {b["name"]: int(b["width"]) for b in self.target.blocks}

    @property
    def chunk_size(self) -> int:
        return self.target.chunk_size

    @property
    def example_ids(self) -> list[str]:
        return list(self.dataset.ids)

    @property
    def manifest(self) -> dict[str, Any]:
        """What an index manifest says of its inputs and layout, for the report: no chunk is stored."""
        grads = self.config.grads
        return {
            "index_id": self.index_id,
            "store": "stream",
            "identity": self.target.identity,
            "blocks": self.target.blocks,
            "skipped_modules": list(getattr(self.gm, "skipped", [])),
            "n_examples": self.n,
            "chunk_size": self.target.chunk_size,
            "n_chunks": self.target.n_chunks,
            "total_width": self.target.total_width,
            "storage_dtype": grads.storage_dtype,
            "sources": {"dataset": str(getattr(self.dataset, "path", "")), "base_model": self.config.base_model,
                        "adapter_path": self.config.adapter_path},
            "passes": self.passes,
            "pass_seconds": [round(s, 3) for s in self.pass_seconds],
            "chunks_resumed": self.chunks_resumed,
            #: the processes every folded pass was sharded over (the counts above are this one's)
            "processes": self.shard.world_size if self.shard is not None else 1,
            "partials": str(self.passes_root),
        }

    def disk_bytes(self) -> int:
        return 0

    @property
    def tokenized(self) -> list[TokenizedExample]:
        if self._tokenized is None:
            from gradian.data import tokenize_examples

            self._tokenized = tokenize_examples(self.dataset.examples, self.tokenizer, self.config.grads.max_seq_length)
        return self._tokenized

    # -- passes -------------------------------------------------------------------------------

    def iter_chunks(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """``(start row, {block: [rows, width]})`` for every chunk, captured now."""
        started = time.perf_counter()
        norms: list[dict[str, np.ndarray]] = []
        for k in range(self.target.n_chunks):
            rows = self._chunk(k)
            if self._norms is None:
                norms.append(stored_norms(rows, _STORAGE[self.config.grads.storage_dtype]))
            if self.progress is not None:
                self.progress(min((k + 1) * self.target.chunk_size, self.n), self.n)
            yield k * self.target.chunk_size, rows
        self.passes += 1
        self.pass_seconds.append(time.perf_counter() - started)
        if self._norms is None:
            self._norms = {b: np.concatenate([part[b] for part in norms]) if norms else np.zeros(0)
                           for b in self.block_names}

    def fold_chunks(self, key: str, of_chunk: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]], *,
                    rows: Sequence[str] = (), sums: Sequence[str] = (),
                    capture: Callable[[int], dict[str, np.ndarray]] | None = None,
                    chosen: Any = None) -> dict[str, np.ndarray]:
        """One pass folding ``of_chunk`` over every chunk (``gradian.engines.base.chunk_pass``),
        resumable: each finished chunk's outputs are kept under the pass's content ``key``
        (``gradian.index.passes``), so an interrupted pass computes only the chunks it had not
        finished, and a finished one is not made again. Where the cache cannot be written, the pass
        runs without keeping anything and says so in ``notes``. Under a ``shard`` group every rank
        computes its span of the chunks and every rank returns the whole fold (``_fold_sharded``).
        ``capture(k)`` is what the pass makes of chunk ``k`` before ``of_chunk`` (default: its
        per-example gradients; the first such pass, while no squared norms are known, also keeps
        every row's squared norm per block, so an engine that reads them, such as DataInf, finds
        them without a pass of its own).

        ``chosen`` (``gradian.engines.base.ChosenRows``): ``of_chunk`` sees only the rows it
        chooses, and only those are computed, in batches of their own, unless the pass is to keep
        the squared norms an engine to come reads (``norms_wanted``): then every row is computed,
        in the index's batches, and the chosen ones folded."""
        norms = capture is None and self._norms is None
        if chosen is not None:
            if capture is None and not (norms and self.norms_wanted):
                norms, share = False, float(chosen.share)
                capture = lambda k: self._chosen_chunk(k, share)  # noqa: E731
                key += "-chosen"  # other batches than a pass over every row: other partials
            else:
                of_chunk = chosen.restrict(of_chunk)
        capture = capture if capture is not None else self._chunk
        if norms:  # the first pass that has the per-example gradients keeps their squared norms too
            of_chunk, rows = self._and_norms(of_chunk), (*rows, *self._norm_names)
        if self.shard is not None:
            out = self._fold_sharded(key, of_chunk, tuple(rows), tuple(sums), capture)
        else:
            progress = PassProgress(self.passes_root / key, self.target.n_chunks, rows, sums)
            out, _ = self._fold_span(progress, of_chunk, tuple(rows), tuple(sums), capture)
        if norms:
            self._norms = {b: out.pop(f"norm.{b}", np.zeros(self.n)) for b in self.block_names}
            self._keep_norms()
        return out

    def _keep_norms(self) -> None:
        """Keep the squared norms beside the passes (``norms.npz``), so a later run over the same
        inputs whose fit is stored already (and makes no pass that would keep them) reads them
        back instead of making a pass for them."""
        if self._norms is None or not self._keep_partials or (self.shard is not None and not self.shard.is_main):
            return
        try:
            keep_arrays(self.passes_root / "norms.npz", {f"norm.{b}": np.asarray(v) for b, v in self._norms.items()})
        except OSError as err:
            self._cannot_keep(err)

    def _kept_norms(self) -> dict[str, np.ndarray] | None:
        """The squared norms a pass kept (``_keep_norms``), when they are whole and check out."""
        kept = kept_arrays(self.passes_root / "norms.npz")
        if kept is None or set(self._norm_names) - set(kept):
            return None
        norms = {b: kept[f"norm.{b}"] for b in self.block_names}
        return norms if all(v.shape == (self.n,) for v in norms.values()) else None

    @property
    def _norm_names(self) -> list[str]:
        return [f"norm.{b}" for b in self.block_names]

    def _and_norms(self, of_chunk: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]
                   ) -> Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """``of_chunk`` with the chunk's squared norms per block added to its outputs."""
        storage = _STORAGE[self.config.grads.storage_dtype]

        def both(start: int, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            part = dict(of_chunk(start, chunk))
            part.update({f"norm.{b}": v for b, v in stored_norms(chunk, storage).items()})
            return part

        return both

    def _fold_span(self, progress: PassProgress, of_chunk: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]],
                   rows: tuple[str, ...], sums: tuple[str, ...],
                   capture: Callable[[int], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
        """``(outputs, computed)``: ``progress``'s span of chunks folded, the finished ones read back,
        the others computed now (``computed``: at least one was)."""
        todo, done, totals = progress.resume()
        self.repaired.extend(progress.repaired)
        out: dict[str, np.ndarray] = {}
        for k in sorted(done):
            accumulate(out, self.n, k * self.chunk_size, done[k], rows, ())
        if totals is not None:
            out.update({name: totals[name] for name in sums})
        self.chunks_resumed += (progress.end - progress.first) - len(todo)
        if not todo:
            return out, False
        started = time.perf_counter()
        for k in todo:
            start = k * self.chunk_size
            part = of_chunk(start, capture(k))
            accumulate(out, self.n, start, part, rows, sums)
            if self._keep_partials:
                try:
                    progress.save(k, part, out)
                except OSError as err:
                    self._cannot_keep(err)
            if self.progress is not None:  # a rank's span: the share of it done, in rows of the whole
                span = progress.end - progress.first
                done_rows = (min(start + self.chunk_size, self.n) if span == self.target.n_chunks
                             else self.n * (k + 1 - progress.first) // span)
                self.progress(done_rows, self.n)
        self.passes += 1
        self.pass_seconds.append(time.perf_counter() - started)
        return out, True

    def _cannot_keep(self, err: OSError) -> None:
        self._keep_partials = False
        self.notes.append(f"the partial results of the streamed passes cannot be kept under "
                          f"{self.passes_root} ({err.strerror or err}): an interrupted pass starts "
                          "again; point cache_dir at a writable folder to resume instead")

    def _fold_sharded(self, key: str, of_chunk: Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]],
                      rows: tuple[str, ...], sums: tuple[str, ...],
                      capture: Callable[[int], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """``fold_chunks`` on every rank of ``self.shard``, with the same result on each.

        The ranks first compare the pass's key (a rank scoring other numbers than rank 0 stops
        every rank, naming the pass) and whether the pass is stored finished already (then it is
        read back, as by one process). Otherwise each rank folds its contiguous span of the chunks
        (``shard_of``), keeping its per-row files and its span's running sums on disk as one
        process does, and the spans are exchanged in one gather: per-row outputs are placed at
        their rows, so they are exactly one process's; sums are added span by span in rank order,
        which reassociates one process's chunk-order sum (float64, relative 1e-15 or so). Rank 0
        then records the whole pass finished, so a later run of any number of processes reads it
        back."""
        assert self.shard is not None
        shard, n_chunks = self.shard, self.target.n_chunks
        root = self.passes_root / key
        whole = PassProgress(root, n_chunks, rows, sums)
        finished = not whole.resume()[0]
        _raise_other_pass(key, shard.gather((key, finished)))
        if finished:  # every rank found it stored whole: read back, as by one process
            return self._fold_span(PassProgress(root, n_chunks, rows, sums), of_chunk, rows, sums, capture)[0]
        span = shard_of(list(range(n_chunks)), shard.rank, shard.world_size)
        mine = PassProgress(root, n_chunks, rows, sums, span=(span[0], span[-1] + 1) if span else (0, 0))
        first_row, end_row = (span[0] * self.chunk_size, min((span[-1] + 1) * self.chunk_size, self.n)) if span else (0, 0)

        def my_span() -> _Span:
            out, _ = self._fold_span(mine, of_chunk, rows, sums, capture) if span else ({}, False)
            return {"rows": {name: out[name][first_row:end_row] for name in rows if name in out},
                    "sums": {name: out[name] for name in sums if name in out},
                    "first_row": first_row, "checksums": dict(mine.checksums)}

        parts = gather_outcomes(shard, my_span, "streamed pass " + key)
        folded: dict[str, np.ndarray] = {}
        checksums: dict[int, str | None] = {}
        for part in parts:  # rank order: the spans in chunk order
            accumulate(folded, self.n, part["first_row"], {**part["rows"], **part["sums"]},
                       [name for name in rows if name in part["rows"]], [name for name in sums if name in part["sums"]])
            checksums.update(part["checksums"])
        note = None
        if shard.is_main and self._keep_partials and len(checksums) == n_chunks:
            try:
                whole.commit(checksums, folded)
            except OSError as err:
                note = f"{err.strerror or err}"
        if shard.broadcast(note) is not None and self._keep_partials:
            self._cannot_keep(OSError(note))
        return folded

    @property
    def passes_root(self) -> Path:
        """Where the streamed passes keep their partial results: beside where the index would be."""
        return Path(self.config.cache_dir) / "stream" / self.index_id / "passes"

    def prime(self, collector: KroneckerCollector | None = None, norms: bool = True) -> None:
        """One full pass keeping the squared norms, and the Kronecker factors when ``collector`` is
        the active collector the pass runs under (resumable, like every folded pass).

        ``norms=False`` (with a collector): the factors alone, from the forward and backward the
        capture makes but without forming any per-example gradient (the ``hooks`` strategy; the
        others capture as usual); the norms then come with the next pass that captures per-example
        gradients (``fold_chunks``), or a pass of their own if an engine asks for them first
        (``sq_norms``)."""
        if collector is not None and not norms and self.config.grads.strategy == "hooks":
            # factors summed over a share of the rows (engine.factor_rows) are other sums: other partials
            share = {"factor_share": collector.share} if collector.share < 1.0 else {}
            out = self.fold_chunks(pass_key("prime", {"factors": True, "norms": False, **share}),
                                   lambda start, chunk: collector.take(), sums=collector.part_names(),
                                   capture=lambda k: self._forward_backward(k, collector))
            collector.restore(out)
            return
        if collector is not None and collector.share < 1.0:
            raise ValueError("a share of the rows is summed only by a factors-only first pass (norms=False, hooks)")
        # the pass captures per-example gradients, so fold_chunks keeps their squared norms
        # (unless they are known already); the factors, when gathered, are its sums
        out = self.fold_chunks(pass_key("prime", {"factors": collector is not None}),
                               lambda start, chunk: collector.take() if collector is not None else {},
                               sums=collector.part_names() if collector is not None else ())
        if collector is not None:
            collector.restore(out)

    def sq_norms(self) -> dict[str, np.ndarray]:
        """Every row's squared norm per block: those a pass kept (this stream's, or an earlier
        run's over the same inputs), else from a pass of their own."""
        if self._norms is None:
            self._norms = self._kept_norms()
        if self._norms is None:
            self.prime()
        assert self._norms is not None
        return self._norms

    def rows(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        """``{block: [len(indices), width]}`` of the rows asked for, in that order: each computed in
        the batch of its chunk an index build computes it in, so the values are the stored ones."""
        wanted = [int(i) for i in indices]
        for i in wanted:
            if not 0 <= i < self.n:
                raise IndexError(f"row {i} is not in the training set ({self.n} rows)")
        size, batch = self.chunk_size, int(self.config.grads.batch_size)
        starts = sorted({(i // size) * size + ((i % size) // batch) * batch for i in wanted})
        got: dict[int, dict[str, np.ndarray]] = {}
        for first in starts:
            end = min(first + batch, (first // size) * size + size, self.n)
            part = self._capture(first, end)
            for j in range(end - first):
                got[first + j] = {b: v[j] for b, v in part.items()}
        names = self.block_names
        return {b: np.stack([got[i][b] for i in wanted]) if wanted else np.zeros((0, self.widths[b]))
                for b in names}

    def _chunk(self, k: int) -> dict[str, np.ndarray]:
        first = k * self.target.chunk_size
        return self._capture(first, first + self.target.chunk_rows(k))

    def _chosen_chunk(self, k: int, share: float) -> dict[str, np.ndarray]:
        """The per-example gradients of the rows of chunk ``k`` that ``in_factor_rows`` chooses at
        ``share``, in batches of those rows alone (``{block: [chosen, width]}``; none may be)."""
        first = k * self.target.chunk_size
        chosen = factor_rows_of(self.tokenized[first: first + self.target.chunk_rows(k)], share)
        if not chosen:
            return {b: np.zeros((0, w), dtype=_STORAGE[self.config.grads.storage_dtype]) for b, w in self.widths.items()}
        with self._own_adapter():
            rows = capture_rows(self.target, chosen, self._projector)
        self.rows_computed += len(chosen)
        return rows

    def _forward_backward(self, k: int, collector: KroneckerCollector | None = None) -> dict[str, np.ndarray]:
        """Chunk ``k``'s forward and backward passes, in the capture's batches, forming nothing
        (for hooks active meanwhile, such as a ``KroneckerCollector``). When ``collector`` sums a
        share of the rows only, the other rows are left out of the passes (and accounted for)."""
        from gradian.grads import collate
        from gradian.grads.capture import output_gradient_pass

        first = k * self.target.chunk_size
        end = first + self.target.chunk_rows(k)
        grads, pad = self.config.grads, self.tokenizer.pad_token_id
        rows = self.tokenized[first:end]
        if collector is not None and collector.share < 1.0:
            chosen = factor_rows_of(rows, collector.share)
            collector.skip(len(rows) - len(chosen))
            rows = chosen
        with self._own_adapter():
            for offset in range(0, len(rows), grads.batch_size):
                output_gradient_pass(self.gm, collate(rows[offset: offset + grads.batch_size], pad, self.gm.device),
                                     grads.loss_reduction)
        self.rows_computed += len(rows)
        return {}

    @contextmanager
    def _own_adapter(self) -> Iterator[None]:
        """This stream's adapter active for the duration (the model may hold several)."""
        model = self.gm.model
        previous = getattr(model, "active_adapter", None)
        own = getattr(self.gm, "adapter_name", None)
        switch = hasattr(model, "set_adapter") and own is not None and previous != own
        if switch:
            model.set_adapter(own)
        try:
            yield
        finally:
            if switch and isinstance(previous, str):
                model.set_adapter(previous)

    def _capture(self, first: int, end: int) -> dict[str, np.ndarray]:
        """Rows ``first..end`` (batches from ``first``, inside one chunk) under this stream's adapter,
        in the index's storage dtype."""
        with self._own_adapter():
            rows = capture_rows(self.target, self.tokenized[first:end], self._projector)
        self.rows_computed += end - first
        return rows


@dataclass(frozen=True)
class StoreChoice:
    """Where the training gradients of a run come from, and why."""

    store: str
    reason: str
    projection: AutoProjection | None = None

    def message(self) -> str:
        word = "streaming the training gradients" if self.store == "stream" else "indexing the training gradients"
        return f"{word}: {self.reason}"


def _free_disk(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return int(shutil.disk_usage(candidate).free)
    return 0


def choose_store(config: GradianConfig, gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset,
                 whole: Sequence[str]) -> tuple[GradianConfig, StoreChoice]:
    """``(config, choice)`` for ``engine.store`` (see the module doc); ``whole`` are the engines
    that fit curvature on whole gradients, which an index may not project."""
    mode = getattr(config.engine, "store", "index")
    if mode == "stream":
        return config, StoreChoice("stream", "engine.store is stream (recomputed in each pass, nothing written)")
    if mode == "index":
        config, auto = auto_projection(config, gm, len(dataset), whole)
        return config, StoreChoice("index", "engine.store is index", auto)
    grads = config.grads
    target = build_target(gm, tokenizer, dataset, config, None, make_dirs=False)
    if (target.root / "manifest.json").is_file():
        return config, StoreChoice("index", f"index {target.index_id} is stored already")
    store, reason = store_rule(index_bytes(gm, grads, len(dataset)), grads.max_index_gb, _free_disk(target.root.parent))
    return config, StoreChoice(store, reason)


def training_gradients(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset, config: GradianConfig,
                       choice: StoreChoice, *,
                       force: bool = False, progress: Callable[[int, int], None] | None = None,
                       log: Callable[[str], None] | None = None,
                       tokenized: Sequence[TokenizedExample] | None = None,
                       shard: "ShardGroup | None" = None) -> "GradientIndex | GradientStream":
    """The training gradients ``choice`` names: the index built (or found) in ``config.cache_dir``,
    or a stream that writes nothing; either sharded over ``shard``'s ranks when given (each rank
    builds its share of the index's chunks, or computes its share of every streamed pass)."""
    if choice.store == "stream":
        return GradientStream(gm, tokenizer, dataset, config, tokenized=tokenized, progress=progress, shard=shard)
    from gradian.index.store import GradientIndex

    extra = {"projection_auto": choice.projection.manifest()} if choice.projection is not None else None
    return GradientIndex.build(gm, tokenizer, dataset, config, force=force, progress=progress, shard=shard,
                               extra_manifest=extra, log=log)


def capture_training_gradients(gm: GradientModel, tokenizer: PreTrainedTokenizerBase, dataset: Dataset,
                               config: GradianConfig, choice: StoreChoice, *,
                               collect: bool, norms: bool = True, norms_wanted: bool | None = None,
                               force: bool = False,
                               progress: Callable[[int, int], None] | None = None,
                               log: Callable[[str], None] | None = None,
                               tokenized: Sequence[TokenizedExample] | None = None,
                               shard: "ShardGroup | None" = None,
                               ) -> tuple["GradientIndex | GradientStream", KroneckerCollector | None]:
    """``training_gradients``, with (``collect``) the Kronecker sums of their first pass: the index
    build's own passes, or a stream's first pass (made here, which also keeps the squared norms
    unless ``norms`` is False: no engine to come reads them, or a later pass keeps them), so an
    empirical-Fisher fit needs no pass of its own. ``norms_wanted`` (default: ``norms``): whether an
    engine to come reads the squared norms at all (``GradientStream.norms_wanted``)."""
    share = factor_share(len(dataset), getattr(config.engine, "factor_rows", None))
    # over a share of the rows (engine.factor_rows) the factors are summed in batches of the chosen
    # rows alone: by a stream's factors-only first pass, which passes only those rows, or else by the
    # fit's own pass, batched the same way (a capture's full batches would sum other roundings)
    if share < 1.0 and not (choice.store == "stream" and not norms and config.grads.strategy == "hooks"):
        collect = False
    collector = KroneckerCollector(gm, structured_projector(gm, config.grads), share) if collect else None
    if collector is None:
        train = training_gradients(gm, tokenizer, dataset, config, choice, force=force, progress=progress, log=log,
                                   tokenized=tokenized, shard=shard)
        if isinstance(train, GradientStream):
            train.norms_wanted = norms if norms_wanted is None else norms_wanted
        return train, None
    with collector:
        train = training_gradients(gm, tokenizer, dataset, config, choice, force=force, progress=progress, log=log,
                                   tokenized=tokenized, shard=shard)
        if isinstance(train, GradientStream):
            train.norms_wanted = norms if norms_wanted is None else norms_wanted
            train.prime(collector, norms=norms)
    return train, collector
