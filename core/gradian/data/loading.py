"""Load a dataset file: ``.jsonl``, ``.json``, ``.parquet`` or a ``save_to_disk`` directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gradian.data.rows import Example, row_to_example
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
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}. Pass a .jsonl, .json, .parquet file or a save_to_disk directory.")
    if path.is_dir():
        rows, digest = _read_saved_dataset(path)
        examples = [row_to_example(r, i, f"{path} row {i}") for i, r in enumerate(rows)]
    else:
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            examples = _read_jsonl(path, data)
        elif suffix == ".json":
            rows = _read_json(path, data)
            examples = [row_to_example(r, i, f"{path} row {i}") for i, r in enumerate(rows)]
        elif suffix == ".parquet":
            rows = _read_parquet(path)
            examples = [row_to_example(r, i, f"{path} row {i}") for i, r in enumerate(rows)]
        else:
            raise DatasetError(
                f"{path}: unsupported file type '{suffix or '(none)'}'; use .jsonl, .json, .parquet "
                "or a directory written by datasets' save_to_disk"
            )
    if not examples and not allow_empty:
        raise DatasetError(f"{path}: the dataset is empty (no rows); nothing to audit or attribute")
    return Dataset(path=str(path), sha256=digest, examples=examples)


def dataset_from_rows(rows: list[Any], name: str = "<memory>") -> Dataset:
    """Build a Dataset from in-memory rows (hashing their canonical JSON)."""
    canonical = json.dumps(rows, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    examples = [row_to_example(r, i, f"{name} row {i}") for i, r in enumerate(rows)]
    return Dataset(path=name, sha256=hashlib.sha256(canonical).hexdigest(), examples=examples)


def _read_jsonl(path: Path, data: bytes) -> list[Example]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    examples: list[Example] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(
                f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                "each line of a .jsonl file must be one complete JSON object"
            ) from None
        examples.append(row_to_example(row, len(examples), f"{path}:{lineno}", line=lineno))
    return examples


def _read_json(path: Path, data: bytes) -> list[Any]:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f":{err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise DatasetError(f"{path}{where}: not valid JSON ({err}); a .json dataset holds a list of rows") from None
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


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        raise DatasetError(f"{path}: cannot read as Parquet ({err})") from None


def _read_saved_dataset(path: Path) -> tuple[list[Any], str]:
    if not any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DatasetError(
            f"{path}: a directory dataset must be written by datasets' save_to_disk "
            "(no dataset_info.json, state.json or dataset_dict.json found)"
        )
    from datasets import DatasetDict, load_from_disk

    loaded = load_from_disk(str(path))
    if isinstance(loaded, DatasetDict):
        if "train" not in loaded:
            raise DatasetError(f"{path}: a DatasetDict without a 'train' split (has {', '.join(loaded)}); pass the split's directory")
        loaded = loaded["train"]
    digest = hashlib.sha256()
    for arrow in sorted(path.rglob("*.arrow")):
        digest.update(arrow.name.encode())
        digest.update(arrow.read_bytes())
    return loaded.to_list(), digest.hexdigest()
