"""What a plan is computed from: the base model's shape, the adapter's, and the batches' shapes.

Interface: ``read_model_shape(source)`` reads a ``config.json`` (a file, a model directory, a
preset name from ``presets/``, or a dict) into a ``ModelShape`` without loading any weight;
``adapter_shape(...)`` gives the LoRA rank and the targeted linears, from an adapter directory's
``adapter_config.json`` or from explicit ``r`` / ``target_modules``; ``lora_linears`` lists every
targeted linear of every layer with its input and output widths, under the same matching rule PEFT
uses and the ``grads.module_filter`` the capture applies.

Only Llama-style decoders are modelled layer by layer (llama, mistral, qwen2, qwen3 and their
kin: RMSNorm, rotary attention with grouped keys and values, a gated SiLU MLP); other model types
are read the same way and flagged as approximate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from gradian.errors import ConfigError

if TYPE_CHECKING:
    from gradian.data import TokenizedExample

__all__ = [
    "ModelShape",
    "AdapterShape",
    "LoraLinear",
    "BatchShape",
    "DatasetShape",
    "read_model_shape",
    "adapter_shape",
    "lora_linears",
    "preset_names",
    "DTYPE_BYTES",
    "LLAMA_STYLE",
]

PRESET_DIR = Path(__file__).parent / "presets"

#: bytes per value of the dtypes a model or a store may use
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

#: model types whose decoder layer the activation formulas describe exactly
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")

#: the projections of a Llama-style layer: (module path inside the layer, input, output)
PROJECTION_SITES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only config.json that memory depends on."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    #: the dtype the weights were saved in (``torch_dtype`` / ``dtype`` of config.json)
    saved_dtype: str = "float32"
    name: str = ""

    @property
    def llama_style(self) -> bool:
        return self.model_type in LLAMA_STYLE

    def site_widths(self, site: str) -> tuple[int, int]:
        """``(in, out)`` of one projection."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[site.rsplit(".", 1)[-1]]

    @property
    def n_parameters(self) -> int:
        """Parameters of the base model: embeddings, layers (projections, norms, q/k/v biases of
        qwen2, q/k norms of qwen3), final norm and an untied output head."""
        h = self.hidden_size
        per_layer = sum(i * o for i, o in (self.site_widths(s) for s in PROJECTION_SITES)) + 2 * h
        if self.model_type == "qwen2":
            per_layer += self.num_heads * self.head_dim + 2 * self.num_kv_heads * self.head_dim
        if self.model_type == "qwen3":
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def read_model_shape(source: str | Path | Mapping[str, Any]) -> ModelShape:
    """A ``ModelShape`` from a config.json path, a model directory, a preset name or a dict."""
    name = ""
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        if not path.exists() and (PRESET_DIR / f"{source}.json").is_file():
            path = PRESET_DIR / f"{source}.json"
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"no model config at {source}: pass a config.json, a model directory holding one, or a preset "
                f"({', '.join(preset_names())})"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON ({err})") from None
        name = path.stem if path.parent == PRESET_DIR else str(source)
    data = data.get("text_config", data) if "hidden_size" not in data else data
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
               if not isinstance(data.get(k), int)]
    if missing:
        raise ConfigError(f"model config {source} lacks {', '.join(missing)}: not a decoder-only transformer config")
    heads = data["num_attention_heads"]
    return ModelShape(
        model_type=str(data.get("model_type", "unknown")),
        hidden_size=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
        intermediate_size=data["intermediate_size"],
        vocab_size=data["vocab_size"],
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        saved_dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
        name=name,
    )


@dataclass(frozen=True)
class AdapterShape:
    """LoRA settings that decide the gradient's width: rank and targeted modules."""

    r: int
    #: a list of module names (PEFT matches them as name suffixes) or one regex (full match)
    target_modules: tuple[str, ...] | str
    layers_to_transform: tuple[int, ...] | None = None
    #: dtype of the adapter weights once loaded (PEFT keeps adapters float32 on half-precision bases)
    dtype: str = "float32"


@dataclass(frozen=True)
class LoraLinear:
    """One LoRA-adapted projection: its full module name, layer, site and ``(in, out)``."""

    name: str
    layer: int
    site: str
    in_features: int
    out_features: int
    r: int

    @property
    def dim(self) -> int:
        """Values of its per-example gradient: ``r x in`` (A) plus ``out x r`` (B)."""
        return self.r * (self.in_features + self.out_features)


def adapter_shape(adapter_dir: str | Path | None = None, r: int | None = None,
                  target_modules: Sequence[str] | str | None = None) -> AdapterShape:
    """From ``adapter_config.json`` in ``adapter_dir``, with ``r`` / ``target_modules`` overriding."""
    data: dict[str, Any] = {}
    if adapter_dir is not None:
        path = Path(adapter_dir) / "adapter_config.json"
        if not path.is_file():
            raise ConfigError(f"{adapter_dir} has no adapter_config.json; pass a PEFT adapter directory or --r and --target-modules")
        data = json.loads(path.read_text(encoding="utf-8"))
    rank = r if r is not None else data.get("r")
    targets = target_modules if target_modules is not None else data.get("target_modules")
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"LoRA rank r must be a positive integer, got {rank!r}; pass --r or an adapter directory")
    if targets is None:
        raise ConfigError("no LoRA target modules: pass --target-modules (e.g. q_proj,v_proj or all-linear) or an adapter directory")
    if isinstance(targets, str) and "," in targets:
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    layers = data.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    return AdapterShape(r=rank, target_modules=targets if isinstance(targets, str) else tuple(targets),
                        layers_to_transform=tuple(layers) if layers else None)


def _targeted(name: str, targets: tuple[str, ...] | str) -> bool:
    """PEFT's rule: a string is a regex matched in full; a list matches exact names or suffixes."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return True
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_linears(shape: ModelShape, adapter: AdapterShape, module_filter: str | None = None) -> list[LoraLinear]:
    """Every LoRA linear the capture will differentiate, in model order (``model.layers.N.<site>``)."""
    try:
        pattern = re.compile(module_filter) if module_filter else None
    except re.error as err:
        raise ConfigError(f"grads.module_filter '{module_filter}' is not a valid regex ({err})") from None
    out = []
    for layer in range(shape.num_layers):
        if adapter.layers_to_transform is not None and layer not in adapter.layers_to_transform:
            continue
        for site in PROJECTION_SITES:
            name = f"model.layers.{layer}.{site}"
            if not _targeted(name, adapter.target_modules):
                continue
            if pattern is not None and not pattern.search(name):
                continue
            i, o = shape.site_widths(site)
            out.append(LoraLinear(name, layer, site.rsplit(".", 1)[-1], i, o, adapter.r))
    return out


@dataclass(frozen=True)
class BatchShape:
    """One gradient batch as the capture sees it: rows, padded width, supervised positions."""

    rows: int
    width: int
    supervised: int

    @property
    def tokens(self) -> int:
        return self.rows * self.width


@dataclass
class DatasetShape:
    """Token lengths of the dataset after the project's own tokenization and truncation."""

    lengths: list[int]
    supervised: list[int]
    source: str = ""
    truncated: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.lengths)

    def batches(self, batch_size: int) -> list[BatchShape]:
        """The batches ``iter_example_gradients`` forms, in dataset order."""
        out = []
        for start in range(0, self.n, batch_size):
            lengths = self.lengths[start : start + batch_size]
            out.append(BatchShape(len(lengths), max(lengths),
                                  sum(self.supervised[start : start + batch_size])))
        return out

    @classmethod
    def from_tokenized(cls, tokenized: Sequence[TokenizedExample], source: str = "") -> "DatasetShape":
        """From ``TokenizedExample`` rows (``gradian.data.tokenize_examples``, already truncated)."""
        return cls([len(t.input_ids) for t in tokenized], [t.n_supervised for t in tokenized], source,
                   truncated=sum(1 for t in tokenized if t.truncated))

    @classmethod
    def uniform(cls, n: int, tokens: int, supervised_share: float = 0.5) -> "DatasetShape":
        """``n`` examples of ``tokens`` tokens each (when no dataset is at hand)."""
        return cls([tokens] * n, [max(1, int(tokens * supervised_share))] * n, source=f"{n} x {tokens} tokens (assumed)")
