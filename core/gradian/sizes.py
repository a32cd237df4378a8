"""Byte sizes as people write and read them: the one formatter and the one parser.

``format_size(n)`` -> ``"327.8 GiB"`` (binary units, one decimal; whole bytes below 1 KiB);
``parse_size("24GiB", flag)`` -> bytes, accepting decimal (``GB``) and binary (``GiB``) units, a
``ConfigError`` naming ``flag`` for anything else.
"""

from __future__ import annotations

import re

from gradian.errors import ConfigError

__all__ = ["format_size", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--memory") -> int:
    """Bytes in ``"24GiB"``, ``"100GB"``, ``"1.5TB"``, ``"512MiB"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"{flag} {text!r} is not a size; write e.g. 24GiB, 80GB, 512MiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """``n`` bytes in the largest binary unit (up to TiB) that keeps the figure at 1 or more."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
