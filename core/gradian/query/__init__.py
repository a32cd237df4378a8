"""Query gradients: what the capability looks like in LoRA-gradient space.

Public interface: ``QueryItem``, ``QueryGradient``, ``select_query_items``, ``resolve_signal``,
``build_query_gradient(gm, tokenizer, items, signal, grads_config) -> QueryGradient``,
``QUERY_SIGNALS``, ``NO_CAPABILITY_TARGET``.
"""

from gradian.query.build import (
    NO_CAPABILITY_TARGET,
    QUERY_SIGNALS,
    QueryGradient,
    QueryItem,
    build_query_gradient,
    resolve_signal,
    select_query_items,
)

__all__ = [
    "NO_CAPABILITY_TARGET",
    "QUERY_SIGNALS",
    "QueryGradient",
    "QueryItem",
    "build_query_gradient",
    "resolve_signal",
    "select_query_items",
]
