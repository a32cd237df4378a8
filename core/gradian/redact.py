"""Keep credentials out of everything Gradian prints or logs.

A tracking URI may carry a password (``http://user:pass@host``) or a token in its query
(``?token=...``, ``&access_token=...``, a signed URL's ``sig=``). ``redact`` replaces the secret
part with ``***`` wherever such a URI appears in a message, and leaves everything else as it was,
so the message still names the host. ``terminal_safe`` writes the control and bidi-override
characters of a user's string as visible escapes, so a dataset cannot drive the terminal.
"""

from __future__ import annotations

import re

__all__ = ["redact", "terminal_safe", "MASK"]

#: what a secret is replaced with
MASK = "***"

# scheme://userinfo@ -- up to the last "@" before the path (a password with a raw "@" is masked whole)
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^\s/?#'\"<>]+)@")

_SECRET_PARAMS = (
    r"[a-z0-9_\-]*token", "password", "passwd", "pwd", "secret", r"client_secret",
    r"api[_\-]?key", "key", "sig", "signature", r"x-amz-signature", r"x-amz-credential",
)
_QUERY_SECRET = re.compile(
    r"(?P<name>[?&;](?:" + "|".join(_SECRET_PARAMS) + r"))=(?P<value>[^&;#\s'\"<>]+)",
    re.IGNORECASE,
)


def _mask_userinfo(match: re.Match[str]) -> str:
    userinfo = match["userinfo"]
    user, sep, _password = userinfo.partition(":")
    # a lone userinfo (https://<token>@host) is a token as often as a user name: mask it whole
    return f"{match['scheme']}{user}:{MASK}@" if sep else f"{match['scheme']}{MASK}@"


def redact(text: str) -> str:
    """``text`` with URI passwords, lone URI user-infos and secret query values replaced by ``***``."""
    if not text or ("@" not in text and "=" not in text):
        return text
    text = _USERINFO.sub(_mask_userinfo, text)
    return _QUERY_SECRET.sub(lambda m: f"{m['name']}={MASK}", text)


#: control characters (C0 but tab and newline, DEL, C1) and the bidirectional overrides and isolates
#: that would let a dataset's text recolour, clear or reorder the terminal
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: object, keep_offsets: bool = False) -> str:
    """``text`` with every control or bidi-override character written as a visible escape
    (``\\x1b``, ``\\u202e``), so strings from a user's data cannot drive the terminal.
    ``keep_offsets`` writes each as one U+FFFD instead, so character offsets into it still hold."""
    if keep_offsets:
        return _UNSAFE.sub("\ufffd", str(text))
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", str(text))
