"""The gateway's error type and the one place OpenAI-shaped error bodies are rendered.

Every error a client sees, whether the gateway raised it or an upstream answered with it, has the body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import orjson

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


# the shortest beginning of a credential redacted at the end of a text cut short (one character says nothing, and
# redacting every text that ends in a letter some credential starts with would garble messages for nothing)
_MIN_PARTIAL = 2


class Redactor:
    """Takes a backend's address and credentials out of text bound for a client or a log.

    Upstream libraries and faulty engines put them in error messages (aiohttp's ``url='http://10.0.0.7:8000
    /v1/chat/completions'``, an engine echoing the Authorization header it rejected); a client learns the
    backend's name instead, which is what it sees in ``x-gateway-backend`` anyway.

    Text is scrubbed whole, before it is cut: a cut first can fall inside a credential and leave its beginning,
    which no longer matches (:meth:`excerpt`). Where the text itself is the beginning of a longer one (a body
    read up to a bound), ``scrub(..., cut_short=True)`` also redacts a credential's beginning at its end.
    """

    __slots__ = ("_longest", "_name", "_pattern", "_secrets")

    def __init__(self, name: str, url: str, secrets: Iterable[str | None] = ()) -> None:
        self._name = f"backend {name}"
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
        alternatives = [re.escape(url.rstrip("/")) + r"[^\s'\"]*"]  # the URL with whatever path follows
        if host:
            if port is not None:
                alternatives.append(re.escape(f"{host}:{port}"))
                alternatives.append(rf"\(\s*'{re.escape(host)}',\s*{port}\s*\)")  # ('10.0.0.7', 8000)
            alternatives.append(re.escape(host))
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)
        alternatives += [re.escape(s) for s in self._secrets]
        self._pattern = re.compile("|".join(alternatives))
        self._longest = max([len(url), *(len(s) for s in self._secrets)])

    def scrub(self, text: str, *, cut_short: bool = False) -> str:
        """``text`` without the backend's address and credentials. ``cut_short``: ``text`` is the beginning of a
        longer text, so it may end inside a credential: a beginning of one at its end is redacted as well."""
        if not text:
            return text
        scrubbed = self._pattern.sub(self._replacement, text)
        return self._without_partial(scrubbed) if cut_short else scrubbed

    def excerpt(self, text: str | bytes, limit: int, *, cut_short: bool = False) -> str:
        """At most ``limit`` characters of ``text`` (bytes are decoded as UTF-8) for a message, scrubbed before
        they are cut. Only a window a credential's length past the cut is read, so a large body costs no more
        than a small one; ``cut_short``: ``text`` is itself the beginning of a longer text."""
        window = text[:limit + self._longest]
        cut_short = cut_short or len(window) < len(text)
        decoded = window.decode("utf-8", "replace") if isinstance(window, bytes) else window
        return self.scrub(decoded, cut_short=cut_short)[:limit]

    def _without_partial(self, text: str) -> str:
        """``text`` with a credential's beginning at its very end (at least _MIN_PARTIAL characters) redacted."""
        for secret in self._secrets:
            for size in range(min(len(secret) - 1, len(text)), _MIN_PARTIAL - 1, -1):
                if text.endswith(secret[:size]):
                    return text[:-size] + "[redacted]"
        return text

    def _replacement(self, match: re.Match[str]) -> str:
        return "[redacted]" if match.group(0) in self._secrets else self._name


def error_type_for(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    if status == 503:
        return "service_unavailable_error"
    if status == 504:
        return "timeout_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


class GatewayError(Exception):
    """An error to answer the client with. ``status`` is the HTTP status; the rest fills the envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self._body = body  # an upstream's error, already in the envelope
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        if self._body is not None:
            return self._body
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def normalise_upstream_error(status: int, raw: bytes, backend: str, redactor: Redactor | None = None, *,
                             cut_short: bool = False) -> bytes:
    """Re-shape an upstream error body into the OpenAI envelope. ``cut_short``: ``raw`` is the beginning of a
    longer body (read up to a bound).

    The message is kept (with the backend named); ``type`` is OpenAI's word for the status, so a client's
    checks work whichever engine answered; ``code`` keeps the engine's own string code or, failing that, its
    own error type (``exceed_context_size_error``, ``BadRequestError``), which says more than the status.

    Engines disagree on the shape: vLLM and llama.cpp nest under ``error`` (llama.cpp with a numeric
    ``code``), older vLLM answers ``{"object": "error", "message": ...}``, FastAPI-based servers such as
    TabbyAPI answer ``{"detail": ...}``, and a crashing server may answer plain text.
    """
    message: str | None = None
    type_: str | None = None
    param: str | None = None
    code: str | int | None = None
    try:
        doc: Any = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        if isinstance(inner, dict):
            doc = inner
        elif isinstance(inner, str):
            message = inner
        if message is None:
            for key in ("message", "detail", "msg"):
                value = doc.get(key)
                if isinstance(value, str):
                    message = value
                    break
                if value is not None:
                    message = orjson.dumps(value).decode()
                    break
        if isinstance(doc.get("type"), str):
            type_ = doc["type"]
        if isinstance(doc.get("param"), str):
            param = doc["param"]
        if isinstance(doc.get("code"), str | int):
            code = doc["code"]
    if message is None:
        # a plain-text body, shown up to 500 characters: scrubbed whole, then cut (a cut first could leave the
        # beginning of a credential the engine echoed, which no longer matches)
        text = raw.decode("utf-8", "replace").strip()
        if not text:
            message = f"upstream answered HTTP {status} with an empty body"
        elif redactor is not None:
            message = redactor.excerpt(text, 500, cut_short=cut_short)
        else:
            message = text[:500]
    elif redactor is not None:
        message = redactor.scrub(message)
    if not isinstance(code, str):
        code = type_
    if redactor is not None:
        param = redactor.scrub(param) if param is not None else None
        code = redactor.scrub(code) if code is not None else None
    return error_body(f"{message} (backend {backend})", error_type_for(status), param, code)
