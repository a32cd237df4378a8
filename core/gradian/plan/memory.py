"""Predicted peak memory of one gradient batch, and the index's bytes on disk, from shapes alone.

Interface: ``estimate_memory(model, linears, batch, settings) -> MemoryEstimate`` (bytes, by
component); ``index_bytes(n, widths, storage_dtype, chunk_size) -> int``; ``block_widths``
(each block's full and stored width, under a flat or a ``kronecker`` projection);
``stream_chunk_bytes``.

The count follows what ``capture_per_example_grads(strategy="hooks")`` keeps alive, with ``N =
rows x width`` padded tokens, ``s`` the model dtype's bytes, ``H`` hidden, ``I`` intermediate,
``q = N x heads x head_dim``, ``V`` vocab, ``b`` rows, ``t`` width:

- weights: base parameters x ``s``, LoRA parameters x the adapter dtype (float32 on a
  half-precision base, as PEFT loads it); under ``quantization`` the layers' projections are
  packed (``weight_bytes``) and one of them is dequantized at a time for a call (``D s``, ``D``
  the largest projection's values, counted with the layer's backward);
- saved activations, per layer from the first one holding a selected LoRA module: RMSNorm keeps
  its float32 input and ``1/rms`` twice (``2 (4 N H + 4 N)``); the MLP keeps the gate and up
  outputs and SiLU(gate) (``3 N I s``); eager attention keeps q, the repeated k and v (``3 q s``) and
  the softmax probabilities in float32 plus their cast (``b heads t^2 (4 + s)``, one copy when
  ``s = 4``); SDPA keeps q, k, v, the output, the log-sum-exp and the additive mask
  (``4 q s + 4 b heads t + b t^2 s``). Plus the final norm.
- what the hooks keep: each selected module's input (shared by q/k/v and by gate/up: ``N H s``
  each; ``q s`` for o_proj; ``N I s`` for down_proj) and each A's output (``N r`` adapter bytes);
- the loss: the logits (``N V s``), then in the backward their gradient (``N V s``) and one chunk of
  upcast positions (``c V 4``, plus ``c V s`` in half precision; ``c`` from ``LOSS_CHUNK_BYTES``);
- one layer's backward workspace, after the logits are gone (eager: ``b heads t^2 (s + 8)``;
  SDPA: ``4 q s``; plus ``3 N I s`` for the MLP);
- the per-example gradients ``rows x D x 4`` (float32 whatever the model), and after the pass
  the normalization's and projection's copies (and the Rademacher matrices, ``width x D`` int8,
  cached for the whole run).

The peak is the weights plus the larger of (capture: activations + hooks + gradients + the larger
of the loss phase and the layer phase) and (after the pass: gradients + their copies). Two host
buffers are reported apart (on a CPU run they add to the same memory), with ``C = chunk_size``,
``W`` the stored width of a row and ``s'`` the storage dtype's bytes:

- the index writer's (``writer_buffer``): one chunk in float32, concatenated once, then the
  storage dtype written through a bytes buffer, ``C W (8 + 3 s')``;
- a stream's chunk in flight (``stream_chunk``, ``engine.store: stream``): the chunk a pass is
  done with is still referenced while the next is formed (``C W s'``), the batches' float32
  gradients (``C W 4``), the new chunk in the storage dtype (``C W s'``) and one block's float32
  concatenation (``C w 4``, ``w`` the widest stored block): ``C W (4 + 2 s') + 4 C w``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from gradian.plan.shapes import PROJECTION_SITES, DTYPE_BYTES, BatchShape, LoraLinear, ModelShape

__all__ = ["CaptureSettings", "MemoryEstimate", "estimate_memory", "block_widths", "index_bytes", "NPY_HEADER_BYTES",
           "stream_chunk_bytes", "writer_buffer_bytes", "weight_bytes", "dequantized_workspace"]

#: np.save writes a 128-byte header for the arrays the index stores
NPY_HEADER_BYTES = 128

_ATTENTION_SITES = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class CaptureSettings:
    """The settings the memory depends on (a subset of ``GradianConfig`` and ``GradsConfig``)."""

    dtype: str = "float32"
    attn_implementation: str = "eager"
    projection_dim: int | None = None
    projection_kind: str = "countsketch"
    normalization: str = "none"
    storage_dtype: str = "float32"
    chunk_size: int = 256
    block_granularity: str = "module"
    #: ``quantization``: none, 4bit or 8bit (the base's projection weights through bitsandbytes)
    quantization: str = "none"

    @property
    def model_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def adapter_bytes(self) -> int:
        # PEFT keeps the adapter in float32 on a half-precision base (autocast_adapter_dtype)
        return max(4, self.model_bytes)


@dataclass
class MemoryEstimate:
    """Bytes by component, and the predicted peak of one batch on the device."""

    weights: int
    adapter_weights: int
    activations: int
    hook_inputs: int
    logits: int
    loss_backward: int
    layer_backward: int
    per_example_grads: int
    after_pass: int
    projection_cache: int
    peak: int
    #: host memory of the index writer's chunk buffer (adds to ``peak`` on a CPU run)
    writer_buffer: int
    #: host memory of a stream's chunk in flight (``engine.store: stream``; adds to ``peak`` on a CPU run)
    stream_chunk: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def block_widths(linears: Sequence[LoraLinear], granularity: str = "module",
                 projection_dim: int | None = None, projection_kind: str = "countsketch") -> list[tuple[int, int]]:
    """``(dim, stored width)`` of each block: a whole module, or each of A and B under ``matrix``.

    A flat projection (``countsketch``, ``rademacher``) stores ``min(dim, projection_dim)`` per
    block. ``kronecker`` projects each side of every LoRA matrix apart: a matrix of shape ``(out,
    in)`` (A is ``(r, in)``, B ``(out, r)``) stores ``min(out, w) x min(in, w)``, ``w =
    projection_dim``, and a block the sum over its matrices.
    """
    out: list[tuple[int, int]] = []
    for lin in linears:
        matrices = [(lin.r, lin.in_features), (lin.out_features, lin.r)]
        if projection_dim and projection_kind == "kronecker":
            w = projection_dim
            stored = [min(o, w) * min(i, w) for o, i in matrices]
        else:
            stored = [o * i for o, i in matrices]
        if granularity == "matrix":
            out += [(o * i, s) for (o, i), s in zip(matrices, stored)]
        else:
            out.append((lin.dim, sum(stored)))
    if projection_dim and projection_kind != "kronecker":
        out = [(d, min(d, projection_dim)) for d, _ in out]
    return out


#: bytes every NF4 projection carries beside its values: the 16-value NF4 codebook and the
#: 256-value codebook of the double-quantized scales (float32), and the scales' offset
_NF4_CONSTANTS = 4 * (16 + 256 + 1)


def weight_bytes(model: ModelShape, dtype_bytes: int, quantization: str = "none") -> int:
    """Bytes of the base's weights in memory.

    Under ``quantization`` bitsandbytes replaces each decoder layer's projection (q, k, v, o, gate,
    up, down) and keeps the embeddings, the norms, the biases and the output head in the model
    dtype: ``4bit`` (NF4, double-quantized) holds half a byte per value, one byte of scale per
    block of 64, a float32 per 256 such scales and its two codebooks (about 1 KiB a projection);
    ``8bit`` (LLM.int8) one byte per value and a float32 scale per output row.
    """
    total = model.n_parameters * dtype_bytes
    if quantization == "none":
        return total
    projections = [model.site_widths(site) for site in PROJECTION_SITES]
    values = model.num_layers * sum(i * o for i, o in projections)
    if quantization == "4bit":
        def nf4(n: int) -> int:  # packed values, a byte of scale per 64, a float32 per 256 scales, codebooks
            blocks = -(-n // 64)
            return -(-n // 2) + blocks + 4 * -(-blocks // 256) + _NF4_CONSTANTS

        packed = model.num_layers * sum(nf4(i * o) for i, o in projections)
    elif quantization == "8bit":
        packed = values + 4 * model.num_layers * sum(o for _, o in projections)
    else:
        raise ValueError(f"quantization {quantization!r}: use none, 4bit or 8bit")
    return total - values * dtype_bytes + packed


def dequantized_workspace(model: ModelShape, dtype_bytes: int, quantization: str = "none") -> int:
    """Bytes of the one projection weight bitsandbytes dequantizes to the model dtype for a call
    (forward or backward) under ``quantization``; 0 for none."""
    if quantization == "none":
        return 0
    return max(i * o for i, o in (model.site_widths(site) for site in PROJECTION_SITES)) * dtype_bytes


def writer_buffer_bytes(chunk_size: int, stored: int, storage_dtype: str) -> int:
    """Host bytes of the index writer's chunk buffer: ``C W (8 + 3 s')`` (module doc)."""
    return chunk_size * stored * (2 * 4 + 3 * DTYPE_BYTES[storage_dtype])


def stream_chunk_bytes(chunk_size: int, stored: int, widest: int, storage_dtype: str) -> int:
    """Host bytes of a stream's chunk in flight: ``C W (4 + 2 s') + 4 C w`` (module doc)."""
    return chunk_size * stored * (4 + 2 * DTYPE_BYTES[storage_dtype]) + 4 * chunk_size * widest


def index_bytes(n: int, widths: Sequence[int], storage_dtype: str, chunk_size: int) -> int:
    """Bytes of ``chunks/*.npy`` for ``n`` examples: the data (``n x sum(widths)`` values) and the
    float64 squared norms (``n x blocks``), each chunk file with its npy header."""
    chunks = -(-n // chunk_size) if n else 0
    data = n * sum(widths) * DTYPE_BYTES[storage_dtype]
    norms = n * len(widths) * 8
    return data + norms + 2 * chunks * NPY_HEADER_BYTES


def _layer_activations(model: ModelShape, batch: BatchShape, s: int, attn: str) -> dict[str, int]:
    """Bytes autograd saves for one Llama-style layer, by part."""
    n, b, t = batch.tokens, batch.rows, batch.width
    h, i, heads = model.hidden_size, model.intermediate_size, model.num_heads
    q = n * heads * model.head_dim
    norm_bytes = 4 if s <= 4 else s
    norm = n * h * norm_bytes + n * 4
    if attn == "eager":
        attention = 3 * q * s + b * heads * t * t * 4 + (b * heads * t * t * s if s != 4 else 0)
    else:  # sdpa / flash: no t^2 probabilities; the CPU kernels keep a copy of the additive mask
        attention = 4 * q * s + 4 * b * heads * t + (b * t * t * s if attn == "sdpa" else 0)
    if model.model_type == "qwen3":  # per-head q and k RMSNorms keep float32 copies
        attention += n * (heads + model.num_kv_heads) * model.head_dim * 4
    return {"input_norm": norm, "attention": attention, "post_norm": norm, "mlp": 3 * n * i * s}


def estimate_memory(model: ModelShape, linears: Sequence[LoraLinear], batch: BatchShape,
                    settings: CaptureSettings) -> MemoryEstimate:
    """Predicted bytes of capturing one batch's per-example gradients (see the module docstring)."""
    from gradian.grads.loss import loss_chunk_positions

    s, a = settings.model_bytes, settings.adapter_bytes
    n, b, t = batch.tokens, batch.rows, batch.width
    h, i, v = model.hidden_size, model.intermediate_size, model.vocab_size
    q = n * model.num_heads * model.head_dim
    weights = weight_bytes(model, s, settings.quantization)
    adapter = sum(lin.r * (lin.in_features + lin.out_features) for lin in linears) * a

    sites_by_layer: dict[int, set[str]] = {}
    for lin in linears:
        sites_by_layer.setdefault(lin.layer, set()).add(lin.site)
    activations = 0
    if sites_by_layer:
        first = min(sites_by_layer)
        part = _layer_activations(model, batch, s, settings.attn_implementation)
        full = sum(part.values())
        first_sites = sites_by_layer[first]
        if first_sites & set(_ATTENTION_SITES):
            activations += full - part["input_norm"]  # the layer's input needs no gradient
        elif "o_proj" in first_sites:
            activations += part["post_norm"] + part["mlp"]
        elif first_sites & {"gate_proj", "up_proj"}:
            activations += part["mlp"]
        activations += (model.num_layers - 1 - first) * full
        activations += part["input_norm"]  # the final norm

    hooks = 0
    for sites in sites_by_layer.values():
        if sites & set(_ATTENTION_SITES):
            hooks += n * h * s
        if "o_proj" in sites:
            hooks += q * s
        if sites & {"gate_proj", "up_proj"}:
            hooks += n * h * s
        if "down_proj" in sites:
            hooks += n * i * s
    hooks += sum(n * lin.r * a for lin in linears)

    logits = n * v * s
    chunk = min(max(batch.supervised, 1), loss_chunk_positions(v, max(4, s)))
    # the chunk's upcast copy, and in half precision its pre-upcast copy or its cast back
    loss_backward = n * v * s + chunk * v * (max(4, s) + (s if s < 4 else 0))
    if settings.attn_implementation == "eager":
        layer_backward = b * model.num_heads * t * t * (s + 8)
    else:
        layer_backward = 4 * q * s
    layer_backward += 3 * n * i * s + dequantized_workspace(model, s, settings.quantization)

    out_bytes = 8 if s == 8 else 4
    blocks = block_widths(linears, settings.block_granularity, settings.projection_dim, settings.projection_kind)
    total_dim = sum(d for d, _ in blocks)
    stored = sum(w for _, w in blocks)
    grads = b * total_dim * out_bytes
    after = grads
    if settings.normalization != "none":
        after += b * total_dim * out_bytes
    cache = 0
    if settings.projection_dim:
        widest = max((d for d, w in blocks if w < d), default=0)
        after += b * stored * out_bytes + b * widest * out_bytes
        if settings.projection_kind == "rademacher":
            cache = sum(w * d for d, w in blocks if w < d)
            after += settings.projection_dim * widest * out_bytes
    capture = activations + hooks + grads + max(logits + loss_backward, layer_backward)
    peak = weights + adapter + cache + max(capture, after)
    writer = writer_buffer_bytes(settings.chunk_size, stored, settings.storage_dtype)
    in_flight = stream_chunk_bytes(settings.chunk_size, stored, max((w for _, w in blocks), default=0),
                                   settings.storage_dtype)
    return MemoryEstimate(
        weights=weights, adapter_weights=adapter, activations=activations, hook_inputs=hooks, logits=logits,
        loss_backward=loss_backward, layer_backward=layer_backward, per_example_grads=grads, after_pass=after,
        projection_cache=cache, peak=peak, writer_buffer=writer, stream_chunk=in_flight,
    )
