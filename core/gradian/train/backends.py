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
        if module is not None and importlib.util.find_spec(module) is None:
            status[name] = f"the '{module}' package is not installed (pip install {module})"
        elif name == "unsloth" and not _cuda_visible():
            status[name] = "no CUDA device is visible; unsloth runs only on a CUDA GPU"
        else:
            status[name] = None
    return status


def _cuda_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch install must not break a status report
        return False


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
