"""MLflow integration: read a training run into a ``RunRecord``, log a diagnosis as a child run.

This package is the only place that imports mlflow; the engine (``gradian``) stays free of it.
``GradianCallback`` (a ``transformers.TrainerCallback``) is loaded on first use, so reading a run
from the command line does not import transformers.
"""

from __future__ import annotations

from typing import Any

__all__: list[str] = ["GradianCallback"]


def __getattr__(name: str) -> Any:
    if name == "GradianCallback":
        from gradian_mlflow.callback import GradianCallback

        return GradianCallback
    raise AttributeError(f"module 'gradian_mlflow' has no attribute {name!r}")
