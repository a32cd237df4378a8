"""Loading what a user trained: the tokenizer, the base model and the LoRA adapter, from disk.

One place for every lane (evaluation, gradients, training), so a model is resolved, typed,
placed and checked the same way everywhere:

- ``resolve_device`` / ``resolve_dtype``: ``auto`` is CUDA when visible, else CPU; float32 on CPU
  (half-precision matmuls are slow and inexact there), bfloat16 on a GPU that supports it;
- ``load_tokenizer``: the fast tokenizer (loss masks need character offsets), pad set to EOS when
  the tokenizer has none (padding is always masked out);
- ``load_peft_model``: the base model with the adapter attached, in eval mode (dropout off), with
  clear errors for a missing, damaged, incomplete or foreign adapter. PEFT only warns when saved
  adapter weights match no module of the base, or when a LoRA tensor a targeted module needs is
  not in the file (it then keeps its fresh initialization); here both are errors, because a
  silently half-loaded adapter would measure and differentiate the wrong model.
- ``check_adapter_weights``: what can be told from the adapter folder alone, before any model is
  loaded: a weights file is there and readable to its end, every value is finite, and the LoRA
  ranks agree with ``adapter_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gradian.errors import AdapterWeightsError, MissingDependencyError, ModelLoadError

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from gradian.config import GradianConfig

__all__ = ["resolve_device", "resolve_dtype", "load_tokenizer", "load_peft_model", "read_adapter_config",
           "check_adapter_weights", "check_attention_kernel", "quantized_loading", "bitsandbytes_config",
           "read_adapter_weights"]

_DTYPES = ("float32", "float16", "bfloat16", "float64")
#: weight files PEFT saves, in the order it looks for them
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_RESAVE = "copy the adapter folder again from the training run, or save it again with save_pretrained"


def resolve_device(name: str = "auto") -> torch.device:
    """A ``torch.device``: ``auto`` is CUDA when visible, else CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device is {name!r} but no CUDA device is visible; set device: cpu (or auto) in the config")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """A ``torch.dtype`` for ``name`` on ``device``."""
    import torch

    if name == "auto":
        if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype is {name!r}; use auto, {', '.join(_DTYPES)}")
    return getattr(torch, name)


def load_tokenizer(name: str, trust_remote_code: bool = False, flag: str = "--base-model") -> PreTrainedTokenizerBase:
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
    except UnicodeDecodeError as err:
        raise ModelLoadError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); {_RESAVE}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(
            f"{path}: holds a JSON {type(data).__name__}, not an object of LoRA settings; {_RESAVE}"
        )
    if "peft_type" not in data:
        raise ModelLoadError(
            f"{path}: no peft_type, so it is not a config PEFT wrote; add \"peft_type\": \"LORA\" if this "
            "is a LoRA adapter, or save the adapter again with save_pretrained"
        )
    peft_type = str(data["peft_type"]).upper()
    if peft_type != "LORA":
        raise ModelLoadError(f"{path}: peft_type is {peft_type}; Gradian works with LoRA adapters only")
    _check_lora_numbers(data, path)
    return data


def _check_lora_numbers(data: Mapping[str, object], path: Path) -> None:
    """``r`` a positive whole number and ``lora_alpha`` a finite positive number, in the config and
    in its per-module ``rank_pattern`` / ``alpha_pattern``: LoRA scales each update by alpha / r."""
    import math

    def bad(key: str, value: object, rule: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: {key} is {value!r}; it must be {rule}. The file was edited or "
                              f"damaged: {_RESAVE}")

    checks = [("r", data.get("r"), "int"), ("lora_alpha", data.get("lora_alpha"), "float")]
    for pattern, kind in (("rank_pattern", "int"), ("alpha_pattern", "float")):
        entries = data.get(pattern) or {}
        if isinstance(entries, dict):
            checks += [(f"{pattern}[{module!r}]", value, kind) for module, value in entries.items()]
    for key, value, kind in checks:
        if value is None and "pattern" not in key:
            continue  # PEFT's default applies
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(key, value, "a number")
        if kind == "int" and not (isinstance(value, int) and value >= 1):
            raise bad(key, value, "a whole number of at least 1 (the LoRA rank)")
        if kind == "float" and not (math.isfinite(value) and value > 0):
            raise bad(key, value, "a finite number greater than zero")


def _adapter_weights_path(adapter_dir: Path) -> Path:
    for name in _ADAPTER_WEIGHTS:
        if (adapter_dir / name).is_file():
            return adapter_dir / name
    raise AdapterWeightsError(
        f"{adapter_dir} has adapter_config.json but no adapter_model.safetensors (or .bin), so the "
        f"adapter's weights are missing; {_RESAVE}"
    )


def _read_adapter_tensors(weights: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an adapter weights file; a damaged or truncated file is one clear error."""
    if weights.stat().st_size == 0:
        raise AdapterWeightsError(f"{weights} is empty (0 bytes): the save or copy was interrupted; {_RESAVE}")
    if weights.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(weights))
        except SafetensorError as err:
            raise AdapterWeightsError(f"{weights} is damaged or truncated ({err}); {_RESAVE}") from None
    import torch

    try:
        state = torch.load(str(weights), map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and unpickler errors alike mean the file is unreadable
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AdapterWeightsError(f"{weights} is damaged or truncated ({first[:200]}); {_RESAVE}") from None
    if not isinstance(state, dict):
        raise AdapterWeightsError(f"{weights} does not hold a state dict of tensors; {_RESAVE}")
    return state


def read_adapter_weights(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an adapter folder's weights file, by its saved key; a missing, empty or
    damaged file is one ``AdapterWeightsError`` naming it."""
    return _read_adapter_tensors(_adapter_weights_path(Path(adapter_dir)))


def check_adapter_weights(adapter: str | Path, adapter_config: Mapping[str, object] | None = None) -> dict[str, tuple[int, ...]]:
    """Check an adapter folder's weights before a model is loaded; return ``{key: shape}``.

    Refused (``AdapterWeightsError``, one line naming the file): no weights file; a file that is
    empty, truncated or otherwise unreadable; a tensor holding NaN or infinite values; a LoRA
    factor whose rank differs from ``r`` in adapter_config.json (when no ``rank_pattern`` gives
    modules their own rank).
    """
    import torch

    adapter_dir = Path(adapter)
    adapter_config = adapter_config if adapter_config is not None else read_adapter_config(adapter_dir)
    weights = _adapter_weights_path(adapter_dir)
    tensors = _read_adapter_tensors(weights)
    if not tensors:
        raise AdapterWeightsError(f"{weights} holds no tensors; {_RESAVE}")
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterWeightsError(
                f"{weights}: {key} is stored as {str(tensor.dtype).replace('torch.', '')}, but LoRA weights are "
                f"floating point (float32, bfloat16, float16); the file was converted or quantized by "
                f"another tool: {_RESAVE}"
            )
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise AdapterWeightsError(
                f"{weights}: {key} has {bad} NaN or infinite value(s) of {tensor.numel()}; the training "
                "diverged or the file is damaged: use an earlier checkpoint, or retrain with a lower "
                "learning rate"
            )
    r = adapter_config.get("r")
    if isinstance(r, int) and not adapter_config.get("rank_pattern"):
        for key, tensor in tensors.items():
            parts = key.split(".")
            rank_dim = 0 if "lora_A" in parts else 1 if "lora_B" in parts else None
            if rank_dim is not None and tensor.dim() == 2 and tensor.shape[rank_dim] != r:
                raise AdapterWeightsError(
                    f"{weights}: {key} has rank {tensor.shape[rank_dim]} but {adapter_dir / 'adapter_config.json'} "
                    f"says r={r}; the config and the weights come from different saves: {_RESAVE}"
                )
    return {key: tuple(tensor.shape) for key, tensor in tensors.items()}


def _check_base_files(base: str) -> None:
    """A local base model's safetensors files must be readable to their end (header check only)."""
    folder = Path(base)
    if not folder.is_dir():
        return
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            if path.stat().st_size == 0:
                raise SafetensorError("empty file")
            with safe_open(str(path), framework="pt"):
                pass
        except SafetensorError as err:
            raise ModelLoadError(
                f"{path} is damaged or truncated ({err}); copy or download the base model again "
                "(--base-model / base_model)"
            ) from None


def check_attention_kernel(name: str) -> None:
    """``flash_attention_2`` needs the flash-attn package: say so before any weights are read."""
    import importlib.util

    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise MissingDependencyError(
            "attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed; "
            "install it on a CUDA machine (pip install flash-attn), or set attn_implementation: sdpa or eager"
        )


def finite_eager_masks() -> None:
    """Make transformers' eager attention masks of float64 models safe for rows that see nothing.

    The eager mask fills blocked positions with the smallest value of the model's dtype, and the
    eager attention of Llama-family models takes its softmax in float32. In float64 that fill
    becomes -inf in float32; a query that may attend to no position (a right-padded row past a
    sliding window, e.g. Mistral's) then gets NaN weights, and the NaN reaches the real tokens'
    gradients through the backward pass. Float64 masks are built with float32's smallest value
    instead: still exactly zero weight after the softmax, and a fully blocked row gets the finite
    weights float32 models give it. Other dtypes are untouched. Idempotent; process-wide, because
    transformers looks the mask function up in its global table.
    """
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    current = AttentionMaskInterface._global_mapping.get("eager")
    if current is None or getattr(current, "_gradian_finite", False):
        return

    def eager_mask_finite_in_float32(*args: object, dtype: torch.dtype = torch.float32,
                                     **kwargs: object) -> torch.Tensor | None:
        if dtype != torch.float64:
            return current(*args, dtype=dtype, **kwargs)
        mask = current(*args, dtype=torch.float32, **kwargs)
        return None if mask is None else mask.to(torch.float64)

    eager_mask_finite_in_float32._gradian_finite = True  # type: ignore[attr-defined]
    ALL_MASK_ATTENTION_FUNCTIONS.register("eager", eager_mask_finite_in_float32)


def load_peft_model(base: str | None, adapter: str | Path, config: GradianConfig | None = None) -> PeftModel:
    """The base model (``base``, or the adapter's recorded base) with ``adapter`` attached, in eval mode.

    ``config`` is a ``GradianConfig``: its ``device``, ``dtype``, ``quantization``,
    ``attn_implementation`` and ``trust_remote_code`` are used; ``None`` means the defaults.
    """
    from transformers import AutoModelForCausalLM

    from gradian.config import GradianConfig

    from safetensors import SafetensorError

    config = config or GradianConfig()
    check_attention_kernel(config.attn_implementation)
    adapter_dir = Path(adapter)
    adapter_config = read_adapter_config(adapter_dir)
    saved = check_adapter_weights(adapter_dir, adapter_config)  # before the (slow) base model load
    base = base or adapter_config.get("base_model_name_or_path") or ""
    if not base:
        raise ModelLoadError("no base model given; pass --base-model/-m or set base_model in the config")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    quantization = config.quantization
    kwargs = quantized_loading(quantization, dtype, device)
    quantized = bool(kwargs)
    _check_base_files(base)
    if config.attn_implementation == "eager":
        finite_eager_masks()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, attn_implementation=config.attn_implementation,
            trust_remote_code=config.trust_remote_code, **kwargs,
        )
    except ImportError as err:  # transformers' own check of the attention kernel's (or bitsandbytes') requirements
        if quantized and "bitsandbytes" in str(err).lower():
            raise MissingDependencyError(
                f"quantization: {quantization} cannot be used here ({str(err).splitlines()[0]}); "
                "pip install -U 'gradian-mlflow[quantize]', or set quantization: none"
            ) from None
        raise MissingDependencyError(
            f"attn_implementation: {config.attn_implementation} cannot be used here ({str(err).splitlines()[0]}); "
            "set attn_implementation: eager (the default) or sdpa"
        ) from None
    except (OSError, ValueError, SafetensorError) as err:
        raise ModelLoadError(
            f"cannot load base model '{base}' ({str(err).splitlines()[0]}); check base_model / --base-model"
        ) from None
    check_finite_weights(model, f"base model '{base}'", "its weights are damaged: copy or download the base "
                         "model again (--base-model / base_model)")
    if quantized:
        _one_cpu_kernel(model)
    peft_model = _attach_adapter(model, adapter_dir, base, saved)
    if not quantized:  # a quantized base was placed by its device_map (bitsandbytes refuses a later move)
        peft_model.to(device)
    check_finite_weights(peft_model, f"adapter {adapter_dir} in {str(dtype).replace('torch.', '')}",
                         f"its values overflow {str(dtype).replace('torch.', '')}: set dtype: float64 in the config "
                         "(a wider type), or use an earlier checkpoint", only="lora_")
    peft_model.eval()
    return peft_model


def quantized_loading(name: str, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """The ``from_pretrained`` arguments that load the base quantized by bitsandbytes (the
    ``quantization`` key): ``4bit`` is NF4 with double quantization of the block scales (QLoRA's
    recipe), ``8bit`` LLM.int8; both compute in ``dtype``. Empty for ``none``.

    bitsandbytes quantizes the weights as they are placed, so the model is put on ``device``
    while it loads (a ``device_map``) and never moved afterwards.
    """
    if name == "none":
        return {}
    quant = bitsandbytes_config(name, dtype)
    where: str | int = "cpu" if device.type == "cpu" else (device.index if device.index is not None else 0)
    return {"quantization_config": quant, "device_map": {"": where}}


def _one_cpu_kernel(model: PreTrainedModel) -> None:
    """Keep every 4-bit layer on bitsandbytes' general kernel on the CPU.

    On a CPU with bfloat16 AVX-512, bitsandbytes repacks a 4-bit weight in place the first time
    the layer runs without gradients (a generation), for an inference-only kernel. The repacking
    needs an output width divisible by 32 and fails otherwise (a 144-wide layer, say), and after
    it the measurement and the gradient passes would not run the same arithmetic. Turned off,
    every call dequantizes the same way, with or without gradients, whatever the shapes.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def bitsandbytes_config(name: str, dtype: torch.dtype, key: str = "quantization") -> Any:
    """The ``BitsAndBytesConfig`` of ``name`` (``4bit``: NF4, double-quantized scales, computing
    in ``dtype``; ``8bit``: LLM.int8), or a ``MissingDependencyError`` naming ``key`` and the
    extra when bitsandbytes is not installed. ``gradian train``'s ``train.load_in_4bit`` uses the
    same 4-bit recipe, so a base it trained against is the base ``quantization: 4bit`` loads."""
    if name not in ("4bit", "8bit"):
        raise ModelLoadError(f"quantization is {name!r}; use none, 4bit or 8bit")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        off = "quantization: none" if key == "quantization" else f"{key}: false"
        raise MissingDependencyError(
            f"{key} loads the base model {name} through bitsandbytes, which is not installed: "
            f"pip install 'gradian-mlflow[quantize]', or set {off}"
        ) from None
    import warnings

    from transformers import BitsAndBytesConfig

    if name == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype)
    # LLM.int8 casts a float32 input to float16 on every call and warns each time
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    return BitsAndBytesConfig(load_in_8bit=True)


def check_finite_weights(model: torch.nn.Module, what: str, fix: str, only: str | None = None) -> None:
    """Every floating-point parameter of ``model`` (those whose name holds ``only``, when given)
    free of NaN and infinity, or a ``ModelLoadError`` naming the first tensor that is not."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if (only is not None and only not in name) or not param.is_floating_point():
                continue
            if not bool(torch.isfinite(param).all()):
                bad = int((~torch.isfinite(param)).sum())
                raise ModelLoadError(f"{what}: {name} holds {bad} NaN or infinite value(s) of "
                                     f"{param.numel():,}; {fix}")


def _attach_adapter(model: PreTrainedModel, adapter_dir: Path, base: str,
                    saved: dict[str, tuple[int, ...]]) -> PeftModel:
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
    _check_every_adapter_weight_loaded(peft_model, adapter_dir, base, saved)
    return peft_model


def _check_every_adapter_weight_loaded(peft_model: PeftModel, adapter_dir: Path, base: str,
                                       saved: dict[str, tuple[int, ...]]) -> None:
    """Every saved weight landed on a module of the base, and every LoRA tensor the loaded
    modules need (PEFT's ``LoraLayer.adapter_layer_names`` of each targeted module) was saved,
    with the shape the module has."""
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    weights = _adapter_weights_path(adapter_dir)
    params = {name: tuple(p.shape) for name, p in peft_model.named_parameters()}
    adapter_name = peft_model.active_adapter
    foreign = []
    for key, shape in saved.items():
        stem, _, last = key.rpartition(".")
        # a module's weight (lora_A.<adapter>.weight), a ParameterDict entry (lora_embedding_A.<adapter>)
        candidates = (f"{stem}.{adapter_name}.{last}", f"{key}.{adapter_name}", key)
        if all(params.get(candidate) != shape for candidate in candidates):
            foreign.append(key)
    if foreign:
        raise ModelLoadError(
            f"adapter {adapter_dir}: {len(foreign)} saved weight(s) match no module of base model "
            f"'{base}' (first: {foreign[0]}); the adapter was trained on another base"
        )
    lora_names = set(LoraLayer.adapter_layer_names)
    expected = {key: tuple(t.shape) for key, t in
                get_peft_model_state_dict(peft_model, adapter_name=adapter_name, save_embedding_layers=False).items()
                if lora_names & set(key.split("."))}
    missing = sorted(key for key in expected if key not in saved)
    if missing:
        raise AdapterWeightsError(
            f"{weights}: {len(missing)} of the {len(expected)} LoRA tensors that adapter_config.json's "
            f"target_modules imply on this base are not saved (first: {missing[0]}); the adapter was "
            f"saved or copied incompletely: {_RESAVE}"
        )
