"""MLflow integration: read a training run into a ``RunRecord``, log a diagnosis as a child run.

This package is the only place that imports mlflow; the engine (``gradian``) stays free of it.
``GradianCallback`` (a ``transformers.TrainerCallback``) is loaded on first use, so reading a run
from the command line does not import transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gradian_mlflow.callback import GradianCallback

__all__: list[str] = ["GradianCallback"]


def __getattr__(name: str) -> type[GradianCallback]:
    if name == "GradianCallback":
        from gradian_mlflow.callback import GradianCallback

        return GradianCallback
    raise AttributeError(f"module 'gradian_mlflow' has no attribute {name!r}")
