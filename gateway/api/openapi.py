"""The generation routes in the OpenAPI document.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` are raw ASGI endpoints outside FastAPI's
router (see :class:`gateway.app.GatewayApp`), so FastAPI does not know them. :func:`install_openapi` adds them
to ``app.openapi()``: each request body's JSON schema with the fields the gateway itself checks
(:mod:`gateway.api.validation`; everything else is the engine's to judge, so other properties are allowed),
the 200 answer (JSON, or server-sent events when streamed) and the OpenAI error envelope for 4xx and 5xx.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from gateway.config import LimitSettings

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}

_ROLES = ["system", "developer", "user", "assistant", "tool", "function"]


def _common(limits: LimitSettings) -> dict[str, Any]:
    positive = {"type": ["integer", "null"], "minimum": 1}
    return {
        "model": {"type": "string", "minLength": 1, "description": "a model some backend serves"},
        "stream": {"type": ["boolean", "null"], "default": False},
        "stream_options": {"type": ["object", "null"], "description": "only with stream: true",
                           "properties": {"include_usage": {"type": "boolean"}}},
        "n": positive,
        "max_tokens": {**positive, "maximum": limits.max_tokens},
        "max_completion_tokens": {**positive, "maximum": limits.max_tokens},
        "user": {"type": "string"},
    }


def request_schemas(limits: LimitSettings | None = None) -> dict[str, dict[str, Any]]:
    """The request body schema of each generation route, keyed by component name."""
    limits = limits or LimitSettings()
    common = _common(limits)
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "enum": _ROLES},
            "content": {"type": ["string", "array", "null"],
                        "description": "a string or an array of content parts"},
            "name": {"type": "string"},
        },
    }
    token_ids = {"type": "array", "items": {"type": "integer"}}
    return {
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **common,
                "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages, "items": message},
                "response_format": {"type": "object", "description": "text, json_object or json_schema"},
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **common,
                "prompt": {"anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                    {"type": "array", "minItems": 1, "items": token_ids},
                ]},
            },
        },
        "EmbeddingRequest": {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": common["model"],
                "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]},
                "stream": {"type": ["boolean", "null"], "enum": [False, None],
                           "description": "embeddings cannot be streamed"},
                "user": {"type": "string"},
            },
        },
    }


_ROUTES = {
    "/v1/chat/completions": ("createChatCompletion", "ChatCompletionRequest", "Chat completion (streamed or not)"),
    "/v1/completions": ("createCompletion", "CompletionRequest", "Text completion (streamed or not)"),
    "/v1/embeddings": ("createEmbedding", "EmbeddingRequest", "Embeddings"),
}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _operation(operation_id: str, schema: str, summary: str) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if schema != "EmbeddingRequest":
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "tags": ["OpenAI"],
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": {
                "200": {"description": "The engine's answer, relayed", "content": ok},
                "4XX": _error_response("The request was refused (OpenAI error envelope)"),
                "5XX": _error_response("No backend could answer (OpenAI error envelope)"),
            },
        }
    }


def install_openapi(app: FastAPI) -> None:
    """Extend ``app.openapi()`` with the generation routes (built once, then cached like FastAPI's own)."""
    base = app.openapi
    limits = None
    gateway = getattr(app.state, "gateway", None)
    if gateway is not None:
        limits = gateway.settings.limits

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None and "/v1/chat/completions" in app.openapi_schema.get("paths", {}):
            return app.openapi_schema
        doc = base()
        paths = doc.setdefault("paths", {})
        for path, (operation_id, schema, summary) in _ROUTES.items():
            paths[path] = _operation(operation_id, schema, summary)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(request_schemas(limits))
        schemas["ErrorResponse"] = _ERROR
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
