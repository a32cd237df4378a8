"""Which attribution engines exist, by name, without importing any of them.

This is the one list of engine names: config validation, the CLI's choices and the docs read it.
A built-in engine is one line of ``BUILTIN_ENGINES`` (its name, where its class lives, one line of
summary); a third-party engine is an entry point of the ``gradian.engines`` group,
``<name> = "pkg.module:EngineClass"``, found the way run sources are. Nothing here loads an
engine: ``gradian.engines.registry.get_engine`` does, when one is asked for.

Interface: ``engine_entries() -> {name: EngineEntry}``, ``engine_names()``,
``engine_entry(name)`` (a ``ConfigError`` naming the choices for an unknown name),
``ENGINES_GROUP``.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.metadata import entry_points

from gradian.errors import ConfigError

__all__ = ["BUILTIN_ENGINES", "ENGINES_GROUP", "EngineEntry", "engine_entries", "engine_entry", "engine_names"]

ENGINES_GROUP = "gradian.engines"


@dataclass(frozen=True)
class EngineEntry:
    """One engine by name: where its class is (``module:Class``) and who declared it."""

    name: str
    target: str
    summary: str = ""
    #: ``gradian`` for the built-in engines, else the distribution that declared the entry point
    origin: str = "gradian"


BUILTIN_ENGINES: tuple[EngineEntry, ...] = (
    EngineEntry("datainf", "gradian.engines.datainf:DataInfEngine", "closed-form inverse curvature per LoRA block"),
    EngineEntry("ekfac", "gradian.engines.ekfac:EKFACEngine",
                "eigenvalue-corrected Kronecker-factored curvature per LoRA matrix (EK-FAC)"),
    EngineEntry("graddot", "gradian.engines.graddot:GradDotEngine", "plain gradient dot product, no curvature (baseline)"),
    EngineEntry("kfac", "gradian.engines.ekfac:KFACEngine",
                "Kronecker-factored curvature per LoRA matrix, no eigenvalue correction (K-FAC)"),
    EngineEntry("replay", "gradian.replay.engine:ReplayEngine",
                "exact metagradients through the replayed fine-tune (needs the run's recipe)"),
    EngineEntry("tracin", "gradian.engines.tracin:TracInEngine",
                "learning-rate-weighted gradient dot products over saved checkpoints"),
)


def engine_entries() -> dict[str, EngineEntry]:
    """``{name: EngineEntry}``: the built-in engines, then every installed ``gradian.engines`` entry point.

    An entry point may not reuse a built-in name, and two distributions may not declare one name:
    both are errors naming the distributions, so nothing is picked silently.
    """
    found = {entry.name: entry for entry in BUILTIN_ENGINES}
    for ep in entry_points(group=ENGINES_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an unnamed distribution"
        name = ep.name.lower()
        if name in found:
            if found[name].target == ep.value:
                continue  # one distribution seen twice on sys.path
            raise ConfigError(
                f"engine '{name}' is declared by {found[name].origin} ({found[name].target}) and by {dist} "
                f"({ep.value}) under the {ENGINES_GROUP} entry points; uninstall one of them")
        found[name] = EngineEntry(name, ep.value, origin=dist)
    return dict(sorted(found.items()))


def engine_names() -> list[str]:
    """Every engine ``engine.name`` may choose, sorted."""
    return list(engine_entries())


def engine_entry(name: str, key: str = "engine.name") -> EngineEntry:
    """The entry of engine ``name``; an unknown name is a ``ConfigError`` naming ``key`` and the choices."""
    entries = engine_entries()
    if name in entries:
        return entries[name]
    close = difflib.get_close_matches(str(name), list(entries), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{key} '{name}' is not a known engine{hint}; choose one of {', '.join(entries)}, or install a "
                      f"package that registers it under the {ENGINES_GROUP} entry points")
