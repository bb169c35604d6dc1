"""Checking a finished (non-streamed) answer against the request's constraint."""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.structured.constraint import Constraint

CHECKABLE = frozenset({"json_object", "json_schema", "regex", "choice"})


def _texts(route: str, raw: bytes) -> list[str] | str:
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "the backend's answer is not JSON"
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return "the backend's answer has no choices"
    texts = []
    for choice in choices:
        if not isinstance(choice, dict):
            return "a choice is not an object"
        if route == "chat":
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = choice.get("text")
        if not isinstance(text, str):
            return "a choice has no text content"
        texts.append(text)
    return texts


def output_problem(route: str, raw: bytes, constraint: Constraint) -> str | None:
    """Why the answer does not satisfy the constraint, or None when it does (or cannot be checked)."""
    if constraint.kind not in CHECKABLE:
        return None
    texts = _texts(route, raw)
    if isinstance(texts, str):
        return texts
    for text in texts:
        if constraint.kind in ("json_object", "json_schema"):
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                return f"the answer is not valid JSON: {exc}"
            if constraint.kind == "json_object":
                if not isinstance(value, dict):
                    return "the answer is JSON but not an object"
                continue
            from jsonschema import ValidationError, validate

            try:
                validate(value, constraint.schema)
            except ValidationError as exc:
                return f"the answer does not match the schema: {exc.message}"
        elif constraint.kind == "regex":
            if re.fullmatch(constraint.pattern, text) is None:
                return "the answer does not match the regex"
        elif text not in constraint.choices:
            return "the answer is not one of the choices"
    return None
