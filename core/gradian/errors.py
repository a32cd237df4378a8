"""One error hierarchy for every stage.

Each error also inherits the builtin it refines, so callers that catch ``ValueError`` or
``FileNotFoundError`` keep working. Messages name the value, the place (file:line, flag or config
key) and the fix. The CLI turns any ``GradianError`` into one line on stderr and its
``exit_code``: 2 for bad input (the default), 3 for a ``GradianEnvironmentError`` (a missing
package, an unwritable folder, a tracking server that does not answer), which the same command can
get past once the environment is fixed.
"""

from __future__ import annotations

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
