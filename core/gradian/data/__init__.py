"""The data layer: loading every row shape, example ids, tokenization and loss masks.

Public interface: ``load_dataset``, ``dataset_from_rows``, ``Dataset``, ``Example``,
``tokenize_examples``, ``TokenizedExample``, ``render_prompt``, ``render_example``,
``has_chat_template``, ``normalize_text``, ``example_id``, ``IGNORE_INDEX``.
"""

from gradian.data.loading import Dataset, dataset_from_rows, load_dataset
from gradian.data.rows import Example, example_id, normalize_text, row_to_example
from gradian.data.tokenize import (
    IGNORE_INDEX,
    TokenizedExample,
    has_chat_template,
    render_example,
    render_prompt,
    tokenize_examples,
)

__all__ = [
    "IGNORE_INDEX",
    "Dataset",
    "Example",
    "TokenizedExample",
    "dataset_from_rows",
    "example_id",
    "has_chat_template",
    "load_dataset",
    "normalize_text",
    "render_example",
    "render_prompt",
    "row_to_example",
    "tokenize_examples",
]
