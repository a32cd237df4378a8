"""Load the base model and its LoRA adapter once, as one ``PeftModel``.

The base model is never loaded a second time: the evaluate lane scores it by running the same
``PeftModel`` inside ``model.disable_adapter()``, which bypasses every LoRA layer. A caller that
already holds a loaded ``PeftModel`` (the attribution lane, a notebook) passes it to
``evaluate_capability`` and nothing is loaded at all.

``device: auto`` picks CUDA when it is visible, else CPU (never MPS). ``dtype: auto`` is float32
on CPU, where half precision is slow and inexact, and the checkpoint's own dtype elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradian.errors import ModelLoadError

__all__ = ["load_tuned_model", "load_tokenizer", "resolve_device", "resolve_dtype"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when visible, else ``cpu``; anything else is returned unchanged."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device is {device!r} but no CUDA device is visible; set device: cpu (or auto) in the config"
        )
    return device


def resolve_dtype(dtype: str, device: str) -> Any:
    """A ``torch.dtype``, or the string ``"auto"`` (the checkpoint's dtype) on accelerators."""
    import torch

    if dtype == "auto":
        return torch.float32 if device == "cpu" else "auto"
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype is {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return getattr(torch, dtype)


def load_tokenizer(config: Any) -> Any:
    """The tokenizer named by ``tokenizer`` (or ``base_model``), with a pad token set."""
    from transformers import AutoTokenizer

    source = config.tokenizer or config.base_model
    if not source:
        raise ModelLoadError("base_model is empty; set base_model (a hub id or local path) in the config")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as err:
        key = "tokenizer" if config.tokenizer else "base_model"
        raise ModelLoadError(f"{key} {source!r}: cannot load a tokenizer ({err}); check the path or hub id") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        # padding is always masked out; EOS is the conventional stand-in for a model without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tuned_model(config: Any, adapter_path: str | Path | None = None) -> tuple[Any, Any]:
    """``(peft_model, tokenizer)``: the base model with the adapter attached, in eval mode.

    ``adapter_path`` defaults to ``config.adapter_path``. Dropout is off (``eval()``), so every
    forward pass is deterministic.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = adapter_path if adapter_path is not None else config.adapter_path
    if not adapter:
        raise ModelLoadError(
            "adapter_path is not set; the evaluate lane compares the base model with the fine-tune, "
            "so set adapter_path (a PEFT LoRA adapter directory) in the config or pass --adapter"
        )
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").exists():
        raise ModelLoadError(
            f"adapter_path {str(adapter)!r} has no adapter_config.json; point it at the directory "
            "PEFT's save_pretrained wrote (it holds adapter_config.json and adapter_model.safetensors)"
        )
    if not config.base_model:
        raise ModelLoadError("base_model is empty; set base_model (a hub id or local path) in the config")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = load_tokenizer(config)
    try:
        base = AutoModelForCausalLM.from_pretrained(
            config.base_model,
            dtype=dtype,
            attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"base_model {config.base_model!r}: cannot load it as a causal LM ({err}); check the path or hub id"
        ) from None
    try:
        model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ModelLoadError(
            f"adapter_path {str(adapter)!r}: cannot attach it to {config.base_model!r} ({err}); "
            "check that the adapter was trained from this base model"
        ) from None
    model.to(device)
    model.eval()
    return model, tokenizer
