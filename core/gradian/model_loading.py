"""Loading what a user trained: the tokenizer, the base model and the LoRA adapter, from disk.

One place for every lane (evaluation, gradients, training), so a model is resolved, typed,
placed and checked the same way everywhere:

- ``resolve_device`` / ``resolve_dtype``: ``auto`` is CUDA when visible, else CPU; float32 on CPU
  (half-precision matmuls are slow and inexact there), bfloat16 on a GPU that supports it;
- ``load_tokenizer``: the fast tokenizer (loss masks need character offsets), pad set to EOS when
  the tokenizer has none (padding is always masked out);
- ``load_peft_model``: the base model with the adapter attached, in eval mode (dropout off), with
  clear errors for a missing or foreign adapter. PEFT only warns when saved adapter weights match
  no module of the base; here that is an error, because a silently half-loaded adapter would
  measure and differentiate the wrong model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gradian.errors import ModelLoadError

__all__ = ["resolve_device", "resolve_dtype", "load_tokenizer", "load_peft_model", "read_adapter_config"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")


def resolve_device(name: str = "auto") -> Any:
    """A ``torch.device``: ``auto`` is CUDA when visible, else CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device is {name!r} but no CUDA device is visible; set device: cpu (or auto) in the config")
    return torch.device(name)


def resolve_dtype(name: str, device: Any) -> Any:
    """A ``torch.dtype`` for ``name`` on ``device``."""
    import torch

    if name == "auto":
        if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype is {name!r}; use auto, {', '.join(_DTYPES)}")
    return getattr(torch, name)


def load_tokenizer(name: str, trust_remote_code: bool = False, flag: str = "--base-model") -> Any:
    """``AutoTokenizer.from_pretrained(name)`` (fast); a failure names the flag it came from."""
    from transformers import AutoTokenizer

    if not name:
        raise ModelLoadError(f"no tokenizer to load: pass {flag} (a local model directory or a hub id)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, use_fast=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, hub errors...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(
            f"{flag} {name}: cannot load its tokenizer ({first}); pass a local model directory or a "
            "hub id available offline"
        ) from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def read_adapter_config(adapter: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a LoRA adapter directory, checked."""
    adapter_dir = Path(adapter)
    if not adapter_dir.is_dir():
        raise ModelLoadError(f"adapter directory not found: {adapter_dir}; pass --adapter/-a or set adapter_path")
    path = adapter_dir / "adapter_config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"{adapter_dir} has no adapter_config.json, so it is not a PEFT adapter directory; point "
            "--adapter at the folder holding adapter_config.json and adapter_model.safetensors"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    peft_type = str(data.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ModelLoadError(f"{path}: peft_type is {peft_type}; Gradian works with LoRA adapters only")
    return data


def load_peft_model(base: str | None, adapter: str | Path, config: Any = None) -> Any:
    """The base model (``base``, or the adapter's recorded base) with ``adapter`` attached, in eval mode.

    ``config`` is a ``GradianConfig``: its ``device``, ``dtype``, ``attn_implementation`` and
    ``trust_remote_code`` are used; ``None`` means the defaults.
    """
    from transformers import AutoModelForCausalLM

    from gradian.config import GradianConfig

    config = config or GradianConfig()
    adapter_dir = Path(adapter)
    adapter_config = read_adapter_config(adapter_dir)
    base = base or adapter_config.get("base_model_name_or_path") or ""
    if not base:
        raise ModelLoadError("no base model given; pass --base-model/-m or set base_model in the config")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code,
        )
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load base model '{base}' ({str(err).splitlines()[0]}); check base_model / --base-model"
        ) from None
    peft_model = _attach_adapter(model, adapter_dir, base)
    peft_model.to(device)
    peft_model.eval()
    return peft_model


def _attach_adapter(model: Any, adapter_dir: Path, base: str) -> Any:
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    except (RuntimeError, ValueError, KeyError, OSError) as err:
        lines = str(err).strip().splitlines()
        reason = next((line for line in lines if "size mismatch" in line or "not found" in line), lines[0] if lines else "")
        raise ModelLoadError(
            f"adapter {adapter_dir} does not fit base model '{base}' ({reason.strip()[:300]}); "
            "the adapter was trained on another base: pass the base it was trained from"
        ) from None
    _check_every_adapter_weight_loaded(peft_model, adapter_dir, base)
    return peft_model


def _check_every_adapter_weight_loaded(peft_model: Any, adapter_dir: Path, base: str) -> None:
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        return
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        saved = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    params = {name: tuple(p.shape) for name, p in peft_model.named_parameters()}
    adapter_name = peft_model.active_adapter
    missing = []
    for key, shape in saved.items():
        stem, _, last = key.rpartition(".")
        candidate = f"{stem}.{adapter_name}.{last}"
        if params.get(candidate) != shape and params.get(key) != shape:
            missing.append(key)
    if missing:
        raise ModelLoadError(
            f"adapter {adapter_dir}: {len(missing)} saved weight(s) match no module of base model "
            f"'{base}' (first: {missing[0]}); the adapter was trained on another base"
        )
