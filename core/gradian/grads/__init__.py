"""Per-example gradients over a LoRA adapter: model loading, loss, capture, projection.

Public interface:
``load_model_for_gradients(base, adapter, config) -> GradientModel`` (and ``wrap_peft_model`` for
a PEFT model in memory); ``collate`` / ``per_example_loss`` (the loss from
logits, supervised positions gathered before the upcast); ``capture_per_example_grads(gm, batch,
strategy, reduction) -> {block: [rows, dim]}`` with strategies ``hooks`` | ``loop`` | ``vmap``;
``iter_example_gradients`` (batches, normalization, projection); ``BlockProjector``.
"""

from gradian.grads.capture import STRATEGIES, capture_per_example_grads, linear_inputs_and_output_grads
from gradian.grads.extract import NORMALIZATIONS, gradient_widths, iter_example_gradients, make_projector
from gradian.grads.loss import TokenBatch, collate, per_example_loss
from gradian.grads.model import (
    GradientBlock,
    GradientModel,
    fingerprint_path,
    load_model_for_gradients,
    skipped_modules_finding,
    wrap_peft_model,
)
from gradian.grads.projection import PROJECTION_KINDS, BlockProjector

__all__ = [
    "NORMALIZATIONS",
    "PROJECTION_KINDS",
    "STRATEGIES",
    "BlockProjector",
    "GradientBlock",
    "GradientModel",
    "TokenBatch",
    "capture_per_example_grads",
    "collate",
    "fingerprint_path",
    "gradient_widths",
    "iter_example_gradients",
    "linear_inputs_and_output_grads",
    "load_model_for_gradients",
    "make_projector",
    "per_example_loss",
    "skipped_modules_finding",
    "wrap_peft_model",
]
