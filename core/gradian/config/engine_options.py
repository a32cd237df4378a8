"""An engine's own settings: ``engine.options.<engine name>`` in the config, read into the
dataclass the engine declares (``Engine.Options``).

The shared engine keys (``engine.lambda_scale``, ``engine.fisher``, ...) stay where they are; this
section is for what one engine alone reads, a third-party engine's above all, which cannot add a
field to ``EngineConfig``. ``read_engine_options(Options, values, name)`` refuses a key the class
does not have and a value of the wrong kind, naming ``engine.options.<name>.<key>`` and the keys
there are.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Mapping, TypeVar

from gradian.errors import ConfigError

__all__ = ["read_engine_options"]

_O = TypeVar("_O")

#: the kinds a plain option may have, as a config file writes them
_KINDS: dict[object, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _kind(hint: object) -> tuple[tuple[type, ...], bool] | None:
    """(accepted Python types, None allowed) of a field annotation, or None for any other type."""
    if hint in _KINDS:
        return _KINDS[hint], False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        other = next(a for a in args if a is not type(None))
        if other in _KINDS:
            return _KINDS[other], True
    return None


def read_engine_options(options: type[_O], values: Mapping[str, object] | None, engine: str) -> _O:
    """``options`` (a dataclass) built from ``values`` (``engine.options.<engine>``), every key
    and every plain value (bool, int, float, str, optionally None) checked."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"engine '{engine}': Options must be a dataclass, not {options!r}")
    where = f"engine.options.{engine}"
    given = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(options)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: engine '{engine}' has no such option; its options are "
                          f"{', '.join(sorted(fields)) or 'none'}")
    hints = typing.get_type_hints(options)
    for key, value in given.items():
        kind = _kind(hints.get(key))
        if kind is None:
            continue
        accepted, nullable = kind
        if value is None and nullable:
            continue
        if isinstance(value, bool) and bool not in accepted or not isinstance(value, accepted):
            raise ConfigError(f"{where}.{key} is {value!r}; it must be {_wanted(accepted, nullable)}")
    return options(**given)


def _wanted(accepted: tuple[type, ...], nullable: bool) -> str:
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    text = words[accepted[-1]]
    return f"{text} or null" if nullable else text
