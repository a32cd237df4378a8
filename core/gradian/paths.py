"""Output and cache folders checked at the door: a command refuses a folder it could not write
before it loads a model, not after hours of compute.

``ensure_writable_dir(path, name)`` creates nothing. It accepts an existing folder that takes a
file, or a path not there yet whose nearest existing parent is a folder that takes a new entry,
and otherwise raises, naming ``name`` (the flag or config key): ``ConfigError`` (exit code 2) when a
file stands where the folder should be, ``GradianEnvironmentError`` (exit code 3) when the folder
cannot be written (permissions, a read-only filesystem).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from gradian.errors import ConfigError, GradianEnvironmentError

__all__ = ["ensure_writable_dir"]


def ensure_writable_dir(path: str | Path, name: str) -> Path:
    """``path`` if a command can write files into it (creating it if missing); else an error.

    ``name`` says where the path came from (``--out``, ``cache_dir``) and is named in the message.
    """
    path = Path(path)
    _refuse_broken_links(path, name)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{name} {path} is an existing file, not a folder; pass a folder path "
                              "(a new one is created)")
        _probe(path, name, path)
        return path
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{name} {path}: {parent} is a file, so no folder can be made under it; "
                          "pass another path")
    _probe(parent, name, path)
    return path


def _refuse_broken_links(path: Path, name: str) -> None:
    """A symbolic link on the way that loops or points nowhere: no folder can be made through it."""
    for part in (path, *path.parents):
        if not part.is_symlink():
            continue
        try:
            os.stat(part)
        except OSError as err:
            why = "is a loop of symbolic links" if err.errno == errno.ELOOP else \
                f"is a symbolic link to {os.readlink(part)}, which does not exist"
            raise ConfigError(f"{name} {path}: {part} {why}; pass another path or repair the link") from None


def _probe(folder: Path, name: str, path: Path) -> None:
    """Write and remove one empty file: the only test that also catches read-only filesystems and ACLs."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".gradian-write-test-", dir=folder)
    except OSError as err:
        reason = "a read-only filesystem" if err.errno == errno.EROFS else (err.strerror or str(err)).lower()
        raise GradianEnvironmentError(
            f"{name} {path} cannot be written ({folder}: {reason}); pass a folder you can write to"
        ) from None
    os.close(fd)
    os.unlink(tmp)
