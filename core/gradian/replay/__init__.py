"""Exact metagradients through a replayed LoRA fine-tune (docs/replay.md).

``metagradient`` replays a training run with one weight per training row and returns the
derivative of a measurement taken after training with respect to those weights, by reverse
mode through every optimizer step. ``replay`` runs the same steps and returns the final LoRA
tensors only.
"""

from __future__ import annotations

from gradian.replay.unrolled import OPTIMIZERS, Recipe, ReplayResult, ReplayStart, metagradient, replay

__all__ = ["OPTIMIZERS", "Recipe", "ReplayResult", "ReplayStart", "metagradient", "replay"]
