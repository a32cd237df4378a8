"""Tiny random causal LMs with LoRA adapters, built from configs (no hub), for gradient tests.

``build_tiny_lora(arch, dtype, seed)`` returns a PEFT model over a 2-layer Llama / Qwen2 /
Mistral with LoRA on all seven projection sites and *random* A and B (so neither factor's
gradient is trivially zero). Fixtures save one to disk with the chat tokenizer of
``tests/plugins/chat_tokenizer.py`` for the from-disk loading path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ALL_SITES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def build_tiny_base(arch: str = "llama", seed: int = 0, dtype=None, attn: str = "eager", **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    config = config_cls(**{**_SMALL, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def attach_tiny_lora(base, seed: int = 0, r: int = 4, target_modules=None):
    """Wrap ``base`` with a LoRA adapter whose A and B are both random (seeded)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 1)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=target_modules or ALL_SITES,
                        init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(base, config).eval()


def build_tiny_lora(arch: str = "llama", dtype=None, seed: int = 0, r: int = 4,
                    target_modules=None, **overrides):
    import torch

    # eager attention takes its softmax in float32 whatever the model dtype; float64 tests use
    # sdpa, whose CPU math path stays in the input dtype
    attn = "sdpa" if dtype == torch.float64 else "eager"
    base = build_tiny_base(arch, seed, None, attn=attn, **overrides)  # cast after the LoRA init
    model = attach_tiny_lora(base, seed, r, target_modules)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_tiny_lora(out: Path, arch: str = "llama", seed: int = 0, r: int = 4, tokenizer=None, **overrides):
    """Write ``out/base`` (model + tokenizer) and ``out/adapter``; returns (base_dir, adapter_dir).
    ``overrides`` change the base's config (e.g. ``hidden_size``)."""
    base_dir, adapter_dir = out / "base", out / "adapter"
    base = build_tiny_base(arch, seed, **overrides)
    base.save_pretrained(str(base_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(base_dir))
    attach_tiny_lora(base, seed, r).save_pretrained(str(adapter_dir))
    return base_dir, adapter_dir


@pytest.fixture(scope="session")
def tiny_lora_dirs(tmp_path_factory, chat_tokenizer):
    """A saved tiny Llama base (with the chat tokenizer) and its LoRA adapter."""
    return save_tiny_lora(tmp_path_factory.mktemp("tiny_lora"), tokenizer=chat_tokenizer)


@pytest.fixture
def tiny_lora_model():
    """A float64 tiny Llama with LoRA on all seven sites."""
    import torch

    return build_tiny_lora("llama", dtype=torch.float64)


def hello_query_for(tokenizer):
    """``query_for(view)``: the per-block gradient of one "say hello" -> "hello" row under the
    adapter ``view`` names (a checkpoint engine's query under each checkpoint)."""
    from gradian.data import dataset_from_rows, tokenize_examples
    from gradian.grads import capture_per_example_grads, collate

    rows = tokenize_examples(dataset_from_rows([{"prompt": "say hello", "completion": "hello"}]).examples,
                             tokenizer, 64)

    def query_for(view):
        view.model.set_adapter(view.adapter_name)
        grads = capture_per_example_grads(view, collate(rows, tokenizer.pad_token_id))
        return {k: v[0].detach().numpy() for k, v in grads.items()}

    return query_for
