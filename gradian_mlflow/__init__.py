"""MLflow integration: read a training run into a ``RunRecord``, log a diagnosis as a child run.

This package is the only place that imports mlflow; the engine (``gradian``) stays free of it.
"""

from __future__ import annotations

__all__: list[str] = []
