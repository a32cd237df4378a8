"""Atomic file writes: write beside the target, fsync, then rename over it.

A reader never sees a half-written report, manifest, index chunk or run record; an interrupted
write leaves the previous file (or none) in place.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

__all__ = ["atomic_open", "write_text_atomic", "write_bytes_atomic"]


@contextmanager
def atomic_open(path: Path) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces ``path`` only when the block exits cleanly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_open(path) as handle:
        handle.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))
