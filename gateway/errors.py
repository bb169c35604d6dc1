"""The gateway's error type and the one place OpenAI-shaped error bodies are rendered.

Every error a client sees, whether the gateway raised it or an upstream answered with it, has the body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any
from urllib.parse import quote, unquote, urlsplit

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
# the short escapes JSON has for a character (any character may also be written \uXXXX)
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
                  "\t": "\\t"}


def _spelled(secret: str) -> str:
    """A regular expression for ``secret`` in every spelling a JSON string may give it: each character as itself,
    as a ``\\uXXXX`` escape (hex digits in either case; past U+FFFF, its surrogate pair) or as its short escape
    (``\\/``, ``\\"``, ...). A client's JSON decoder turns each of them back into the secret."""
    parts = []
    for ch in secret:
        code = ord(ch)
        units = [code] if code <= 0xFFFF else [0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)]
        forms = [re.escape(ch), "".join(rf"\\u(?i:{unit:04x})" for unit in units)]
        if ch in _SHORT_ESCAPES:
            forms.append(re.escape(_SHORT_ESCAPES[ch]))
        parts.append("(?:" + "|".join(forms) + ")")
    return "".join(parts)


def _marks(secrets: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(raw forms, escapes): at least one of them is in any spelling of any of ``secrets``. The raw forms are the
    fewest (a secret holding another is found by it: the password in ``user:password``); the escapes are those a
    spelling of them can use (``\\u``, and ``\\/`` where one holds a ``/``). None in a text: none of the secrets
    is there, in any spelling."""
    raw = tuple(s for s in secrets if not any(other != s and other in s for other in secrets))
    escapes = {"\\u"} | {_SHORT_ESCAPES[ch] for s in secrets for ch in s if ch in _SHORT_ESCAPES}
    return raw, tuple(sorted(escapes))


def _holds(text: str | bytes, raw: tuple[Any, ...], escapes: tuple[Any, ...], backslash: Any) -> bool:
    """Whether ``text`` holds one of the ``raw`` forms, or one of the ``escapes`` (looked for only where it has a
    backslash at all: one ``memchr``). ``find`` rather than ``in``: see gateway.proxy.sse._payload."""
    for mark in raw:
        if text.find(mark) >= 0:
            return True
    if text.find(backslash) < 0:
        return False
    for mark in escapes:  # noqa: SIM110  (a loop: no generator made per call)
        if text.find(mark) >= 0:
            return True
    return False


# path segments of a backend URL that name an API, not anything of the operator's own (see Redactor)
_API_SEGMENTS = frozenset({"v1", "v2", "v3", "api", "openai", "inference", "llm", "llms", "serving", "models"})


class Redactor:
    """Takes a backend's address and credentials out of text bound for a client or a log.

    Upstream libraries and faulty engines put them in error messages (aiohttp's ``url='http://10.0.0.7:8000
    /v1/chat/completions'``, an engine echoing the Authorization header it rejected); a client learns the
    backend's name instead, which is what it sees in ``x-gateway-backend`` anyway. A credential is found in
    every spelling a JSON string may give it (``\\u0073k-...``, ``\\/``): a client's JSON decoder reads each
    as the credential.

    Text is scrubbed whole, before it is cut: a cut first can fall inside a credential and leave its beginning,
    which no longer matches (:meth:`excerpt`). Where the text itself is the beginning of a longer one (a body
    read up to a bound), ``scrub(..., cut_short=True)`` also redacts a credential's beginning at its end.

    What an engine answers that is not an error (a 200 answer, a stream's usage event) is looked at for the
    credentials alone (:meth:`echoed`, :meth:`scrub_json`): a model's answer may name any address.
    """

    __slots__ = ("_address", "_byte_marks", "_longest", "_marks", "_name", "_pattern", "_secret_pattern",
                 "_secrets")

    def __init__(self, name: str, url: str, secrets: Iterable[str | None] = ()) -> None:
        self._name = f"backend {name}"
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
        alternatives = [re.escape(url.rstrip("/")) + r"[^\s'\"]*"]  # the URL with whatever path follows
        path = parts.path.rstrip("/")
        own = [segment for segment in unquote(path).split("/") if segment and segment.lower() not in _API_SEGMENTS]
        if own:
            # a path of the operator's own (a token a reverse proxy routes by): echoed alone, as an engine or a
            # proxy names the path it was asked (sweep 20); the path, and each long segment of it, in any spelling
            pieces = [path, *(segment for segment in own if len(segment) >= 6)]
            spellings = {spelling for piece in pieces for spelling in (piece, quote(piece), quote(piece, safe=""),
                                                                        unquote(piece))}
            alternatives += [re.escape(p) for p in sorted(spellings, key=len, reverse=True)]
        if host:
            if port is not None:
                alternatives.append(re.escape(f"{host}:{port}"))
                alternatives.append(rf"\(\s*'{re.escape(host)}',\s*{port}\s*\)")  # ('10.0.0.7', 8000)
            alternatives.append(re.escape(host))
        self._address = alternatives
        self._secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)
        # what an echo of them must hold (see _holds), in a decoded string and in the bytes that spell one
        self._marks = _marks(self._secrets)
        self._byte_marks = tuple(tuple(m.encode() for m in marks) for marks in self._marks)
        # (compiled when first needed: a credential's every spelling is a long expression, and most backends'
        # texts never need scrubbing)
        self._pattern: re.Pattern[str] | None = None
        self._secret_pattern: re.Pattern[str] | None = None
        self._longest = max([len(url), *(len(s) for s in self._secrets)])

    def _patterns(self) -> tuple[re.Pattern[str], re.Pattern[str] | None]:
        """(address and credentials, credentials alone); a credential matches as the group ``secret``."""
        if self._pattern is None:
            secret = f"(?P<secret>{'|'.join(_spelled(s) for s in self._secrets)})" if self._secrets else None
            self._pattern = re.compile("|".join([secret, *self._address] if secret else self._address))
            self._secret_pattern = re.compile(secret) if secret else None
        return self._pattern, self._secret_pattern

    def scrub(self, text: str, *, cut_short: bool = False) -> str:
        """``text`` without the backend's address and credentials. ``cut_short``: ``text`` is the beginning of a
        longer text, so it may end inside a credential: a beginning of one at its end is redacted as well."""
        if not text:
            return text
        scrubbed = self._patterns()[0].sub(self._replacement, text)
        return self._without_partial(scrubbed) if cut_short else scrubbed

    def excerpt(self, text: str | bytes, limit: int, *, cut_short: bool = False) -> str:
        """At most ``limit`` characters of ``text`` (bytes are decoded as UTF-8) for a message, scrubbed before
        they are cut. Only a window a credential's length past the cut is read, so a large body costs no more
        than a small one; ``cut_short``: ``text`` is itself the beginning of a longer text."""
        window = text[:limit + 6 * self._longest]  # (6: a character spelled \uXXXX)
        cut_short = cut_short or len(window) < len(text)
        decoded = window.decode("utf-8", "replace") if isinstance(window, bytes) else window
        return self.scrub(decoded, cut_short=cut_short)[:limit]

    def echoed(self, data: bytes) -> bool:
        """Whether ``data`` may hold one of the credentials, in any spelling: a few ``bytes.find`` (C), no parsing.
        False for certain when it holds none (and always for a backend without credentials)."""
        raw, escapes = self._byte_marks
        return bool(raw) and _holds(data, raw, escapes, b"\\")

    def scrub_json(self, doc: Any, *, address: bool = False) -> bool:
        """Scrub every string of a decoded JSON document in place, object keys too, at any depth: the credentials
        (the decoder has turned their escapes back into them; a spelling left in the text itself is found too),
        and with ``address`` the backend's address (an error's text). True when anything was taken out."""
        everything, secrets = self._patterns()
        pattern = everything if address else secrets
        if pattern is None:
            return False
        sub = partial(pattern.sub, self._replacement)
        raw, escapes = self._marks
        # (only a string that may hold a credential goes through the expression: a credential's every spelling is
        # slow to try at every character; an error's few strings all do, for its address)
        looked: Callable[[str], bool] = (bool if address  # (every string but the empty one)
                                         else partial(_holds, raw=raw, escapes=escapes, backslash="\\"))
        changed = False
        stack = [doc]
        while stack:  # (not recursive: a document may be nested deeper than Python recurses)
            node = stack.pop()
            items = list(node.items()) if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, value in items:
                if isinstance(value, str) and looked(value):
                    scrubbed = sub(value)
                    if scrubbed != value:
                        node[key] = value = scrubbed
                        changed = True
                elif isinstance(value, dict | list):
                    stack.append(value)
                if isinstance(key, str) and looked(key):
                    renamed = sub(key)
                    if renamed != key:
                        del node[key]
                        node[renamed] = value
                        changed = True
        return changed

    def _without_partial(self, text: str) -> str:
        """``text`` with a credential's beginning at its very end (at least _MIN_PARTIAL characters) redacted."""
        for secret in self._secrets:
            for size in range(min(len(secret) - 1, len(text)), _MIN_PARTIAL - 1, -1):
                if text.endswith(secret[:size]):
                    return text[:-size] + "[redacted]"
        return text

    def _replacement(self, match: re.Match[str]) -> str:
        return "[redacted]" if match.lastgroup == "secret" else self._name


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
