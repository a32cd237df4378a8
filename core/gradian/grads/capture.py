"""Per-example gradients over the LoRA blocks, by three strategies that must agree.

Interface: ``capture_per_example_grads(gm, batch, strategy, reduction)`` returns
``{block name: tensor [batch, block dim]}``, the gradient of each row's own loss with respect to
the block's weights (flattened row-major, A before B). Units: nats per unit weight.

- ``hooks`` (default): one forward and one backward of the *sum* of the rows' losses. Rows do not
  interact in an eval-mode causal LM, so the gradient of the sum with respect to a LoRA Linear's
  output, restricted to row ``b``, is row ``b``'s own output gradient ``G_b``. With the Linear's
  input ``X_b``, the weight gradient of row ``b`` is ``sum_t G_b[t] X_b[t]^T``
  (``bmm(G^T, X)``): exact, not an approximation. A tensor hook on each output turns ``G`` into
  the per-example product the moment autograd has it and lets it go, so no output gradient
  outlives its layer's backward. The LoRA weights are frozen during the pass (the gradient flows
  from a zero scalar added to the first LoRA inputs), so no weight gradient is formed and
  autograd saves no LoRA input for one. The product runs in float32
  (float64 for a float64 model) whatever the model's dtype, from the tensors the model already
  holds: the only copies are the upcasts a bfloat16 or float16 model needs. Memory beyond a
  plain forward and backward: the ``[rows, block dim]`` results, and one product at a time.
- ``loop``: the reference; one forward/backward per row, unpadded.
- ``vmap``: ``torch.func.vmap(grad(...))`` over rows. Opt-in: transformers forwards are not always
  vmappable, and the loss must avoid data-dependent shapes there (it masks instead of gathering).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from gradian.errors import ConfigError
from gradian.grads.hooks import GradientTaker, OutputGradientHooks
from gradian.grads.loss import TokenBatch, per_example_loss

if TYPE_CHECKING:
    import torch
    from peft.tuners.lora import LoraLayer
    from torch import nn

    from gradian.grads.model import GradientModel

__all__ = ["capture_per_example_grads", "linear_inputs_and_output_grads", "output_gradient_pass", "STRATEGIES"]

STRATEGIES = ("hooks", "loop", "vmap")


def _out_dtype(gm: GradientModel) -> torch.dtype:
    import torch

    return torch.promote_types(gm.dtype, torch.float32)


def capture_per_example_grads(gm: GradientModel, batch: TokenBatch, strategy: str = "hooks",
                              reduction: str = "mean") -> dict[str, torch.Tensor]:
    """``{block: [rows, dim]}`` per-example gradients of ``batch`` under ``gm`` (a GradientModel)."""
    if strategy == "hooks":
        return _capture_hooks(gm, batch, reduction)
    if strategy == "loop":
        return _capture_loop(gm, batch, reduction)
    if strategy == "vmap":
        return _capture_vmap(gm, batch, reduction)
    raise ConfigError(f"grads.strategy '{strategy}' is not one of {', '.join(STRATEGIES)}")


def _flatten_blocks(gm: GradientModel, per_linear: dict[int, torch.Tensor],
                    out_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import torch

    out = {}
    for block in gm.blocks:
        parts = [per_linear[id(lin)].flatten(1).to(out_dtype) for lin in block.linears]
        out[block.name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out


def linear_inputs_and_output_grads(
    gm: GradientModel, batch: TokenBatch, reduction: str = "mean",
    labels: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[int, nn.Linear], dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """One forward and one backward of the summed per-row losses, seen from every LoRA Linear.

    Returns ``(linears, io)``: ``linears`` maps ``id(module)`` to the ``nn.Linear``; ``io`` maps it
    to one ``(x, g)`` pair per call of the module in the forward, ``x`` its input
    ``[rows, tokens, in]`` and ``g`` the gradient of the summed loss with respect to its output
    ``[rows, tokens, out]`` (zeros when the output did not reach the loss). Row ``b`` of ``g`` is
    row ``b``'s own output gradient, since rows do not interact. ``labels`` replaces the batch's
    labels (curvature fits with labels sampled from the model); it may be a callable that takes
    the logits and returns the labels. This is the one hook pass that both the per-example
    gradients and the Kronecker curvature factors are computed from.
    """
    import torch

    linears = {id(lin): lin for block in gm.blocks for lin in block.linears}
    calls: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {key: [] for key in linears}

    def remember(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        calls[id(module)].append((inputs[0].detach(), output))

    handles = [lin.register_forward_hook(remember) for lin in linears.values()]
    try:
        with torch.enable_grad():
            logits = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            target = batch.labels if labels is None else (labels(logits) if callable(labels) else labels)
            total = per_example_loss(logits, target, reduction).sum()
            outputs = [out for key in linears for _, out in calls[key]]
            grads = torch.autograd.grad(total, outputs, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    io: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {key: [] for key in linears}
    k = 0
    for key in linears:
        for x, out in calls[key]:
            g = grads[k]
            k += 1
            if g is None:
                g = torch.zeros_like(out)
            io[key].append((x.reshape(x.shape[0], -1, x.shape[-1]), g.detach().reshape(g.shape[0], -1, g.shape[-1])))
    return linears, io


def _lora_parents(gm: GradientModel) -> dict[int, LoraLayer]:
    """``id(lora_A Linear) -> the LoRA layer that calls it``, for the blocks' A matrices."""
    from peft.tuners.lora import LoraLayer

    a_name = LoraLayer.adapter_layer_names[0]
    wanted = {id(lin) for block in gm.blocks for lin in block.linears}
    parents = {}
    for module in gm.model.modules():
        if isinstance(module, LoraLayer) and gm.adapter_name in getattr(module, a_name):
            lin = getattr(module, a_name)[gm.adapter_name]
            if id(lin) in wanted:
                parents[id(lin)] = module
    return parents


def _capture_hooks(gm: GradientModel, batch: TokenBatch, reduction: str) -> dict[str, torch.Tensor]:
    import torch

    out_dtype = _out_dtype(gm)
    rows = len(batch)
    device = gm.device
    # each block's result is allocated once; each linear adds its [rows, out, in] share in place
    results: dict[str, torch.Tensor] = {}
    targets: dict[int, torch.Tensor] = {}
    for block in gm.blocks:
        flat = torch.zeros((rows, block.dim), dtype=out_dtype, device=device)
        results[block.name] = flat
        offset = 0
        for lin, (o, i) in zip(block.linears, block.shapes):
            targets[id(lin)] = flat[:, offset : offset + o * i].view(rows, o, i)
            offset += o * i
    products = _PerExampleProducts(targets, _lora_parents(gm), {}, out_dtype)
    _differentiate(gm, batch, reduction, products)
    return results


def output_gradient_pass(gm: GradientModel, batch: TokenBatch, reduction: str) -> None:
    """The forward and backward the ``hooks`` capture makes for ``batch``, without forming any
    per-example gradient: for the output-gradient hooks of something else active meanwhile (a
    ``KroneckerCollector``), which then sees exactly the inputs and output gradients the capture
    of the same batch would show it."""
    _differentiate(gm, batch, reduction, None)


def _differentiate(gm: GradientModel, batch: TokenBatch, reduction: str, products: "_PerExampleProducts | None") -> None:
    """One forward of ``batch`` and one backward of its summed per-row losses down to the LoRA
    matrices' inputs, with ``products`` (if any) attached to every LoRA Linear."""
    import torch

    out_dtype = _out_dtype(gm)
    device = gm.device
    parent_input = products.parent_input if products is not None else {}
    # The LoRA weights are frozen for this pass: autograd then saves no LoRA input for a weight
    # gradient nobody asks for (PEFT runs a float32 adapter on a float32 copy of a half-precision
    # input, one copy per module). The gradient instead starts at ``anchor``, a zero added to the
    # input of each LoRA matrix that nothing upstream makes differentiable (the first layers'), so
    # every output the hooks see requires grad as usual; its own gradient is one scalar.
    # When something upstream already makes them differentiable (PEFT's and the Trainer's
    # ``enable_input_require_grads``, set for gradient checkpointing or k-bit training), no anchor
    # is added and the backward starts from the first such input instead.
    anchor = torch.zeros((), dtype=out_dtype, device=device, requires_grad=True)
    used_anchor = []
    differentiable_inputs: list[torch.Tensor] = []

    def keep_parent_input(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        parent_input[id(module)] = inputs[0]

    # modules that read one input (q/k/v, gate/up) get one anchored copy of it, not one each
    anchored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start_gradient(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        x = inputs[0]
        if x.requires_grad:
            if not differentiable_inputs:
                differentiable_inputs.append(x)
            return None
        used_anchor.append(True)
        held = anchored.get(id(x))
        if held is None or held[0] is not x:
            held = anchored[id(x)] = (x, x + anchor.to(x.dtype))
        return (held[1], *inputs[1:])

    lora_weights = [p for block in gm.blocks for p in block.parameters]
    was_trainable = [p.requires_grad for p in lora_weights]
    handles = ([parent.register_forward_pre_hook(keep_parent_input) for parent in products.parents.values()]
               if products is not None else [])
    linears = [lin for block in gm.blocks for lin in block.linears]
    handles += [lin.register_forward_pre_hook(start_gradient) for lin in linears]
    if products is not None:
        products.attach(linears)
    try:
        for p in lora_weights:
            p.requires_grad_(False)
        with torch.enable_grad():
            logits = gm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            parent_input.clear()
            anchored.clear()
            total = per_example_loss(logits, batch.labels, reduction).sum()
            del logits
            roots = ([anchor] if used_anchor else []) + differentiable_inputs
            if roots and total.requires_grad:
                torch.autograd.grad(total, roots, allow_unused=True)
            differentiable_inputs.clear()
    finally:
        for handle in handles:
            handle.remove()
        if products is not None:
            products.remove()
        for p, flag in zip(lora_weights, was_trainable):
            p.requires_grad_(flag)


class _PerExampleProducts(OutputGradientHooks):
    """Each row's weight gradient of every LoRA Linear, ``bmm(g^T, x)``, added in place into its
    slice of the block's result the moment autograd has the call's output gradient."""

    def __init__(self, targets: dict[int, torch.Tensor], parents: dict[int, LoraLayer],
                 parent_input: dict[int, torch.Tensor], out_dtype: torch.dtype) -> None:
        super().__init__()
        self.targets, self.parents, self.parent_input, self.out_dtype = targets, parents, parent_input, out_dtype

    def on_call(self, module: nn.Module, x: torch.Tensor) -> GradientTaker:
        import torch

        parent = self.parents.get(id(module))
        if parent is not None:
            # A's input is the layer's input cast to the adapter's dtype (dropout is off in eval
            # mode): keep the layer's own tensor, shared by the modules that read it, and upcast
            # inside the product instead of holding PEFT's copy
            original = self.parent_input.get(id(parent))
            if original is not None and original.shape == x.shape:
                x = original.detach()
        target, out_dtype = self.targets[id(module)], self.out_dtype

        def take(g: torch.Tensor) -> None:
            g3 = g.reshape(g.shape[0], -1, g.shape[-1])
            x3 = x.reshape(x.shape[0], -1, x.shape[-1])
            # [rows, out, tokens] @ [rows, tokens, in]: the transpose is a stride change, not a copy
            target.add_(torch.bmm(g3.transpose(1, 2).to(out_dtype), x3.to(out_dtype)))
        return take


def _capture_loop(gm: GradientModel, batch: TokenBatch, reduction: str) -> dict[str, torch.Tensor]:
    import torch

    linears = [lin for block in gm.blocks for lin in block.linears]
    weights = [lin.weight for lin in linears]
    rows: list[list[torch.Tensor]] = []
    for i in range(len(batch)):
        one = batch.row(i)
        with torch.enable_grad():
            logits = gm.model(input_ids=one.input_ids, attention_mask=one.attention_mask).logits
            loss = per_example_loss(logits, one.labels, reduction).sum()
            grads = torch.autograd.grad(loss, weights, allow_unused=True)
        rows.append([torch.zeros_like(w) if g is None else g for g, w in zip(grads, weights)])
    per_linear = {id(lin): torch.stack([r[j] for r in rows]) for j, lin in enumerate(linears)}
    return _flatten_blocks(gm, per_linear, _out_dtype(gm))


def _masked_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """Same value as ``per_example_loss`` for one row, without data-dependent shapes (for vmap)."""
    import torch
    import torch.nn.functional as F

    shifted = labels[:, 1:]
    keep = (shifted != -100)
    upcast = torch.promote_types(logits.dtype, torch.float32)
    token = F.cross_entropy(logits[:, :-1].to(upcast).transpose(1, 2), shifted.clamp(min=0), reduction="none")
    total = (token * keep).sum(dim=1)
    if reduction == "mean":
        total = total / keep.sum(dim=1).clamp(min=1).to(upcast)
    return total


def _capture_vmap(gm: GradientModel, batch: TokenBatch, reduction: str) -> dict[str, torch.Tensor]:
    import torch
    from torch.func import functional_call, grad, vmap

    names = {id(p): n for n, p in gm.model.named_parameters()}
    linears = [lin for block in gm.blocks for lin in block.linears]
    params = {names[id(lin.weight)]: lin.weight.detach() for lin in linears}

    def loss_of_row(p: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # No attention mask: with right padding, causal attention already keeps pads out of the
        # real positions, and mask construction is where transformers forwards break under vmap.
        logits = functional_call(gm.model, p, args=(), kwargs={"input_ids": ids.unsqueeze(0)}, strict=False).logits
        return _masked_loss(logits, labels.unsqueeze(0), reduction)[0]

    with torch.enable_grad():
        grads = vmap(grad(loss_of_row), in_dims=(None, 0, 0))(params, batch.input_ids, batch.labels)
    per_linear = {id(lin): grads[names[id(lin.weight)]] for lin in linears}
    return _flatten_blocks(gm, per_linear, _out_dtype(gm))
