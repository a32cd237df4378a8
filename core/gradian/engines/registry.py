"""Engines by name. Adding one is a module with an ``Engine`` subclass decorated with
``@register_engine`` plus its import line in ``gradian/engines/__init__.py``."""

from __future__ import annotations

from gradian.engines.base import Engine
from gradian.errors import ConfigError

__all__ = ["register_engine", "get_engine", "available_engines", "engine_summaries", "needs_whole_gradients",
           "resolve_cross_check"]

_ENGINES: dict[str, type[Engine]] = {}


def register_engine(cls: type[Engine]) -> type[Engine]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty `name` to be registered")
    if cls.name in _ENGINES and _ENGINES[cls.name] is not cls:
        raise TypeError(f"engine name '{cls.name}' is already taken by {_ENGINES[cls.name].__name__}")
    _ENGINES[cls.name] = cls
    return cls


def get_engine(name: str) -> Engine:
    """A fresh instance of the engine registered as ``name``."""
    try:
        return _ENGINES[name]()
    except KeyError:
        raise ConfigError(
            f"engine.name '{name}' is not a known engine; choose one of {', '.join(available_engines())}"
        ) from None


def available_engines() -> list[str]:
    return sorted(_ENGINES)


def needs_whole_gradients(name: str) -> bool:
    """Whether engine ``name`` fits Kronecker curvature on unprojected per-example gradients
    (EK-FAC, K-FAC): no random projection of the index, and factors gathered while indexing."""
    return get_engine(name).curvature == "kronecker"


def engine_summaries() -> dict[str, str]:
    """``{name: one-line summary}`` of every registered engine, for help texts and docs."""
    return {name: _ENGINES[name].summary for name in available_engines()}


def resolve_cross_check(engine: str, cross_check: str | None) -> str | None:
    """The cross-check engine to run beside ``engine``: ``auto`` is the engine's own
    ``default_cross_check`` (EK-FAC and K-FAC: DataInf; DataInf: graddot; the curvature-free
    engines: DataInf); ``none`` or None is no cross-check; a name must be a registered engine."""
    if cross_check is None or cross_check == "none":
        return None
    if cross_check == "auto":
        return get_engine(engine).default_cross_check
    if cross_check not in _ENGINES:
        raise ConfigError(f"cross-check '{cross_check}' is not a known engine; choose auto, none or one of "
                          f"{', '.join(available_engines())}")
    return cross_check
