"""Row shapes -> one normalized ``Example``.

Recognized shapes (checked in this order): ``messages`` (aliases ``conversations``,
``conversation``; turn keys ``role``/``content`` or ``from``/``value``), ``prompt``/``completion``,
``question``/``answer``, ``instruction`` (+ optional ``input``)/``output``, ``input``/``output``,
``text``. A ``system`` key becomes a leading system turn. Anything else is raw text. ``cluster``
or ``cluster_id`` declares the row's cluster.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from typing import Any, Mapping

from gradian.errors import DatasetError

__all__ = ["Example", "row_to_example", "example_id", "normalize_text"]

_ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}


@dataclass
class Example:
    """One training or eval row, normalized.

    ``messages`` holds chat turns (``{"role", "content"}``) for every shape but text; text rows
    (``shape`` ``text`` or ``raw``) keep their string in ``text`` and have no messages.
    """

    id: str
    index: int
    shape: str
    messages: list[dict[str, str]] = field(default_factory=list)
    text: str | None = None
    cluster: str | None = None
    #: 1-based line in a .jsonl file, when the row came from one
    line: int | None = None

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    @property
    def completion(self) -> str:
        """The final assistant turn (the text of a text row)."""
        if not self.messages:
            return self.text or ""
        for turn in reversed(self.messages):
            if turn["role"] == "assistant":
                return turn["content"]
        return ""

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """Every turn before the final assistant turn."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == "assistant":
                return self.messages[:i]
        return list(self.messages)

    @property
    def prompt_text(self) -> str:
        """The user-visible prompt: non-system turns before the final answer, newline-joined."""
        return "\n".join(t["content"] for t in self.prompt_messages if t["role"] != "system")

    @property
    def full_text(self) -> str:
        if not self.messages:
            return self.text or ""
        return "\n".join(t["content"] for t in self.messages)


def example_id(row: Any, index: int) -> str:
    """``<12 hex of the sha256 of the row's canonical JSON>-<row index>``."""
    canonical = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return f"{hashlib.sha256(canonical.encode('utf-8')).hexdigest()[:12]}-{index}"


_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")
_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Case-folded, punctuation removed, whitespace collapsed: for comparing prompts and answers."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.casefold())).strip()


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: [{"type": "text", "text": "..."}]
        parts = [p.get("text", "") if isinstance(p, Mapping) else str(p) for p in value]
        return "".join(parts)
    return str(value)


def _turns(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise DatasetError(f"{where}: expected a list of turns, got {type(value).__name__}")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            raise DatasetError(f"{where}: turn {i} is {type(turn).__name__}, expected an object with role and content")
        role = turn.get("role", turn.get("from"))
        if role is None:
            raise DatasetError(f"{where}: turn {i} has no 'role' (or 'from') key")
        mapped = _ROLE_ALIASES.get(str(role).lower())
        if mapped is None:
            raise DatasetError(
                f"{where}: turn {i} has unknown role {role!r}; use system, user or assistant "
                "(ShareGPT's human/gpt also work)"
            )
        content = turn.get("content", turn.get("value"))
        turns.append({"role": mapped, "content": _text(content)})
    return turns


def _chat(prompt: Any, completion: Any, where: str) -> list[dict[str, str]]:
    turns = _turns(prompt, where) if isinstance(prompt, list) else [{"role": "user", "content": _text(prompt)}]
    if isinstance(completion, list):
        turns += _turns(completion, where)
    else:
        turns.append({"role": "assistant", "content": _text(completion)})
    return turns


def row_to_example(row: Any, index: int, where: str, line: int | None = None) -> Example:
    """Normalize one row. ``where`` names the row in errors (``train.jsonl:12``).

    Keys whose value is null are dropped first: columnar formats (Parquet, save_to_disk) fill
    every column of every row, so a question/answer row would otherwise also look like a
    prompt/completion row. Dropping them also keeps ids equal across file formats.
    """
    if isinstance(row, Mapping):
        row = {k: v for k, v in row.items() if v is not None}
    eid = example_id(row, index)
    if isinstance(row, str):
        return Example(id=eid, index=index, shape="raw", text=row, line=line)
    if not isinstance(row, Mapping):
        return Example(id=eid, index=index, shape="raw", text=json.dumps(row, ensure_ascii=False), line=line)
    cluster = row.get("cluster", row.get("cluster_id"))
    cluster = None if cluster is None else str(cluster)

    shape, messages = _shape_and_messages(row, where)
    if shape == "text":
        return Example(id=eid, index=index, shape="text", text=_text(row["text"]), cluster=cluster, line=line)
    if shape == "raw":
        values = [_text(v) for k, v in row.items() if k not in ("cluster", "cluster_id") and isinstance(v, str)]
        return Example(id=eid, index=index, shape="raw", text="\n".join(values), cluster=cluster, line=line)

    system = row.get("system")
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": _text(system)})
    if not any(t["role"] == "assistant" for t in messages):
        raise DatasetError(
            f"{where}: row has no assistant turn, so there is nothing to train on or to score; "
            "give it an assistant message (or a completion/answer/output field)"
        )
    return Example(id=eid, index=index, shape=shape, messages=messages, cluster=cluster, line=line)


def _shape_and_messages(row: Mapping[str, Any], where: str) -> tuple[str, list[dict[str, str]]]:
    for key in ("messages", "conversations", "conversation"):
        if key in row:
            return "messages", _turns(row[key], f"{where} ('{key}')")
    if "prompt" in row and "completion" in row:
        return "prompt_completion", _chat(row["prompt"], row["completion"], where)
    if "question" in row and "answer" in row:
        return "question_answer", _chat(row["question"], row["answer"], where)
    if "instruction" in row and "output" in row:
        extra = _text(row.get("input"))
        prompt = _text(row["instruction"]) + (f"\n\n{extra}" if extra.strip() else "")
        return "instruction_input_output", _chat(prompt, row["output"], where)
    if "input" in row and "output" in row:
        return "input_output", _chat(row["input"], row["output"], where)
    if "text" in row:
        return "text", []
    return "raw", []
