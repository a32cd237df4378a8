"""One error hierarchy for every stage.

Each error also inherits the builtin it refines, so callers that catch ``ValueError`` or
``FileNotFoundError`` keep working. Messages name the value, the place (file:line, flag or config
key) and the fix. The CLI turns any ``GradianError`` into one line on stderr and its
``exit_code``: 2 for bad input (the default), 3 for a ``GradianEnvironmentError`` (a missing
package, an unwritable folder, a tracking server that does not answer), which the same command can
get past once the environment is fixed.
"""

from __future__ import annotations

import errno

__all__ = [
    "GradianError",
    "ConfigError",
    "DatasetError",
    "RunRecordError",
    "ModelLoadError",
    "IndexMismatchError",
    "IndexCorruptError",
    "AdapterWeightsError",
    "GradianEnvironmentError",
    "MissingDependencyError",
    "DiskFullError",
    "environment_error",
]


class GradianError(Exception):
    """Base class of every error this project raises on purpose."""

    exit_code = 2


class ConfigError(GradianError, ValueError):
    """A config file, key or value is wrong."""


class DatasetError(GradianError, ValueError):
    """A dataset file is missing, malformed or empty."""


class RunRecordError(GradianError, ValueError):
    """A run directory or run source cannot be read as a training run."""


class ModelLoadError(GradianError, ValueError):
    """A base model, tokenizer or adapter cannot be loaded."""


class IndexMismatchError(GradianError, ValueError):
    """A stored gradient index was built from different inputs than the ones given."""


class IndexCorruptError(IndexMismatchError):
    """A stored gradient index file is missing, truncated or does not match its recorded checksum."""


class AdapterWeightsError(ModelLoadError):
    """An adapter's saved weights are missing, incomplete, mis-shaped or not finite."""


class GradianEnvironmentError(GradianError):
    """The input is fine but the environment is not: a package, a folder, a server or the disk.

    Not an ``OSError`` subclass itself (that would clash with ``ImportError``'s layout in
    ``MissingDependencyError``); subclasses add the builtin that fits.
    """

    exit_code = 3


class MissingDependencyError(GradianEnvironmentError, ImportError):
    """An optional dependency needed for the requested feature is not installed."""


class DiskFullError(GradianEnvironmentError, OSError):
    """The disk has too little free space for what a command writes (checked before, or met while
    writing); the message says what was kept and how to get past it."""


#: errno -> (is the input at fault, what it means to a user)
_PATH_ERRNOS = {
    errno.EACCES: (False, "permission denied"),
    errno.EPERM: (False, "operation not permitted"),
    errno.EROFS: (False, "a read-only filesystem"),
    errno.EIO: (False, "an input/output error (a failing disk or a dropped network mount)"),
    errno.ELOOP: (True, "a loop of symbolic links"),
    errno.ENAMETOOLONG: (True, "a name too long for the filesystem"),
    errno.ENOTDIR: (True, "a part of the path is a file, not a folder"),
}

_OUT_OF_MEMORY_WORDS = ("can't allocate memory", "cannot allocate memory", "out of memory")


def environment_error(err: BaseException) -> GradianError | None:
    """The project error an unexpected builtin error really is, or ``None`` for a genuine bug.

    Some failures reach the command line from inside libraries (torch, numpy, the filesystem)
    however carefully the stages check their inputs first: the machine runs out of memory, a
    folder turns out to be read-only or a symlink loops. They are about the environment or a
    path the user gave, so they get a one-line message with the way out instead of the
    internal-error exit code.
    """
    if isinstance(err, MemoryError) or (
        isinstance(err, RuntimeError) and any(w in str(err).lower() for w in _OUT_OF_MEMORY_WORDS)
    ):
        detail = " ".join(str(err).split())[:200]
        return GradianEnvironmentError(
            "this machine ran out of memory" + (f" ({detail})" if detail else "")
            + "; lower grads.batch_size / evaluation.batch_size or grads.max_seq_length, "
            "shorten the longest rows, or run on a machine with more memory (gradian plan predicts the peak)"
        )
    if isinstance(err, OSError):
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {err.filename}" if err.filename else ""
            return DiskFullError(f"the disk filled up{where}; free space or point --out / cache_dir at a "
                                 "larger disk, then run the command again")
        known = _PATH_ERRNOS.get(err.errno or -1)
        if known is not None and err.filename:
            input_fault, meaning = known
            path = err.filename if not err.filename2 else f"{err.filename} -> {err.filename2}"
            if input_fault:
                return ConfigError(f"{path}: {meaning}; pass another path")
            return GradianEnvironmentError(f"{path}: {meaning}; fix the folder's permissions or "
                                           "pass a path on a disk you can write to")
    return None
