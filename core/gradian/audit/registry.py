"""The check registry: every audit check registers itself here by id.

A check is one function ``check(ctx: AuditContext) -> Finding | list[Finding] | None`` decorated
with ``@register(id, description, needs=...)``. ``needs`` names the inputs it reads, from
``INPUTS``; the runner skips a check whose inputs are missing and reports why. A check that has its
inputs but lacks a particular value (the run never recorded ``max_grad_norm``) raises
``CheckSkipped`` with the reason. Adding a check is one function in the module of its category.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Union

if TYPE_CHECKING:
    from gradian.findings import Finding

__all__ = ["INPUTS", "CATEGORIES", "Check", "CheckOutcome", "CheckSkipped", "register", "all_checks", "get_check"]

#: what a check function returns: one finding, several, or None when nothing is wrong
CheckOutcome = Union["Finding", Iterable["Finding"], None]

#: what a check may need, and what the user passes to provide it
INPUTS: dict[str, str] = {
    "dataset": "--dataset",
    "tokenizer": "--base-model (or `tokenizer` in the config)",
    "run": "--run",
    "logs": "--run with logged steps",
    "eval": "--eval-dataset",
}

#: category -> module holding its checks, in the order `gradian checks` prints them
CATEGORIES: dict[str, str] = {
    "config": "gradian.audit.config_checks",
    "data": "gradian.audit.data_checks",
    "dynamics": "gradian.audit.dynamics_checks",
}


class CheckSkipped(Exception):
    """Raised inside a check whose inputs exist but lack the value it needs; carries the reason."""


@dataclass(frozen=True)
class Check:
    id: str
    category: str
    description: str
    needs: tuple[str, ...]
    run: Callable[..., object]


_REGISTRY: dict[str, Check] = {}


def register(check_id: str, description: str, needs: Iterable[str]) -> Callable:
    """Decorator registering ``check_id`` (``<category>.<name>``) with its inputs."""
    category, _, name = check_id.partition(".")
    needs = tuple(needs)
    if category not in CATEGORIES or not name:
        raise ValueError(f"check id {check_id!r} must be '<category>.<name>' with category in {list(CATEGORIES)}")
    unknown = [n for n in needs if n not in INPUTS]
    if unknown:
        raise ValueError(f"check {check_id}: unknown inputs {unknown}; use {list(INPUTS)}")

    def decorate(func: Callable) -> Callable:
        if check_id in _REGISTRY and _REGISTRY[check_id].run is not func:
            raise ValueError(f"check {check_id} is registered twice")
        _REGISTRY[check_id] = Check(check_id, category, description, needs, func)
        return func

    return decorate


def _load_all() -> None:
    for module in CATEGORIES.values():
        importlib.import_module(module)


def all_checks() -> list[Check]:
    """Every registered check, sorted by category (config, data, dynamics) then id."""
    _load_all()
    order = list(CATEGORIES)
    return sorted(_REGISTRY.values(), key=lambda c: (order.index(c.category), c.id))


def get_check(check_id: str) -> Check:
    _load_all()
    try:
        return _REGISTRY[check_id]
    except KeyError:
        raise KeyError(f"no audit check {check_id!r}; `gradian checks` lists them") from None
