"""Byte sizes as people write and read them: the one formatter and the one parser.

``format_size(n)`` -> ``"327.8 GiB"`` (binary units, one decimal; whole bytes below 1 KiB);
``parse_size("24GiB", flag)`` -> bytes, accepting decimal (``GB``) and binary (``GiB``) units, a
``ConfigError`` naming ``flag`` for anything else. ``available_memory()`` is the host memory a
command may still take (the kernel's MemAvailable, lowered by a cgroup limit), the bound sizes are
checked against before anything that large is allocated (``check_fits_memory``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gradian.errors import ConfigError

__all__ = ["GIB", "available_memory", "check_fits_memory", "format_size", "parse_size"]

#: bytes in a GiB, the unit of the size settings (grads.max_index_gb)
GIB = 2**30

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


def available_memory() -> int:
    """Bytes of host memory available to this process now (``MemAvailable``, capped by a cgroup
    limit); the physical memory when neither can be read."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    if found is None:
        try:
            found = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            found = 1 << 40  # nothing to read: do not refuse on a guess
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit.isdigit() and int(limit) < (1 << 60):
                used = int(Path(usage_file).read_text().strip())
                found = min(found, max(0, int(limit) - used))
            break
        except (OSError, ValueError):
            continue
    return found


def check_fits_memory(need: float, what: str, fix: str) -> None:
    """Refuse, before allocating it, ``need`` bytes that cannot fit in the available memory.

    ``what`` says what the bytes are for, naming the setting (``"evaluation.n_bootstrap
    100000000000 needs"``); ``fix`` is the way out. Raises ``ConfigError`` (the setting, not the
    machine, is what the user changes).
    """
    have = available_memory()
    if need > have:
        raise ConfigError(f"{what} {format_size(need)} of memory, more than the {format_size(have)} this "
                          f"machine has available; {fix}")
