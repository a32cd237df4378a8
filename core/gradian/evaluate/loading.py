"""Load the base model and its LoRA adapter once, as one ``PeftModel``.

The base model is never loaded a second time: the evaluate lane scores it by running the same
``PeftModel`` inside ``model.disable_adapter()``, which bypasses every LoRA layer. A caller that
already holds a loaded ``PeftModel`` (the attribution lane, a notebook) passes it to
``evaluate_capability`` and nothing is loaded at all. Loading itself is shared with every lane
(``gradian.model_loading``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gradian.errors import ModelLoadError

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from gradian.config import GradianConfig

__all__ = ["load_tuned_model"]


def load_tuned_model(config: GradianConfig,
                     adapter_path: str | Path | None = None) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """``(peft_model, tokenizer)``: the base model with the adapter attached, in eval mode.

    ``adapter_path`` defaults to ``config.adapter_path``. Dropout is off (``eval()``), so every
    forward pass is deterministic.
    """
    from gradian.model_loading import load_peft_model, load_tokenizer

    adapter = adapter_path if adapter_path is not None else config.adapter_path
    if not adapter:
        raise ModelLoadError(
            "adapter_path is not set; the evaluate lane compares the base model with the fine-tune, "
            "so set adapter_path (a PEFT LoRA adapter directory) in the config or pass --adapter"
        )
    if not config.base_model:
        raise ModelLoadError("base_model is empty; set base_model (a hub id or local path) in the config")
    model = load_peft_model(config.base_model, adapter, config)
    flag = "tokenizer (config)" if config.tokenizer else "base_model"
    tokenizer = load_tokenizer(config.tokenizer or config.base_model, config.trust_remote_code, flag)
    return model, tokenizer
