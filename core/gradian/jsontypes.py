"""The shapes of JSON as it is read and written: report blocks, manifests, run params.

``JsonValue`` is any value ``json.dumps`` writes without a custom encoder; ``JsonObject`` is one
JSON object. Use them where a value is JSON by contract (a report block's ``to_json``, a manifest
read back) instead of ``Any``, so mypy sees what may be in it. A parameter that only reads a JSON
object takes ``Mapping[str, object]``, which accepts any more specific dict.
"""

from __future__ import annotations

from typing import Dict, List, Union

__all__ = ["JsonScalar", "JsonValue", "JsonObject"]

#: a JSON leaf
JsonScalar = Union[str, int, float, bool, None]
#: any JSON value, nested to any depth
JsonValue = Union[JsonScalar, List["JsonValue"], Dict[str, "JsonValue"]]
#: one JSON object
JsonObject = Dict[str, JsonValue]
