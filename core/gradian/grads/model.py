"""The model as attribution sees it: a frozen base plus a PEFT LoRA adapter, in eval mode.

Interface: ``load_model_for_gradients(base, adapter, config)`` loads both from disk;
``wrap_peft_model(model, config)`` adopts a PEFT model already in memory (tests, notebooks).
Both return a ``GradientModel`` whose ``blocks`` are the units every later stage works in: one
block per LoRA ``Linear`` module (``block_granularity: module``, A and B concatenated) or one per
A/B matrix (``matrix``). Blocks are discovered from PEFT's own layer classes and the names it
declares (``LoraLayer.adapter_layer_names``), never by guessing parameter names.

Only ``nn.Linear`` LoRA pairs become blocks; LoRA on embeddings or convolutions is skipped and
reported in ``GradientModel.skipped``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, TypedDict

from gradian.errors import ModelLoadError

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from torch import nn

    from gradian.config import GradianConfig
    from gradian.findings import Finding

__all__ = [
    "BlockSpec",
    "GradientBlock",
    "GradientModel",
    "load_model_for_gradients",
    "skipped_modules_finding",
    "wrap_peft_model",
    "fingerprint_path",
]

#: prefix PEFT puts in front of the wrapped model's module names
_PEFT_PREFIX = "base_model.model."


class BlockSpec(TypedDict):
    """One block as the index manifest records it (``GradientModel.spec``)."""

    name: str
    module: str
    shapes: list[list[int]]
    dim: int


@dataclass
class GradientBlock:
    """One unit of the per-example gradient.

    ``name`` is the short module name (``model.layers.0.mlp.down_proj``), with ``.lora_A`` or
    ``.lora_B`` appended under matrix granularity. ``linears`` are the ``nn.Linear`` modules whose
    weight gradients make up the block, in storage order; ``dim`` is the flattened length.
    """

    name: str
    module_name: str
    linears: list[nn.Linear]
    shapes: list[tuple[int, int]]

    @property
    def dim(self) -> int:
        return sum(o * i for o, i in self.shapes)

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [lin.weight for lin in self.linears]


@dataclass
class GradientModel:
    """A PEFT model ready for per-example gradients, and the blocks it is measured in."""

    model: PeftModel
    blocks: list[GradientBlock]
    adapter_name: str
    granularity: str
    module_filter: str | None
    #: content fingerprints of what was loaded ({"base": ..., "adapter": ...})
    fingerprints: dict[str, str] = field(default_factory=dict)
    #: LoRA modules that are not Linear (embeddings, convolutions): not indexed
    skipped: list[str] = field(default_factory=list)

    @property
    def dim(self) -> int:
        return sum(b.dim for b in self.blocks)

    @property
    def device(self) -> torch.device:
        return next(p for b in self.blocks for p in b.parameters).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p for b in self.blocks for p in b.parameters).dtype

    @property
    def block_names(self) -> list[str]:
        return [b.name for b in self.blocks]

    def spec(self) -> list[BlockSpec]:
        """Block names, module names and shapes, as written to the index manifest."""
        return [
            {"name": b.name, "module": b.module_name, "shapes": [list(s) for s in b.shapes], "dim": b.dim}
            for b in self.blocks
        ]


def load_model_for_gradients(base: str, adapter: str, config: GradianConfig | None = None) -> GradientModel:
    """Load ``base`` (hub id or directory) with the LoRA adapter directory ``adapter``.

    ``config`` is a ``GradianConfig`` (its ``device``, ``dtype``, ``attn_implementation``,
    ``trust_remote_code`` and ``grads.module_filter`` / ``grads.block_granularity`` are used);
    ``None`` means the defaults. Every parameter is frozen except the LoRA A/B weights of the
    selected blocks; dropout is off (eval mode).
    """
    from gradian.model_loading import load_peft_model, read_adapter_config

    base = base or read_adapter_config(adapter).get("base_model_name_or_path") or ""
    model = load_peft_model(base, adapter, config)
    gm = wrap_peft_model(model, config)
    gm.fingerprints = {"base": fingerprint_model(base, model), "adapter": fingerprint_path(Path(adapter))}
    return gm


def wrap_peft_model(model: PeftModel, config: GradianConfig | None = None) -> GradientModel:
    """Adopt an in-memory PEFT model: eval mode, everything frozen but the selected LoRA weights."""
    from peft.tuners.lora import LoraLayer
    from torch import nn

    from gradian.config import GradianConfig

    config = config or GradianConfig()
    module_filter = config.grads.module_filter
    granularity = config.grads.block_granularity
    try:
        pattern = re.compile(module_filter) if module_filter else None
    except re.error as err:
        raise ModelLoadError(f"grads.module_filter '{module_filter}' is not a valid regex ({err})") from None

    adapter_name = getattr(model, "active_adapter", "default")
    if isinstance(adapter_name, (list, tuple)):
        adapter_name = adapter_name[0]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)

    blocks: list[GradientBlock] = []
    skipped: list[str] = []
    seen_lora = 0
    a_name, b_name = LoraLayer.adapter_layer_names[0], LoraLayer.adapter_layer_names[1]
    for full_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        short = full_name[len(_PEFT_PREFIX):] if full_name.startswith(_PEFT_PREFIX) else full_name
        a_dict, b_dict = getattr(module, a_name), getattr(module, b_name)
        if adapter_name not in a_dict:
            if adapter_name in getattr(module, LoraLayer.adapter_layer_names[2], {}):
                skipped.append(short)
            continue
        seen_lora += 1
        lin_a, lin_b = a_dict[adapter_name], b_dict[adapter_name]
        if not (isinstance(lin_a, nn.Linear) and isinstance(lin_b, nn.Linear)):
            skipped.append(short)
            continue
        if adapter_name in getattr(module, "lora_variant", {}):
            skipped.append(short)  # DoRA and other variants change the forward; not hookable here
            continue
        if pattern is not None and not pattern.search(short):
            continue
        if granularity == "matrix":
            for suffix, lin in ((a_name, lin_a), (b_name, lin_b)):
                blocks.append(GradientBlock(f"{short}.{suffix}", short, [lin], [tuple(lin.weight.shape)]))
        else:
            blocks.append(GradientBlock(short, short, [lin_a, lin_b],
                                        [tuple(lin_a.weight.shape), tuple(lin_b.weight.shape)]))
    if not blocks:
        why = (
            f"none of the {seen_lora} LoRA Linear modules matches grads.module_filter '{module_filter}'"
            if seen_lora and pattern is not None
            else "the model has no LoRA Linear modules"
            + (f" (skipped non-Linear LoRA modules: {', '.join(skipped[:3])})" if skipped else "")
        )
        source = getattr(getattr(model, "peft_config", {}).get(adapter_name, None), "base_model_name_or_path", None)
        raise ModelLoadError(
            f"no LoRA blocks found for adapter '{adapter_name}'"
            + (f" of base '{source}'" if source else "")
            + f": {why}; widen or clear grads.module_filter (it matches names like "
            "'model.layers.0.mlp.down_proj')"
        )
    for block in blocks:
        for p in block.parameters:
            p.requires_grad_(True)
    return GradientModel(model=model, blocks=blocks, adapter_name=adapter_name, granularity=granularity,
                         module_filter=module_filter, skipped=skipped)


def fingerprint_path(path: str | Path, *, sample_over: int = 256 << 20) -> str:
    """sha256 over a file or a directory's files (relative names, sizes and bytes).

    Files larger than ``sample_over`` bytes contribute their size and their first and last
    16 MiB instead of every byte, so fingerprinting a multi-gigabyte base stays quick.
    """
    path = Path(path)
    digest = hashlib.sha256()
    files: Iterable[Path] = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        rel = f.name if path.is_file() else f.relative_to(path).as_posix()
        if rel.startswith(".") or "/." in rel or rel.endswith(".md"):
            continue
        size = f.stat().st_size
        digest.update(f"{rel}\0{size}\0".encode())
        with f.open("rb") as handle:
            if size <= sample_over:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            else:
                digest.update(handle.read(16 << 20))
                handle.seek(size - (16 << 20))
                digest.update(handle.read(16 << 20))
    return digest.hexdigest()


def fingerprint_model(base: str, model: PeftModel) -> str:
    """A local directory's content fingerprint, or ``<hub id>@<commit>`` for a hub model."""
    if Path(base).is_dir():
        return fingerprint_path(base)
    commit = getattr(getattr(model, "config", None), "_commit_hash", None)
    return f"{base}@{commit or 'unknown-revision'}"


def skipped_modules_finding(skipped: list[str], n_blocks: int) -> "Finding | None":
    """The finding that says which LoRA modules the gradients leave out (embedding or convolution
    LoRA, DoRA and other variants), or None when every LoRA module has a block."""
    from gradian.findings import Finding

    if not skipped:
        return None
    shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    return Finding(
        id="attribution.lora_modules_skipped",
        category="attribution",
        severity="medium",
        title=f"{len(skipped)} LoRA module{'s' if len(skipped) != 1 else ''} left out of the attribution",
        message=(
            f"The adapter has LoRA modules that are not pairs of Linear layers with the plain LoRA forward "
            f"({shown}). Their gradients are not captured, so the scores measure influence through the "
            f"other {n_blocks} block{'s' if n_blocks != 1 else ''} only: a row whose effect runs through "
            "the left-out modules is under-scored."
        ),
        evidence={"skipped_modules": list(skipped), "n_blocks": n_blocks},
        fix="Read the ranking as partial; for a complete one, train the LoRA on Linear layers only "
            "(target_modules without embed_tokens or convolutions, use_dora false).",
    )
