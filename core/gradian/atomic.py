"""Atomic file writes: write beside the target, fsync, then rename over it.

A reader never sees a half-written report, manifest, index chunk or run record; an interrupted
write leaves the previous file (or none) in place. ``write_files_atomic`` does the same for a set
of files that belong together (a report's json, md, html, plots and tables): every file is
written beside its target first and only then are all renamed into place, so a write that fails
part way (a full disk) leaves none of them.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping

__all__ = ["atomic_open", "write_text_atomic", "write_bytes_atomic", "write_files_atomic"]


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


def write_files_atomic(folder: Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write ``files`` (``{path relative to folder: bytes}``) into ``folder``, all of them or none.

    Each file is written and fsynced beside its target under a ``.tmp`` name; once every one is
    on disk they are renamed into place. If any write fails, every ``.tmp`` of this call is
    removed and the error raised, leaving the folder as it was. Returns the paths written.
    """
    folder = Path(folder)
    staged: list[tuple[str, Path]] = []
    try:
        for name, data in files.items():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            staged.append((tmp, target))
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        for tmp, target in staged:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    return [target for _, target in staged]
