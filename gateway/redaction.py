"""Secrets out of the URLs the gateway shows or logs (``GET /admin/config``, ``GET /admin/backends``, the shared
state's log lines): a URL's user and password, and the values of its query parameters whose names say they hold a
secret (``redis://host?password=...``, ``?access_token=``, ``?api_key=``, ``?sig=``). What a client may see of a
backend's address and credentials is :class:`gateway.errors.Redactor`'s."""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit

REDACTED = "[redacted]"

# a query parameter is a secret when one word of its name (split at _ - . and spaces) is one of these, or its name
# holds one of the longer ones run together (accessToken, clientsecret, x-amz-credential)
_SECRET_WORDS = frozenset({"auth", "authorization", "credential", "credentials", "key", "apikey", "pass", "passwd",
                           "password", "pwd", "secret", "sig", "signature", "token", "jwt", "session"})
_SECRET_PARTS = ("password", "passwd", "secret", "token", "apikey", "credential", "signature")
_WORD_BREAK = re.compile(r"[-_.\s]+")


def secret_parameter(name: str) -> bool:
    """Whether a query parameter called ``name`` carries a secret, by its name."""
    lowered = unquote_plus(name).lower()
    return (any(word in _SECRET_WORDS for word in _WORD_BREAK.split(lowered))
            or any(part in lowered for part in _SECRET_PARTS))


def _redact_pair(pair: str) -> str:
    name, eq, value = pair.partition("=")
    return f"{name}={REDACTED}" if eq and value and secret_parameter(name) else pair


def redact_url(url: str) -> str:
    """The URL without its user and password (``redis://:secret@host`` -> ``redis://[redacted]@host``) and with
    the values of its secret query parameters replaced (``?password=secret&db=0`` -> ``?password=[redacted]&db=0``);
    anything else unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    # (edited in place, not rebuilt: urlunsplit drops the empty authority of unix:///path.sock)
    shown = url
    if "@" in parts.netloc:
        shown = shown.replace(f"//{parts.netloc}", f"//{REDACTED}@{parts.netloc.rpartition('@')[2]}", 1)
    if parts.query:
        query = "&".join(_redact_pair(pair) for pair in parts.query.split("&"))
        head, _, tail = shown.partition("?")
        shown = f"{head}?{query}{tail[len(parts.query):]}"
    return shown
