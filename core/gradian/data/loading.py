"""Load a dataset file: ``.jsonl``, ``.json``, ``.parquet`` or a ``save_to_disk`` directory.

Everything is checked at the door, before any model is loaded: the path must be a regular file or
a ``save_to_disk`` directory (a FIFO or a device is refused without being opened, so nothing
blocks); JSON Lines are split on ``\\n`` only, so U+2028, U+2029 and U+0085 inside strings are
data; a file whose columns (or rows' keys) match no row shape is refused naming what it found.
"""

from __future__ import annotations

import hashlib
import json
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from gradian.data.rows import EXPECTED_SHAPES, Example, has_known_shape, row_to_example
from gradian.errors import DatasetError

__all__ = ["Dataset", "load_dataset", "dataset_from_rows"]


@dataclass
class Dataset:
    """Normalized examples plus where they came from and a content hash of the source."""

    path: str
    sha256: str
    examples: list[Example] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.examples]

    def by_id(self) -> dict[str, Example]:
        return {e.id: e for e in self.examples}


def load_dataset(path: str | Path, *, allow_empty: bool = False) -> Dataset:
    """Read and normalize every row. Errors name the file and line and say how to fix it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DatasetError(f"dataset not found: {path}. Pass a .jsonl, .json, .parquet file or a save_to_disk directory.") from None
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror}); check the path and its permissions") from None
    if stat.S_ISDIR(mode):
        rows, digest = _read_saved_dataset(path)
        examples = [row_to_example(r, i, f"{path} row {i}") for i, r in enumerate(rows)]
    elif not stat.S_ISREG(mode):
        raise DatasetError(
            f"{path} is {_file_kind(mode)}, not a regular file; write the data to a .jsonl, .json or .parquet "
            "file first and pass that"
        )
    else:
        suffix = path.suffix.lower()
        if suffix not in (".jsonl", ".json", ".parquet"):
            raise DatasetError(
                f"{path}: unsupported file type '{suffix or '(none)'}'; use .jsonl, .json, .parquet "
                "or a directory written by datasets' save_to_disk"
            )
        try:
            data = path.read_bytes()
        except OSError as err:
            raise DatasetError(f"{path}: cannot be read ({err.strerror}); check the file's permissions") from None
        digest = hashlib.sha256(data).hexdigest()
        if suffix == ".jsonl":
            examples = _read_jsonl(path, data)
        elif suffix == ".json":
            rows = _read_json(path, data)
            examples = [row_to_example(r, i, f"{path} row {i}") for i, r in enumerate(rows)]
        else:
            rows = _read_parquet(path)
            examples = [row_to_example(r, i, f"{path} row {i}") for i, r in enumerate(rows)]
        if examples and all(e.shape == "raw" for e in examples):
            raise DatasetError(_no_known_shape(path, data, suffix))
    if not examples and not allow_empty:
        raise DatasetError(f"{path}: the dataset is empty (no rows); nothing to audit or attribute")
    return Dataset(path=str(path), sha256=digest, examples=examples)


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _no_known_shape(path: Path, data: bytes, suffix: str) -> str:
    """Why every row fell back to raw text: the keys the rows have against those expected."""
    if suffix == ".jsonl":
        lines = [line for line in data.decode("utf-8-sig").split("\n") if line.strip()]
        rows = [json.loads(line) for line in lines[:50]]
    else:
        rows = _read_json(path, data)[:50]
    keys = list(dict.fromkeys(str(k) for row in rows if isinstance(row, dict) for k in row))
    found = f"keys found: {', '.join(keys[:12])}" if keys else "the rows are plain strings"
    return (f"{path}: no row has a known shape ({found}); expected {EXPECTED_SHAPES}. "
            "Rename the fields, or put plain text under a 'text' key")


def dataset_from_rows(rows: Sequence[object], name: str = "<memory>") -> Dataset:
    """Build a Dataset from in-memory rows (hashing their canonical JSON)."""
    canonical = json.dumps(rows, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    examples = [row_to_example(r, i, f"{name} row {i}") for i, r in enumerate(rows)]
    return Dataset(path=name, sha256=hashlib.sha256(canonical).hexdigest(), examples=examples)


def _read_jsonl(path: Path, data: bytes) -> list[Example]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    examples: list[Example] = []
    # JSON Lines ends records at \\n alone; str.splitlines would also split at U+2028, U+2029,
    # U+0085 and other characters that are legal, unescaped, inside a JSON string
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(
                f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                "each line of a .jsonl file must be one complete JSON object"
            ) from None
        except RecursionError:
            raise DatasetError(
                f"{path}:{lineno}: the row is nested too deeply to read; a row is one object of text "
                "fields (messages, prompt/completion, ...), not a deep structure"
            ) from None
        examples.append(row_to_example(row, len(examples), f"{path}:{lineno}", line=lineno))
    return examples


def _read_json(path: Path, data: bytes) -> list[object]:
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f":{err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise DatasetError(f"{path}{where}: not valid JSON ({err}); a .json dataset holds a list of rows") from None
    except RecursionError:
        raise DatasetError(
            f"{path}: nested too deeply to read; a .json dataset holds a list of row objects"
        ) from None
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        lists = [k for k, v in obj.items() if isinstance(v, list)]
        for key in ("data", "train", "rows", "examples"):
            if key in lists:
                return obj[key]
        if len(lists) == 1:
            return obj[lists[0]]
    raise DatasetError(
        f"{path}: expected a JSON list of rows (or an object with one list of rows), got {type(obj).__name__}"
    )


def _check_columns(path: Path, columns: list[str], what: str) -> None:
    """A columnar file whose columns can make no row shape is refused before its rows are read."""
    if not has_known_shape(columns):
        found = ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "") if columns else "none"
        raise DatasetError(
            f"{path}: the {what} has none of the expected columns (found: {found}); expected {EXPECTED_SHAPES}. "
            "Rename the columns to one of these sets"
        )


def _read_parquet(path: Path) -> list[object]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        raise DatasetError(f"{path}: cannot read as Parquet ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    _check_columns(path, table.column_names, "Parquet file")
    return table.to_pylist()


def _read_saved_dataset(path: Path) -> tuple[list[object], str]:
    if not any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DatasetError(
            f"{path}: a directory dataset must be written by datasets' save_to_disk "
            "(no dataset_info.json, state.json or dataset_dict.json found)"
        )
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(str(path))
        if isinstance(loaded, DatasetDict):
            if "train" not in loaded:
                raise DatasetError(f"{path}: a DatasetDict without a 'train' split (has {', '.join(loaded)}); pass the split's directory")
            loaded = loaded["train"]
        _check_columns(path, list(loaded.column_names), "saved dataset")
        rows = loaded.to_list()
        digest = hashlib.sha256()
        for arrow in sorted(path.rglob("*.arrow")):
            digest.update(arrow.name.encode())
            digest.update(arrow.read_bytes())
    except DatasetError:
        raise
    except Exception as err:  # datasets and pyarrow raise many unrelated types for a damaged folder
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DatasetError(
            f"{path}: a damaged save_to_disk dataset ({type(err).__name__}: {reason[:200]}); write it again "
            "with save_to_disk, or export it to .jsonl"
        ) from None
    return rows, digest.hexdigest()
