"""Exception handlers so that every error the framework itself raises is OpenAI-shaped too."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import GatewayError

log = logging.getLogger("gateway.api")


def _respond(exc: GatewayError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _respond(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"{request.url.path} does not accept {request.method}"
    else:
        message = str(exc.detail)
    return _respond(GatewayError(exc.status_code, message, headers=dict(exc.headers or {})))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return _respond(GatewayError(400, str(first.get("msg", "invalid request")), param=param))


async def _unexpected(request: Request, exc: Exception) -> Response:
    rid = request.headers.get("x-request-id", "-")[:128]
    log.error("unhandled error on %s %s (request %s): %s", request.method, request.url.path, rid,
              type(exc).__name__)
    log.debug("traceback", exc_info=exc)
    return _respond(GatewayError(500, "The gateway failed to handle the request", code="internal_error"))


def install(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
