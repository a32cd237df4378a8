"""The differences between transformers 4.56-4.57 and 5.x that Gradian meets, in one place.

Interface:

- ``warmup_arguments(ratio) -> dict``: the ``TrainingArguments`` keywords for a warmup that is
  ``ratio`` of the training steps.
- ``save_tokenizer(tokenizer, out_dir)``: ``tokenizer.save_pretrained(out_dir)``, written so that
  both majors load it back.
- ``portable_tokenizer_config(model_dir) -> bool``: rewrites a ``tokenizer_config.json`` that
  transformers 5 saved into the form both majors read; ``True`` when it changed the file.

Everything else Gradian calls has the same name and meaning in both: ``from_pretrained(dtype=)``
(4.56 renamed ``torch_dtype``), ``Trainer(processing_class=)``, ``eval_strategy``, ``use_cpu``,
``transformers.masking_utils`` and ``apply_chat_template(tokenize=False)`` returning a string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from gradian.atomic import write_text_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["warmup_arguments", "save_tokenizer", "portable_tokenizer_config"]

_TOKENIZER_CONFIG = "tokenizer_config.json"


def warmup_arguments(ratio: float) -> dict[str, object]:
    """``TrainingArguments`` keywords for a linear warmup over ``ratio`` of the steps.

    transformers 5 dropped ``warmup_ratio`` and reads a float below 1 in ``warmup_steps`` as a
    ratio; 4.x refuses a float there and keeps ``warmup_ratio``.
    """
    import dataclasses

    from transformers import TrainingArguments

    if any(f.name == "warmup_ratio" for f in dataclasses.fields(TrainingArguments)):
        return {"warmup_ratio": float(ratio)}
    return {"warmup_steps": float(ratio)}


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> None:
    """``tokenizer.save_pretrained(out_dir)`` that transformers 4.56+ and 5.x both load back."""
    tokenizer.save_pretrained(str(out_dir))
    portable_tokenizer_config(out_dir)


def portable_tokenizer_config(model_dir: str | Path) -> bool:
    """Rewrite ``<model_dir>/tokenizer_config.json`` as transformers 5 saved it into the form
    4.x reads too; ``True`` when the file changed, ``False`` when it was portable already (or absent).

    transformers 5 names a plain fast tokenizer ``TokenizersBackend``, a class 4.x does not have,
    and lists the extra special tokens under ``extra_special_tokens``, a key 4.x reads as a
    mapping of named tokens. Both majors load ``PreTrainedTokenizerFast`` with the list under
    ``additional_special_tokens`` to the same vocabulary, special tokens and ids.
    """
    path = Path(model_dir) / _TOKENIZER_CONFIG
    if not path.is_file():
        return False
    data = json.loads(path.read_text(encoding="utf-8"))
    changed = False
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        changed = True
    extra = data.get("extra_special_tokens")
    if isinstance(extra, list):
        listed = list(data.get("additional_special_tokens") or [])
        data["additional_special_tokens"] = listed + [t for t in extra if t not in listed]
        del data["extra_special_tokens"]
        changed = True
    if changed:
        write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return changed
