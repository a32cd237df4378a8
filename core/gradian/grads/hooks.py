"""The one hook mechanism over LoRA Linear layers: each call's input, then its output gradient.

Everything Gradian learns from a backward pass comes from the same two facts about a Linear
layer call: its input ``x`` and the gradient ``g`` of the loss with respect to its output. The
per-example gradients (``bmm(g^T, x)`` per row, ``gradian.grads.capture``) and the Kronecker
factors (``sum x x^T`` and ``sum g g^T``, ``gradian.grads.collectors``) are two uses of them.

``OutputGradientHooks`` holds the hooks: ``attach(linears)`` puts a forward hook on each layer
which, when the call's output takes part in the backward, asks ``on_call(module, x)`` for what to
do with that call's output gradient and registers it as a tensor hook, so it runs the moment
autograd has ``g`` and nothing keeps ``g`` afterwards. A use subclasses it and implements
``on_call``; ``remove()`` takes every hook off again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientTaker", "OutputGradientHooks"]

#: what is done with one call's output gradient ``g`` (``[rows, tokens, out]`` or flatter)
GradientTaker = Callable[["torch.Tensor"], None]


class OutputGradientHooks:
    """Forward hooks on Linear layers that hand each call's input and output gradient to a use."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def on_call(self, module: nn.Module, x: torch.Tensor) -> GradientTaker | None:
        """What to do with the output gradient of this call of ``module``, whose input was ``x``
        (detached); None to let this call go."""
        raise NotImplementedError

    def attach(self, linears: Iterable[nn.Module]) -> None:
        """Hook every layer of ``linears`` (in that order, after any hook already on them)."""
        self._handles += [lin.register_forward_hook(self._forward) for lin in linears]

    def remove(self) -> None:
        """Take off every hook ``attach`` put on."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not output.requires_grad:  # not part of the backward: there will be no gradient to take
            return
        take = self.on_call(module, inputs[0].detach())
        if take is not None:
            output.register_hook(take)
