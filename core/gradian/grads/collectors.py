"""Passes over the model that gather what curvature needs: Kronecker factors and layer gradients.

Interface:

- ``lora_layers(gm)``: every LoRA linear layer of a ``GradientModel`` (its key ``<block>#<j>``,
  block, column offset inside the block, shape), the layout the Kronecker engines fit over.
- ``KroneckerCollector(gm)``: a context manager that adds each layer's ``sum x x^T`` and
  ``sum g g^T`` from whatever forward and backward passes run inside it (the index build's), so
  an empirical-Fisher fit needs no pass of its own; ``sums`` and ``complete(n)``.
- ``ModelPasses(gm, tokenized, pad_id, grads)``: the passes a curvature fit asks for, over the
  tokenized training set in dataset order: ``factor_totals`` (the two covariances' sums over
  every row) and ``layer_gradients`` (per batch, each row's matrix gradient per LoRA layer), under the
  training labels or labels sampled from the model (the true Fisher). Engines receive one in
  their ``FitContext`` and never touch the model themselves.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from gradian.data import IGNORE_INDEX
from gradian.grads.capture import linear_inputs_and_output_grads
from gradian.grads.hooks import GradientTaker, OutputGradientHooks
from gradian.grads.loss import TokenBatch, collate, loss_chunk_positions
from gradian.grads.projection import KroneckerProjector

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gradian.config import GradsConfig
    from gradian.data import TokenizedExample
    from gradian.grads.model import GradientModel

__all__ = ["KroneckerCollector", "ModelPasses", "factor_rows_of", "factor_share", "fisher_generator", "gram_upper", "in_factor_rows",
           "lora_layers", "sample_labels", "add_upper", "mirror_upper", "second_moments", "structured_projector"]


def lora_layers(gm: "GradientModel", projector: KroneckerProjector | None = None) -> list[dict[str, Any]]:
    """Every LoRA linear layer: its key, block, column offset inside the block and shape, as the
    stored gradients hold it (under a ``kronecker`` projector, each side's projected width; ``j``
    is the layer's place in its block)."""
    out = []
    for block in gm.blocks:
        offset = 0
        shapes = projector.projected_shapes(block.name) if projector is not None else block.shapes
        for j, (lin, (rows, cols)) in enumerate(zip(block.linears, shapes)):
            out.append({"key": f"{block.name}#{j}", "block": block.name, "offset": offset,
                        "out": int(rows), "in": int(cols), "id": id(lin), "j": j})
            offset += rows * cols
    return out


def structured_projector(gm: "GradientModel", grads: "GradsConfig | None") -> KroneckerProjector | None:
    """The ``kronecker`` projector of ``grads`` (the one that keeps Kronecker curvature), or None
    for no projection or a flat one (which Kronecker engines refuse)."""
    if grads is None or grads.projection_dim is None or grads.projection_kind != "kronecker":
        return None
    # what make_projector(grads, gm) builds for the kronecker kind
    return KroneckerProjector(grads.projection_dim, grads.projection_seed, {b.name: list(b.shapes) for b in gm.blocks})


def fisher_generator(seed: int, draw: int, offset: int) -> "torch.Generator":
    """The CPU generator of draw ``draw`` of the sampled Fisher for the batch starting at row
    ``offset``: seeded from ``sha256("seed:draw:offset")``, so a batch's labels do not depend on
    the batches before it or on the device."""
    import torch

    digest = hashlib.sha256(f"{seed}:{draw}:{offset}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def factor_share(n_rows: int, factor_rows: int | None) -> float:
    """The share of the training rows the Kronecker factors are summed over: every row (1.0)
    unless ``engine.factor_rows`` is set below ``n_rows``."""
    if factor_rows is None or n_rows <= 0 or int(factor_rows) >= n_rows:
        return 1.0
    return int(factor_rows) / n_rows


def in_factor_rows(token_ids: Any, share: float) -> bool:
    """Whether a row (its token ids, padding left out) is one the Kronecker factors are summed
    over at ``share``: a hash of the ids against the share, so the choice depends on the row alone
    (not on its position, its batch, the shard or the pass that meets it) and every pass makes
    the same one. Identical rows are chosen together."""
    if share >= 1.0:
        return True
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    digest = hashlib.blake2b(ids.tobytes(), digest_size=8, person=b"gradian-factors").digest()
    return int.from_bytes(digest, "little") < share * 2.0 ** 64


def factor_rows_of(rows: Sequence[TokenizedExample], share: float) -> list[TokenizedExample]:
    """The rows of ``rows`` (in order) the Kronecker factors are summed over at ``share``: the one
    choice a stream's first pass and the fit's own pass both make, chunk by chunk."""
    return list(rows) if share >= 1.0 else [t for t in rows if in_factor_rows(t.input_ids, share)]


def sample_labels(logits: "torch.Tensor", labels: "torch.Tensor", gen: "torch.Generator") -> "torch.Tensor":
    """``labels`` with every supervised position's label drawn from the model's own prediction.

    Position ``t`` of a row is supervised when ``labels[t] != IGNORE_INDEX``; its label is drawn
    from ``softmax(logits[t - 1])`` by inversion: one ``u ~ U[0, 1)`` per supervised position
    (``torch.rand(n, generator=gen, dtype=float64)``, positions in row-major order, so padding
    and batch width change no draw), and the label is the first token whose cumulative
    probability exceeds ``u``. Unsupervised and padded positions stay ``IGNORE_INDEX``. The
    uniforms come from the CPU; the softmax and the search run where the logits are, upcast to
    float32 (float64 stays float64), ``loss_chunk_positions`` positions at a time, so no copy
    of the full ``[positions, vocab]`` probabilities is ever made or moved.
    """
    import torch

    keep = labels[:, 1:] != IGNORE_INDEX
    rows, cols = keep.nonzero(as_tuple=True)
    width, vocab = int(logits.shape[1]), int(logits.shape[2])
    positions = rows * width + cols  # logits row predicting label (row, col + 1)
    flat = logits.detach().reshape(-1, vocab)
    upcast = torch.promote_types(logits.dtype, torch.float32)
    u = torch.rand(int(positions.numel()), generator=gen, dtype=torch.float64).to(device=logits.device, dtype=upcast)
    drawn = torch.empty(int(positions.numel()), dtype=torch.long, device=logits.device)
    chunk = loss_chunk_positions(vocab, torch.empty((), dtype=upcast).element_size())
    for s in range(0, int(positions.numel()), chunk):
        cdf = torch.softmax(flat.index_select(0, positions[s: s + chunk]).to(upcast), dim=-1).cumsum_(dim=-1)
        found = torch.searchsorted(cdf, u[s: s + chunk].unsqueeze(1), right=True).squeeze(1)
        drawn[s: s + chunk] = found.clamp_(max=vocab - 1)  # a cdf that rounds below 1 at the end
    new = labels.clone()
    new[:, 1:][keep] = drawn
    return new


def second_moments(x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor | None,
                   xx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(sum x x^T, sum g g^T, tokens)`` over the real tokens of one call (torch sums in the
    compute dtype, as ``gram_upper`` gives them: only the upper triangles hold the sums).

    ``x`` is ``[rows, tokens, in]``, ``g`` ``[rows, tokens, out]``; ``mask`` marks the real
    (unpadded) tokens, or is ``None`` / of another shape when every position counts. Padded
    positions carry no gradient but do carry inputs, so they must be left out of ``A``. ``xx``,
    when given, is the input sum already computed for the same ``x`` (layers that read one input).
    """
    import torch

    keep = mask if mask is not None and mask.shape == x.shape[:2] else \
        torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    dt = torch.promote_types(x.dtype, torch.float32)  # float64 models stay float64
    gm_ = g[keep].to(dt)
    if xx is None:
        xx = gram_upper(x[keep].to(dt))
    return xx, gram_upper(gm_), int(gm_.shape[0])


def gram_upper(m: torch.Tensor) -> torch.Tensor:
    """The upper triangle (diagonal included) of ``m^T m``, in ``m``'s dtype (float32 or
    float64: ``second_moments`` upcasts half precision); what lies below the diagonal is
    unspecified. Sums of these are kept in float64 (``add_upper``) and mirrored once
    (``mirror_upper``) when read.

    On the CPU the product is BLAS's symmetric rank-k update (``?syrk``), which computes one
    triangle: half the arithmetic of a general product, and the largest single cost of gathering
    Kronecker factors there. Elsewhere (CUDA) it is the plain product.
    """
    import torch

    if m.device.type != "cpu" or m.dtype not in (torch.float32, torch.float64) or m.shape[0] == 0:
        return m.T @ m
    from scipy.linalg import blas

    syrk = blas.ssyrk if m.dtype == torch.float32 else blas.dsyrk
    rows = np.ascontiguousarray(m.detach().numpy())
    # rows.T is [width, tokens] in Fortran order, which BLAS reads without a copy: rows.T rows.T^T
    return torch.from_numpy(syrk(1.0, rows.T, trans=0))


def add_upper(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """``total + part`` as a float64 running sum, added in place when ``total`` is one already
    (float32 parts are widened inside the addition: no float64 copy of each part is made)."""
    import torch

    if total is None:
        return part.to(torch.float64, copy=True)
    if total.device.type == "cpu" and part.device.type == "cpu":
        dense = total.numpy()
        np.add(dense, part.numpy(), out=dense)
    else:
        total.add_(part)
    return total


def mirror_upper(upper: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle (diagonal included) is ``upper``'s."""
    return upper.triu() + upper.triu(1).T


class KroneckerCollector(OutputGradientHooks):
    """Collects the Kronecker factors while something else runs forward and backward passes.

    ``with KroneckerCollector(gm) as collector: GradientIndex.build(gm, ...)`` adds each LoRA
    layer's ``sum x x^T`` and ``sum g g^T`` over real tokens from the index build's own passes (a
    forward hook on each layer and a gradient hook on its output), so an empirical-Fisher fit
    needs no pass of its own. ``complete(n)`` says whether exactly ``n`` examples went through
    (a resumed or cached build sees fewer, and the fit then makes its own pass). The sums are the
    ones the fit's own pass would make, batch for batch, when the batch size is the same.
    """

    #: how many recent inputs (and their sums) are held for layers that read the same input
    RECENT_INPUTS = 4

    def __init__(self, gm: "GradientModel", projector: KroneckerProjector | None = None, share: float = 1.0) -> None:
        super().__init__()
        self.gm = gm
        self.projector = projector
        self.layers = lora_layers(gm, projector)
        #: the share of rows summed (``factor_share``): below 1, the passes it watches hand it only
        #: the rows ``in_factor_rows`` chooses, and account for the others with ``skip``
        self.share = float(share)
        #: rows accounted for (summed, or skipped by a pass that sums a share of them)
        self.examples = 0
        #: rows whose tokens the sums hold
        self.summed_examples = 0
        self.real_tokens = 0
        # key -> [sum x x^T, sum g g^T, tokens]: two torch float64 tensors and an int, added to in place
        self._sums: dict[str, list[Any]] = {}
        self._mask: torch.Tensor | None = None
        #: memory and layout -> (input, its sum) of the inputs summed last, oldest first (until the next batch)
        self._recent_inputs: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._layer_of = {layer["id"]: layer for layer in self.layers}

    @property
    def sums(self) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
        """``{layer key: (sum x x^T [in, in], sum g g^T [out, out], real tokens)}`` gathered so far,
        float64, zeros for a layer no pass reached."""
        return {key: (mirror_upper(xx).cpu().numpy(), mirror_upper(gg).cpu().numpy(), tokens)
                for key, (xx, gg, tokens) in self._held().items()}

    def _held(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """``{layer key: (running sum x x^T, running sum g g^T, tokens)}`` as held, only their upper
        triangles meaningful; float64 zeros for a layer no pass reached."""
        import torch

        out = {}
        for layer in self.layers:
            key = layer["key"]
            if key in self._sums:
                xx, gg, tokens = self._sums[key]
                out[key] = (xx, gg, int(tokens))
            else:
                out[key] = (torch.zeros((layer["in"], layer["in"]), dtype=torch.float64),
                            torch.zeros((layer["out"], layer["out"]), dtype=torch.float64), 0)
        return out

    def part_names(self) -> list[str]:
        """The names of what ``take`` returns: each layer's two sums and token count, and the
        examples accounted for, those summed and the real tokens summed."""
        return [f"factor.{layer['key']}.{part}" for layer in self.layers for part in ("xx", "gg", "tokens")] + \
            ["factor.examples", "factor.summed_examples", "factor.real_tokens"]

    def skip(self, rows: int) -> None:
        """Account for ``rows`` rows a pass left out because they are not among those summed."""
        self.examples += int(rows)

    def take(self) -> dict[str, np.ndarray]:
        """Everything gathered since the last ``take`` (float64 sums, int64 counts, named as in
        ``part_names``), and start again from nothing: one chunk's share of the factors. Only the
        upper triangles of the two sums hold them (the lower ones are unspecified, as
        ``gram_upper`` leaves them): sums of these taken over chunks are mirrored once, when
        ``restore``d and read, not chunk by chunk."""
        out: dict[str, np.ndarray] = {}
        for key, (xx, gg, tokens) in self._held().items():
            out[f"factor.{key}.xx"], out[f"factor.{key}.gg"] = xx.cpu().numpy(), gg.cpu().numpy()
            out[f"factor.{key}.tokens"] = np.asarray(tokens, dtype=np.int64)
        out["factor.examples"] = np.asarray(self.examples, dtype=np.int64)
        out["factor.summed_examples"] = np.asarray(self.summed_examples, dtype=np.int64)
        out["factor.real_tokens"] = np.asarray(self.real_tokens, dtype=np.int64)
        self._sums, self.examples, self.summed_examples, self.real_tokens = {}, 0, 0, 0
        return out

    def restore(self, parts: Mapping[str, np.ndarray]) -> None:
        """Hold the totals ``parts`` (``take``'s names, summed over chunks; the upper triangles
        are read) as what was gathered."""
        import torch

        self._sums = {}
        for layer in self.layers:
            key = layer["key"]
            tokens = int(parts.get(f"factor.{key}.tokens", 0))
            if tokens:
                self._sums[key] = [torch.from_numpy(np.array(parts[f"factor.{key}.xx"], dtype=np.float64)),
                                   torch.from_numpy(np.array(parts[f"factor.{key}.gg"], dtype=np.float64)), tokens]
        self.examples = int(parts.get("factor.examples", 0))
        self.summed_examples = int(parts.get("factor.summed_examples", self.examples))
        self.real_tokens = int(parts.get("factor.real_tokens", 0))

    def __enter__(self) -> "KroneckerCollector":
        self._model_handle = self.gm.model.register_forward_pre_hook(self._batch, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._model_handle.remove()
        self.remove()

    def _attach_layer_hooks(self) -> None:
        # attached at the start of every forward, so they run after any hook the gradient capture
        # registered for that pass and see the output tensor that autograd differentiates
        self.remove()
        modules = {id(lin): lin for block in self.gm.blocks for lin in block.linears}
        self.attach(modules[layer["id"]] for layer in self.layers)

    def complete(self, n: int) -> bool:
        """Exactly ``n`` examples went through, and every layer saw every real token of them."""
        if self.examples != n or self.real_tokens == 0:
            return False
        return all(key in self._sums and self._sums[key][2] > 0 and self._sums[key][2] % self.real_tokens == 0
                   for key in (layer["key"] for layer in self.layers))

    def _batch(self, module: nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        self._attach_layer_hooks()
        self._recent_inputs = {}
        if ids is not None:
            self.examples += int(ids.shape[0])
            self._mask = mask.bool() if mask is not None else None
            if self.share < 1.0:
                rows = ids if self._mask is None else (row[keep] for row, keep in zip(ids, self._mask))
                if not all(in_factor_rows(row.cpu().numpy(), self.share) for row in rows):
                    raise ValueError("a Kronecker collector summing a share of the rows was shown a row outside it: "
                                     "the passes it watches must leave those rows out (and skip() them)")
            self.summed_examples += int(ids.shape[0])
            self.real_tokens += int(self._mask.sum()) if self._mask is not None else int(ids.numel())

    def on_call(self, module: nn.Module, x: torch.Tensor) -> GradientTaker:
        """This call's share of its layer's two sums, added when its output gradient arrives."""
        layer, mask = self._layer_of[id(module)], self._mask
        key = layer["key"]

        def on_grad(g: torch.Tensor) -> None:
            x3 = x.reshape(x.shape[0], -1, x.shape[-1])
            g3 = g.detach().reshape(g.shape[0], -1, g.shape[-1])
            same = None
            if self.projector is not None:
                x3, g3 = self.projector.project_sides(layer["block"], layer["j"], x3, g3)
            else:
                # q/k/v (and gate/up) read one input, and their gradients arrive close together:
                # the input's sum is reused while the same memory, held alive here, comes back
                same = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)
            held = self._recent_inputs.pop(same, None) if same is not None else None
            xx, gg, tokens = second_moments(x3, g3, mask, held[1] if held is not None else None)
            if same is not None:
                self._recent_inputs[same] = (x, xx)
                while len(self._recent_inputs) > self.RECENT_INPUTS:
                    self._recent_inputs.pop(next(iter(self._recent_inputs)))
            # the batch's examples are counted once, by the model-level hook; the first part of a
            # running sum is copied (xx may be shared with another layer), later ones added in place
            held_sums = self._sums.get(key)
            if held_sums is not None:
                add_upper(held_sums[0], xx)
                add_upper(held_sums[1], gg)
                held_sums[2] += tokens
            else:
                self._sums[key] = [add_upper(None, xx), add_upper(None, gg), tokens]

        return on_grad



class ModelPasses:
    """The passes over the model a curvature fit asks for (see the module doc).

    ``gm`` is the ``GradientModel`` with the adapter to fit under active, ``tokenized`` the training
    set as the index saw it (``TokenizedExample`` rows, dataset order), ``pad_id`` the tokenizer's
    pad id, ``grads`` the ``GradsConfig`` of the index (batch size, loss reduction).
    """

    def __init__(self, gm: "GradientModel", tokenized: Sequence[TokenizedExample], pad_id: int | None,
                 grads: "GradsConfig | None" = None) -> None:
        self.gm = gm
        self.tokenized = list(tokenized)
        self.pad_id = pad_id
        self.grads = grads
        self.projector = structured_projector(gm, grads)
        self.layers = lora_layers(gm, self.projector)

    @property
    def n_examples(self) -> int:
        return len(self.tokenized)

    @property
    def block_dims(self) -> dict[str, int]:
        """``{block: width}``: what a per-example gradient of each block holds in the space the
        curvature is fitted in (the full width, or a ``kronecker`` projection's)."""
        if self.projector is not None:
            return {block.name: int(self.projector.block_width(block)) for block in self.gm.blocks}
        return {block.name: int(block.dim) for block in self.gm.blocks}

    def _sides(self, layer: dict[str, Any], x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.projector.project_sides(layer["block"], layer["j"], x, g) if self.projector is not None else (x, g)

    def factor_share(self, factor_rows: int | None) -> float:
        """The share of these rows the Kronecker factors are summed over under ``engine.factor_rows``."""
        return factor_share(len(self.tokenized), factor_rows)

    def chosen_rows(self, share: float) -> np.ndarray:
        """``[n]`` bool: the rows ``in_factor_rows`` chooses at ``share`` (every row at 1)."""
        return np.fromiter((in_factor_rows(t.input_ids, share) for t in self.tokenized), dtype=bool,
                           count=len(self.tokenized))

    def _batches(self) -> Iterator[tuple[int, TokenBatch]]:
        size = int(self.grads.batch_size) if self.grads is not None else 4
        for offset in range(0, len(self.tokenized), size):
            rows = self.tokenized[offset: offset + size]
            yield offset, collate(rows, self.pad_id if self.pad_id is not None else 0, self.gm.device)

    def _batches_over(self, share: float) -> Iterator[tuple[int, int, TokenBatch]]:
        """``(chunk start, offset, batch)``: every row in ``_batches`` (chunk start 0) at share 1,
        else the chosen rows in ``_chosen_batches``."""
        if share >= 1.0:
            return ((0, offset, batch) for offset, batch in self._batches())
        return self._chosen_batches(share)

    def _chosen_batches(self, share: float) -> Iterator[tuple[int, int, TokenBatch]]:
        """``(chunk start, offset, batch)`` over the rows ``in_factor_rows`` chooses at ``share``,
        batched as a stream's first pass batches them (the chosen rows of each index chunk, in the
        index's batch size), so both sum the same numbers; ``offset`` is the chunk start plus the
        batch's place among the chunk's chosen rows."""
        size = int(self.grads.batch_size) if self.grads is not None else 4
        chunk = int(self.grads.chunk_size) if self.grads is not None else len(self.tokenized)
        pad = self.pad_id if self.pad_id is not None else 0
        for first in range(0, len(self.tokenized), max(chunk, 1)):
            chosen = factor_rows_of(self.tokenized[first: first + chunk], share)
            for offset in range(0, len(chosen), size):
                yield first, first + offset, collate(chosen[offset: offset + size], pad, self.gm.device)


    @staticmethod
    def _labels(fisher_seed: int | None, draw: int, offset: int,
                batch: TokenBatch) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if fisher_seed is None:
            return None
        gen = fisher_generator(fisher_seed, draw, offset)
        return lambda logits: sample_labels(logits, batch.labels, gen)

    def _reduction(self, fisher_seed: int | None) -> str:
        """The per-row loss the pass differentiates: the index's under the training labels; under
        sampled labels always the sum over the row's supervised tokens.

        Each sampled token is one draw from the model's predictive distribution, and the expected
        outer product of the summed gradient is ``sum_t J_t^T (diag p_t - p_t p_t^T) J_t``, the
        Gauss-Newton matrix of the token-summed loss (cross terms between positions vanish, since
        each position's expected gradient is zero). A row mean would weight a row of ``T`` tokens
        by ``1/T^2``, the Fisher of no objective the trainer minimized."""
        if fisher_seed is not None:
            return "sum"
        return self.grads.loss_reduction if self.grads is not None else "mean"

    def factor_totals(self, fisher_seed: int | None = None, draw: int = 0,
                      tick: Callable[[int], None] | None = None,
                      share: float = 1.0) -> dict[str, tuple[np.ndarray, np.ndarray, int, int]]:
        """``{layer: (sum x x^T, sum g g^T, real tokens, rows)}`` over the training rows
        (float64 numpy, symmetric), under the training labels, or labels sampled from the model
        with ``fisher_seed`` (draw ``draw``; see ``sample_labels`` and ``_reduction``); ``rows`` is
        how many rows reached the layer. One forward and one backward per batch: the input sums
        and the logits the labels are drawn from come from the same forward. ``tick(rows)`` after
        each batch. With ``share`` below 1 only the rows ``in_factor_rows`` chooses are passed, in
        the batches ``_chosen_batches`` makes.

        The batch parts are upper triangles (``gram_upper``) added into float64 running sums and
        mirrored once at the end, as the collector does; layers that read one input (q/k/v,
        gate/up) sum it once per batch. Over a share, each index chunk's running sums are added
        to the total as a stream's first pass folds its chunks, so both give the same bits: with
        the rows not chosen left out, the factors' smallest eigenvectors are set by rounding, and
        EK-FAC's corrected eigenvalues with them."""
        reduction = self._reduction(fisher_seed)
        by_id = {layer["id"]: layer for layer in self.layers}
        held: dict[str, list[Any]] = {}
        total: dict[str, list[Any]] = {}

        def fold() -> None:
            for key, (xx, gg, tokens, rows) in held.items():
                if key not in total:
                    total[key] = [np.zeros(tuple(xx.shape)), np.zeros(tuple(gg.shape)), 0, 0]
                done = total[key]
                done[0], done[1] = done[0] + xx.cpu().numpy(), done[1] + gg.cpu().numpy()
                done[2] += tokens
                done[3] += rows
            held.clear()

        group = 0
        for chunk, offset, batch in self._batches_over(share):
            if chunk != group:
                fold()
                group = chunk
            _, io = linear_inputs_and_output_grads(self.gm, batch, reduction,
                                                   self._labels(fisher_seed, draw, offset, batch))
            real = batch.attention_mask.bool()
            # every input of this batch stays alive in ``io`` meanwhile, so a memory address
            # names one input
            input_sums: dict[tuple[Any, ...], Any] = {}
            for lin_id, layer in by_id.items():
                key, reached = layer["key"], False
                for x, g in io[lin_id]:
                    same = None if self.projector is not None else \
                        (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)
                    xx, gg, tokens = second_moments(*self._sides(layer, x, g), real,
                                                    input_sums.get(same) if same is not None else None)
                    if same is not None:
                        input_sums[same] = xx
                    entry = held.get(key)
                    if entry is None:
                        held[key] = [add_upper(None, xx), add_upper(None, gg), tokens, 0]
                    else:
                        add_upper(entry[0], xx)
                        add_upper(entry[1], gg)
                        entry[2] += tokens
                    reached = True
                if reached:
                    held[key][3] += len(batch)
            if tick is not None:
                tick(len(batch))
        fold()
        import torch

        return {key: (mirror_upper(torch.from_numpy(xx)).numpy(), mirror_upper(torch.from_numpy(gg)).numpy(),
                      int(tokens), int(rows)) for key, (xx, gg, tokens, rows) in total.items()}

    def layer_gradients(self, fisher_seed: int | None = None, draw: int = 0,
                        share: float = 1.0) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Per batch: ``(rows, {layer: G [rows, out, in]})`` float64 numpy, each row's gradient of
        every LoRA matrix, under the labels ``factor_totals`` would use (the same draws: the
        generator of a batch depends only on the seed, the draw and the batch's first row). With
        ``share`` below 1 only the rows ``in_factor_rows`` chooses, batched as ``factor_totals``
        batches them."""
        import torch

        reduction = self._reduction(fisher_seed)
        by_id = {layer["id"]: layer for layer in self.layers}
        for _, offset, batch in self._batches_over(share):
            _, io = linear_inputs_and_output_grads(self.gm, batch, reduction,
                                                   self._labels(fisher_seed, draw, offset, batch))
            out = {}
            for lin_id, layer in by_id.items():
                acc = torch.zeros((len(batch), layer["out"], layer["in"]), dtype=torch.float64)
                for x, g in io[lin_id]:
                    x, g = self._sides(layer, x, g)
                    acc += torch.einsum("bto,bti->boi", g.double().cpu(), x.double().cpu())
                out[layer["key"]] = acc.numpy()
            yield len(batch), out
