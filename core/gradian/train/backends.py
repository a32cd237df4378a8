"""Training backends and whether each can run here.

Interface: ``BACKENDS``, ``backend_status() -> dict[str, str | None]`` (``None`` when usable,
else the reason), ``require_backend(name)``. ``hf`` needs only transformers and peft; ``trl`` and
``unsloth`` are optional libraries and are never imported unless asked for.
"""

from __future__ import annotations

import importlib.util

from gradian.errors import ConfigError, MissingDependencyError

__all__ = ["BACKENDS", "backend_status", "require_backend"]

#: backend name -> the module it needs beyond transformers and peft
BACKENDS: dict[str, str | None] = {"hf": None, "trl": "trl", "unsloth": "unsloth"}


def backend_status() -> dict[str, str | None]:
    """Each backend mapped to ``None`` when it can run, else why it cannot."""
    status: dict[str, str | None] = {}
    for name, module in BACKENDS.items():
        if module is None or importlib.util.find_spec(module) is not None:
            status[name] = None
        else:
            status[name] = f"the '{module}' package is not installed (pip install {module})"
    return status


def require_backend(name: str) -> str:
    """Return the backend name, or raise naming what is missing and how to get it."""
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown training backend '{name}' (train.backend or --backend); "
            f"choose one of {', '.join(BACKENDS)}"
        )
    reason = backend_status()[name]
    if reason is not None:
        raise MissingDependencyError(
            f"--backend {name} cannot run: {reason}. Use --backend hf, which needs only "
            "transformers and peft."
        )
    return name
