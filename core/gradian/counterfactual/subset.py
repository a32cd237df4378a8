"""Write the rows a counterfactual keeps, as a .jsonl the trainer reads like the original.

Interface: ``write_kept_rows(dataset, keep_indices, path) -> Path``. Rows of a .jsonl source are
copied byte for byte (so every kept row keeps its content hash); rows of other sources are
written from their raw records (.json, .parquet) or, for a ``save_to_disk`` folder, from the
normalized chat turns plus the declared cluster. Kept rows stay in their original order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from gradian.atomic import write_text_atomic
from gradian.errors import DatasetError

if TYPE_CHECKING:
    from gradian.data import Dataset, Example

__all__ = ["write_kept_rows"]


def _raw_rows(dataset: Dataset) -> list[str] | None:
    """One JSON line per row of the source file, or None when only normalized rows exist."""
    path = Path(dataset.path)
    if not path.is_file():
        return None
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        out = []
        for e in dataset.examples:
            if e.line is None:
                return None
            out.append(lines[e.line - 1])
        return out
    if suffix == ".json":
        obj = json.loads(path.read_text(encoding="utf-8"))
        rows = obj if isinstance(obj, list) else next((v for v in obj.values() if isinstance(v, list)), None)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        return None
    if rows is None or len(rows) != len(dataset):
        return None
    return [json.dumps(r, ensure_ascii=False, default=str) for r in rows]


def _normalized_row(example: Example) -> str:
    row: dict[str, list[dict[str, str]] | str] = {"messages": example.messages} if example.messages else {"text": example.text or ""}
    if example.cluster not in (None, ""):
        row["cluster"] = example.cluster
    return json.dumps(row, ensure_ascii=False)


def write_kept_rows(dataset: Dataset, keep_indices: Sequence[int], path: str | Path) -> Path:
    """Write rows ``keep_indices`` of ``dataset`` (a ``gradian.data.Dataset``) to ``path`` (.jsonl)."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise DatasetError(f"{path}: the kept rows are written as JSON lines; give the file a .jsonl name")
    bad = [i for i in keep_indices if not 0 <= i < len(dataset)]
    if bad:
        raise DatasetError(f"row index {bad[0]} is outside {dataset.path} ({len(dataset)} rows)")
    raw = _raw_rows(dataset)
    lines = [raw[i] if raw is not None else _normalized_row(dataset.examples[i]) for i in keep_indices]
    write_text_atomic(path, "".join(line + "\n" for line in lines))
    return path
