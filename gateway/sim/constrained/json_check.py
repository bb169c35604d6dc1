"""Checking a value against a schema of the supported subset (Draft 2020-12 semantics).

Used to pick ``anyOf``/``oneOf`` branches and ``enum`` members that fit the rest of the
schema, and to verify every generated instance before it is returned.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from .json_schema import is_number, resolve_ref

_MAX_DEPTH = 200


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON schema defines it: ``1 == 1.0`` but ``true != 1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if is_number(a) and is_number(b):
        return bool(a == b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def has_type(value: Any, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    return {
        "string": isinstance(value, str),
        "number": is_number(value),
        "boolean": isinstance(value, bool),
        "null": value is None,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
    }[name]


def multiple_ok(value: float, step: float) -> bool:
    """``multipleOf`` exactly as the Python ``jsonschema`` validator computes it."""
    if isinstance(step, float):
        quotient = value / step
        try:
            return int(quotient) == quotient
        except (OverflowError, ValueError):
            return False
    return not value % step


class _Validator:
    def __init__(self, root: Any) -> None:
        self.root = root

    def valid(self, value: Any, schema: Any, depth: int = 0) -> bool:
        if isinstance(schema, bool):
            return schema
        if depth > _MAX_DEPTH or not isinstance(schema, Mapping):
            return False
        if "$ref" in schema and not self.valid(value, resolve_ref(self.root, schema["$ref"]), depth + 1):
            return False
        types = schema.get("type")
        if types is not None:
            listed = types if isinstance(types, list) else [types]
            if not any(has_type(value, t) for t in listed):
                return False
        if "const" in schema and not json_equal(value, schema["const"]):
            return False
        if "enum" in schema and not any(json_equal(value, e) for e in schema["enum"]):
            return False
        if not self.combinators(value, schema, depth):
            return False
        if isinstance(value, str):
            return self.string(value, schema)
        if is_number(value):
            return self.number(value, schema)
        if isinstance(value, dict):
            return self.object(value, schema, depth)
        if isinstance(value, list):
            return self.array(value, schema, depth)
        return True

    def combinators(self, value: Any, schema: Mapping[str, Any], depth: int) -> bool:
        if "allOf" in schema and not all(self.valid(value, s, depth + 1) for s in schema["allOf"]):
            return False
        if "anyOf" in schema and not any(self.valid(value, s, depth + 1) for s in schema["anyOf"]):
            return False
        return "oneOf" not in schema or sum(self.valid(value, s, depth + 1) for s in schema["oneOf"]) == 1

    def string(self, value: str, schema: Mapping[str, Any]) -> bool:
        if len(value) < schema.get("minLength", 0):
            return False
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return False
        return "pattern" not in schema or re.search(schema["pattern"], value) is not None

    def number(self, value: float, schema: Mapping[str, Any]) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        low, high = schema.get("minimum"), schema.get("maximum")
        ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if low is not None and (value < low or (ex_low is True and value == low)):
            return False
        if high is not None and (value > high or (ex_high is True and value == high)):
            return False
        if ex_low is not None and not isinstance(ex_low, bool) and value <= ex_low:
            return False
        if ex_high is not None and not isinstance(ex_high, bool) and value >= ex_high:
            return False
        return "multipleOf" not in schema or multiple_ok(value, schema["multipleOf"])

    def object(self, value: dict[str, Any], schema: Mapping[str, Any], depth: int) -> bool:
        if any(name not in value for name in schema.get("required", [])):
            return False
        if len(value) < schema.get("minProperties", 0):
            return False
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            return False
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = props.get(name, extra)
            if not self.valid(item, sub, depth + 1):
                return False
        return True

    def array(self, value: list[Any], schema: Mapping[str, Any], depth: int) -> bool:
        if len(value) < schema.get("minItems", 0):
            return False
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            return False
        items = schema.get("items", True)
        if isinstance(items, list):
            prefix, rest = items, schema.get("additionalItems", True)
        else:
            prefix, rest = schema.get("prefixItems", []), items
        for index, item in enumerate(value):
            sub = prefix[index] if index < len(prefix) else rest
            if not self.valid(item, sub, depth + 1):
                return False
        if schema.get("uniqueItems"):
            for i, a in enumerate(value):
                if any(json_equal(a, b) for b in value[i + 1 :]):
                    return False
        return True


def is_valid(value: Any, schema: Any, root: Any) -> bool:
    """Whether ``value`` satisfies ``schema`` (whose ``$ref``s resolve against ``root``)."""
    return _Validator(root).valid(value, schema)
