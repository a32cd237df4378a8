"""Row shapes -> one normalized ``Example``.

Recognized shapes (checked in this order): ``messages`` (aliases ``conversations``,
``conversation``; turn keys ``role``/``content`` or ``from``/``value``), ``prompt``/``completion``,
``question``/``answer``, ``instruction`` (+ optional ``input``)/``output``, ``input``/``output``,
``text``. A ``system`` key becomes a leading system turn. Anything else is raw text (its string
values, joined). ``cluster`` or ``cluster_id`` declares the row's cluster.

Rows are checked as they are normalized, and a bad one is a ``DatasetError`` naming its place: a
row must be a JSON object (or a plain string), not empty; the fields of its shape must be strings
(or lists of turns where a conversation may stand); a turn needs a role and string content; a
field set to null beside its partner (``completion: null`` next to a ``prompt``) is refused rather
than silently read as raw text.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from gradian.errors import DatasetError

__all__ = ["Example", "row_to_example", "example_id", "normalize_text", "SHAPE_KEYS", "EXPECTED_SHAPES", "has_known_shape"]

#: the keys that make a row one of the recognized shapes (``has_known_shape`` says which sets do)
SHAPE_KEYS: tuple[str, ...] = ("messages", "conversations", "conversation", "prompt", "completion", "question",
                               "answer", "instruction", "input", "output", "text")
#: the shapes in words, for error messages
EXPECTED_SHAPES = ("messages (or conversations), prompt + completion, question + answer, "
                   "instruction + output, input + output, or text")
#: two-field shapes: (the prompt side, the answer side)
_PAIRS: tuple[tuple[str, str], ...] = (("prompt", "completion"), ("question", "answer"),
                                       ("instruction", "output"), ("input", "output"))


def has_known_shape(keys: Iterable[str]) -> bool:
    """True when the set of field names ``keys`` holds every field of at least one recognized shape."""
    keys = set(keys)
    return bool(keys & {"messages", "conversations", "conversation", "text"}) or any(
        a in keys and b in keys for a, b in _PAIRS)


def _json_type(value: object) -> str:
    """The JSON name of a Python value's type with its article ("a list", "an object")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"

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


def example_id(row: object, index: int) -> str:
    """``<12 hex of the sha256 of the row's canonical JSON>-<row index>``."""
    canonical = json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return f"{hashlib.sha256(canonical.encode('utf-8')).hexdigest()[:12]}-{index}"


_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")
_SPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Case-folded, punctuation removed, whitespace collapsed: for comparing prompts and answers."""
    return _SPACE.sub(" ", _PUNCT.sub(" ", text.casefold())).strip()


def _text(value: object) -> str:
    """Text of a value already checked by ``_check_text`` or ``_check_content``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: [{"type": "text", "text": "..."}]
        return "".join(p if isinstance(p, str) else p.get("text", "") for p in value)
    return str(value)


def _reject_lone_surrogates(value: object, where: str, key: str = "") -> None:
    """Every string of a row must be Unicode text: a lone UTF-16 surrogate (JSON's "\\ud800" escape
    without its pair) is not, and could not be written to any report, table or terminal."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            bad = value[err.start]
            name = f"'{key}'" if key else "the row"
            raise DatasetError(
                f"{where}: {name} holds a lone surrogate (\\u{ord(bad):04x} at character {err.start}), which is "
                "not a Unicode character; the text was cut inside a character pair or escaped wrongly: "
                "re-export the row, or remove the escape"
            ) from None
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _reject_lone_surrogates(k, where, key)
            _reject_lone_surrogates(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _reject_lone_surrogates(v, where, f"{key}[{i}]")


def _check_text(value: object, key: str, where: str, turns_allowed: bool = False) -> None:
    """A shape's field must be a string (or, for a prompt or answer side, a list of turns)."""
    if isinstance(value, str) or (turns_allowed and isinstance(value, list)):
        return
    also = " or a list of turns" if turns_allowed else ""
    if isinstance(value, (Mapping, list)):
        raise DatasetError(f"{where}: '{key}' is {_json_type(value)}; it must be a string{also}")
    raise DatasetError(
        f"{where}: '{key}' is {_json_type(value)} ({json.dumps(value)}); it must be a string{also}: "
        f"write it as \"{key}\": {json.dumps(str(value).lower() if isinstance(value, bool) else str(value))}"
    )


def _check_content(value: object, where: str, i: int, role: str) -> None:
    """A turn's content: a string, or a list of content parts that are strings or carry ``text``."""
    if isinstance(value, str):
        return
    if isinstance(value, list) and all(
        isinstance(p, str) or (isinstance(p, Mapping) and isinstance(p.get("text", ""), str)) for p in value
    ):
        return
    if value is None:
        raise DatasetError(f"{where}: turn {i} ({role}) has no content (missing or null); give every turn "
                           "a 'content' string, or drop the turn")
    raise DatasetError(f"{where}: turn {i} ({role}) has content that is {_json_type(value)}; it must be a "
                       "string (or a list of {\"type\": \"text\", \"text\": ...} parts)")


def _turns(value: object, where: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise DatasetError(f"{where}: expected a list of turns, got {_json_type(value)}")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping):
            raise DatasetError(f"{where}: turn {i} is {_json_type(turn)}, expected an object with role and content")
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
        _check_content(content, where, i, mapped)
        turns.append({"role": mapped, "content": _text(content)})
    return turns


def _chat(prompt: object, completion: object, where: str) -> list[dict[str, str]]:
    turns = _turns(prompt, where) if isinstance(prompt, list) else [{"role": "user", "content": _text(prompt)}]
    if isinstance(completion, list):
        turns += _turns(completion, where)
    else:
        turns.append({"role": "assistant", "content": _text(completion)})
    return turns


def row_to_example(row: object, index: int, where: str, line: int | None = None) -> Example:
    """Normalize one row. ``where`` names the row in errors (``train.jsonl:12``).

    Keys whose value is null are dropped first: columnar formats (Parquet, save_to_disk) fill
    every column of every row, so a question/answer row would otherwise also look like a
    prompt/completion row. Dropping them also keeps ids equal across file formats.
    """
    _reject_lone_surrogates(row, where)
    if isinstance(row, str):
        return Example(id=example_id(row, index), index=index, shape="raw", text=row, line=line)
    if not isinstance(row, Mapping):
        raise DatasetError(
            f"{where}: the row is {_json_type(row)}, not an object; each row must be an object "
            f"with one of these field sets: {EXPECTED_SHAPES}"
        )
    original = row
    row = {k: v for k, v in row.items() if v is not None}
    if not row:
        what = "empty ({})" if not original else "all nulls"
        raise DatasetError(f"{where}: the row is {what}; give it one of these field sets: {EXPECTED_SHAPES}")
    eid = example_id(row, index)
    cluster = row.get("cluster", row.get("cluster_id"))
    cluster = None if cluster is None else str(cluster)

    shape, messages = _shape_and_messages(row, where)
    if shape in ("text", "raw"):
        _reject_null_partner(original, row, where)
    if shape == "text":
        return Example(id=eid, index=index, shape="text", text=_text(row["text"]), cluster=cluster, line=line)
    if shape == "raw":
        values = [v for k, v in row.items() if k not in ("cluster", "cluster_id") and isinstance(v, str)]
        if not values:
            raise DatasetError(
                f"{where}: the row has none of the known fields (it has {', '.join(map(str, row))}) and no text; "
                f"give it one of these field sets: {EXPECTED_SHAPES}"
            )
        return Example(id=eid, index=index, shape="raw", text="\n".join(values), cluster=cluster, line=line)

    system = row.get("system")
    if system is not None:
        _check_text(system, "system", where)
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": _text(system)})
    if not any(t["role"] == "assistant" for t in messages):
        raise DatasetError(
            f"{where}: row has no assistant turn, so there is nothing to train on or to score; "
            "give it an assistant message (or a completion/answer/output field)"
        )
    return Example(id=eid, index=index, shape=shape, messages=messages, cluster=cluster, line=line)


def _reject_null_partner(original: Mapping[str, object], row: Mapping[str, object], where: str) -> None:
    """A pair's field present in the row while its partner is null: a broken row, not raw text.

    Columnar files hold nulls in the columns of other shapes, so a null is refused only when the
    other half of its own pair carries a value.
    """
    for a, b in _PAIRS:
        for present, null in ((a, b), (b, a)):
            if present in row and null in original and original[null] is None:
                raise DatasetError(
                    f"{where}: '{null}' is null beside '{present}'; give it a string, or drop the row"
                )


def _shape_and_messages(row: Mapping[str, object], where: str) -> tuple[str, list[dict[str, str]]]:
    for key in ("messages", "conversations", "conversation"):
        if key in row:
            if not isinstance(row[key], list):
                raise DatasetError(
                    f"{where}: '{key}' is {_json_type(row[key])}; it must be a list of turns "
                    "({\"role\": ..., \"content\": ...})"
                )
            return "messages", _turns(row[key], f"{where} ('{key}')")
    for a, b, shape in (("prompt", "completion", "prompt_completion"), ("question", "answer", "question_answer")):
        if a in row and b in row:
            _check_text(row[a], a, where, turns_allowed=True)
            _check_text(row[b], b, where, turns_allowed=True)
            return shape, _chat(row[a], row[b], where)
    if "instruction" in row and "output" in row:
        _check_text(row["instruction"], "instruction", where)
        _check_text(row["output"], "output", where, turns_allowed=True)
        if "input" in row:
            _check_text(row["input"], "input", where)
        extra = _text(row.get("input"))
        prompt = _text(row["instruction"]) + (f"\n\n{extra}" if extra.strip() else "")
        return "instruction_input_output", _chat(prompt, row["output"], where)
    if "input" in row and "output" in row:
        _check_text(row["input"], "input", where, turns_allowed=True)
        _check_text(row["output"], "output", where, turns_allowed=True)
        return "input_output", _chat(row["input"], row["output"], where)
    if "text" in row:
        _check_text(row["text"], "text", where)
        return "text", []
    return "raw", []
