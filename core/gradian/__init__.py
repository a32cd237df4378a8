"""Gradian: find the training examples, or the setting, that broke a LoRA fine-tune.

The engine lives in one sub-package per stage (``config``, ``data``, ``runs``, ``audit``, ...).
It never imports mlflow; the MLflow integration lives in the separate ``gradian_mlflow`` package.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gradian-mlflow")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
