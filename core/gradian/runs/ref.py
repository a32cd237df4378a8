"""``RunRef``: a ``--run`` value parsed once into the scheme that picks its reader and the id the
reader looks up.

Spellings, read left to right:

- an existing path is a local run directory, whatever it looks like (``RunRef("file", path)``);
- ``file:<path>`` (or ``file://<path>``) is a local run directory that need not exist yet;
- ``<scheme>:<id>``, the scheme two or more letters, digits, ``+``, ``-`` or ``.`` starting with a
  letter (so ``C:\\runs`` stays a path), names a run a registered run source reads: ``mlflow:<id>``,
  ``runs:/<id>``, ``myscheme:abc``. Leading slashes of the id are dropped (``runs:/<id>`` has id
  ``<id>``); the rest is the source's to interpret;
- anything else has no scheme (``RunRef("", text)``): a local directory, unless a run source
  claims such bare references (MLflow claims a bare 32-hex run id; see ``gradian.runs.sources``).

Parsing is syntax plus one ``Path.exists``; which schemes are installed is the registry's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gradian.errors import RunRecordError

__all__ = ["RunRef", "LOCAL_SCHEME"]

#: the scheme of a local run directory; core reads these itself, no run source needed
LOCAL_SCHEME = "file"

_SCHEMED = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+):(?P<rest>.*)$", re.DOTALL)


@dataclass(frozen=True)
class RunRef:
    """A run reference: ``scheme`` (lower case; ``file`` for a local directory, ``""`` when none was
    written), ``id`` (what the source looks up: a run id, a path) and ``raw`` (as the user wrote it)."""

    scheme: str
    id: str
    raw: str

    @classmethod
    def parse(cls, text: "str | RunRef") -> "RunRef":
        """Parse a ``--run`` value; a ``RunRef`` is returned as it is."""
        if isinstance(text, RunRef):
            return text
        raw = str(text).strip()
        if not raw:
            raise RunRecordError("empty run reference: pass a run directory or <scheme>:<run id> with --run")
        if Path(raw).exists():
            return cls(LOCAL_SCHEME, raw, raw)
        match = _SCHEMED.match(raw)
        if match is None:
            return cls("", raw, raw)
        scheme, rest = match.group("scheme").lower(), match.group("rest")
        if scheme == LOCAL_SCHEME:
            # file:///abs keeps its root; file://rel and file:rel are relative to the working directory
            path = rest[2:] if rest.startswith("//") else rest
            return cls(LOCAL_SCHEME, path, raw)
        ident = rest.lstrip("/")
        if not ident:
            raise RunRecordError(f"run reference '{raw}' names no run after '{scheme}:'; pass {scheme}:<run id>")
        return cls(scheme, ident, raw)

    @property
    def is_local(self) -> bool:
        """A local run directory (or a bare value no source claimed, read as one)."""
        return self.scheme in (LOCAL_SCHEME, "")

    def __str__(self) -> str:
        """One spelling per run: the path for a local directory, ``<scheme>:<id>`` otherwise."""
        return self.id if self.is_local else f"{self.scheme}:{self.id}"
