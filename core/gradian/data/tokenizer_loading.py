"""Load a tokenizer by model id or path: the tokenizer only, never the weights."""

from __future__ import annotations

from typing import Any

from gradian.errors import ModelLoadError

__all__ = ["load_tokenizer"]


def load_tokenizer(name: str, trust_remote_code: bool = False, flag: str = "--base-model") -> Any:
    """``AutoTokenizer.from_pretrained(name)``; a failure names the flag it came from."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, HF hub errors...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(
            f"{flag} {name}: cannot load its tokenizer ({first}); pass a local model directory or a "
            "hub id available offline"
        ) from None
