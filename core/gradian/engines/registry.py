"""Engines by name, loaded when asked for.

The names live in ``gradian.config.engines`` (built-in table and the ``gradian.engines`` entry
points), so the config validates ``engine.name`` without importing an engine. Adding a built-in
engine is its module plus one line of that table; a third-party engine is one entry point.
Only the engine asked for is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Iterable

from gradian.config.engines import engine_entry, engine_names
from gradian.engines.base import Engine, EngineState
from gradian.errors import ConfigError

if TYPE_CHECKING:
    from gradian.config import GradsConfig

__all__ = ["get_engine", "engine_class", "available_engines", "engine_summaries", "needs_whole_gradients",
           "norm_reading_engines", "whole_gradient_engines", "resolve_cross_check", "independent_cross_check", "check_projection"]

_LOADED: dict[str, type[Engine]] = {}


def engine_class(name: str) -> type[Engine]:
    """The ``Engine`` subclass registered as ``name`` (imported on first use)."""
    if name in _LOADED:
        return _LOADED[name]
    entry = engine_entry(name)
    module_name, _, attr = entry.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # noqa: BLE001 -- a broken plugin is named, not a traceback
        raise ConfigError(f"engine '{name}' ({entry.target}, from {entry.origin}) failed to load: "
                          f"{type(err).__name__}: {err}; reinstall or uninstall that package") from None
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"engine '{name}' ({entry.target}, from {entry.origin}) is not a subclass of "
                          "gradian.engines.Engine; fix the entry point")
    if cls.name != name:
        raise ConfigError(f"engine '{name}' ({entry.target}, from {entry.origin}) calls itself '{cls.name}'; "
                          "the class's name attribute must be the name it is registered under")
    _LOADED[name] = cls
    return cls


def get_engine(name: str) -> Engine:
    """A fresh instance of the engine registered as ``name``."""
    return engine_class(name)()


def available_engines() -> list[str]:
    return engine_names()


def needs_whole_gradients(name: str) -> bool:
    """Whether engine ``name`` fits Kronecker curvature on unprojected per-example gradients
    (EK-FAC, K-FAC): no random projection of the index, and factors gathered while indexing."""
    return engine_class(name).curvature == "kronecker"


def norm_reading_engines(names: "Iterable[str | None]") -> list[str]:
    """The engines among ``names`` (None skipped, each once) whose fit reads the rows' squared norms."""
    return [name for name in dict.fromkeys(n for n in names if n) if engine_class(name).reads_norms]


def whole_gradient_engines(names: "Iterable[str | None]") -> list[str]:
    """The engines among ``names`` (None skipped, each once) that need unprojected gradients."""
    return [name for name in dict.fromkeys(n for n in names if n) if needs_whole_gradients(name)]


def check_projection(grads: GradsConfig, names: "Iterable[str | None]") -> None:
    """Refuse, before any work, a flat projection of the index under an engine that fits Kronecker
    curvature on it (``grads.projection_dim`` with ``projection_kind`` countsketch or rademacher);
    the ``kronecker`` kind keeps each LoRA matrix's sides apart and is accepted."""
    if grads.projection_dim is None or grads.projection_kind == "kronecker":
        return
    whole = whole_gradient_engines(names)
    if whole:
        raise ConfigError(
            f"grads.projection_dim is {grads.projection_dim} with grads.projection_kind {grads.projection_kind}, "
            f"and {' and '.join(whole)} fit Kronecker curvature on each LoRA matrix, which a flat projection mixes "
            "up; set grads.projection_kind: kronecker (each matrix's input and output sides projected apart), "
            "grads.projection_dim: null (full gradients, or engine.store: stream when they do not fit), or "
            "engine.name: datainf with --cross-check graddot or none")


def engine_summaries() -> dict[str, str]:
    """``{name: one-line summary}`` of every registered engine, for help texts and docs."""
    out = {}
    for name in available_engines():
        summary = engine_entry(name).summary
        out[name] = summary or engine_class(name).summary
    return out


def resolve_cross_check(engine: str, cross_check: str | None) -> str | None:
    """The cross-check engine to run beside ``engine``: ``auto`` is the engine's own
    ``default_cross_check`` (EK-FAC and K-FAC: DataInf; DataInf: graddot; the curvature-free
    engines: DataInf); ``none`` or None is no cross-check; a name must be a registered engine."""
    if cross_check is None or cross_check == "none":
        return None
    if cross_check == "auto":
        return get_engine(engine).default_cross_check
    if cross_check not in available_engines():
        raise ConfigError(f"cross-check '{cross_check}' is not a known engine; choose auto, none or one of "
                          f"{', '.join(available_engines())}")
    return cross_check


def independent_cross_check(engine: str, state: EngineState) -> str:
    """A cross-check that ranks by another method than ``engine`` (whose fitted ``state`` an
    equivalent cross-check agreed with): curvature against none."""
    if get_engine(engine).curvature == "none" or state.meta.get("equivalent_to"):
        return "datainf"
    return "graddot"
