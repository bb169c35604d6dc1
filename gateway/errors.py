"""The gateway's error type and the one place OpenAI-shaped error bodies are rendered.

Every error a client sees, whether the gateway raised it or an upstream answered with it, has the body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

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


def normalise_upstream_error(status: int, raw: bytes, backend: str) -> bytes:
    """Re-shape an upstream error body into the OpenAI envelope.

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
        text = raw.decode("utf-8", "replace").strip()
        message = text[:500] if text else f"upstream answered HTTP {status} with an empty body"
    if not isinstance(code, str):
        code = type_
    return error_body(f"{message} (backend {backend})", error_type_for(status), param, code)
