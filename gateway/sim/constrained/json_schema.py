"""JSON-schema constraints: the supported keyword set, structural validation, ``$ref`` lookup.

Supported (Draft 2020-12 meaning, plus draft-07 tuple ``items`` / ``additionalItems`` and
boolean ``exclusiveMinimum``/``exclusiveMaximum``): ``type`` (string or list), ``enum``,
``const``, ``properties``, ``required``, ``additionalProperties``, ``minProperties``,
``maxProperties``, ``items``, ``prefixItems``, ``minItems``, ``maxItems``, ``uniqueItems``,
``minLength``, ``maxLength``, ``pattern`` (the ``gateway.structured.syntax.regex`` subset),
``format`` (date, date-time, time, email, uuid, uri, hostname, ipv4, ipv6 generated; others are
annotations), ``minimum``,
``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf``, ``anyOf``, ``oneOf``,
``allOf``, ``$ref`` to ``#``, ``#/$defs/...``, ``#/definitions/...`` (any local JSON pointer),
boolean schemas.  Annotations (title, description, default, examples, ...) and unknown
keywords are ignored, as validators do.  Keywords that constrain values but are not supported
raise ConstraintError naming the keyword and its location.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from gateway.structured.syntax import ConstraintError, validate_regex

TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
UNSUPPORTED = frozenset(
    {
        "not",
        "if",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "patternProperties",
        "propertyNames",
        "contains",
        "minContains",
        "maxContains",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "additionalItems")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def resolve_ref(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#`` or a ``#/json/pointer``) points at."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ConstraintError(f"$ref {ref!r}: only local references ('#/...') are supported")
    pointer = unquote(ref[1:])
    node = root
    if pointer:
        if not pointer.startswith("/"):
            raise ConstraintError(f"$ref {ref!r}: anchors are not supported, use a JSON pointer")
        for raw in pointer[1:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ConstraintError(f"$ref {ref!r} does not resolve (no '{part}')")
    if not isinstance(node, Mapping | bool):
        raise ConstraintError(f"$ref {ref!r} does not point at a schema")
    return node


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def fail(self, path: str, message: str) -> None:
        raise ConstraintError(f"JSON schema at {path or '/'}: {message}")

    def schema(self, node: Any, path: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, Mapping):
            self.fail(path, f"a schema must be an object or a boolean, got {type(node).__name__}")
        for key in node:
            if key in UNSUPPORTED:
                self.fail(path, f"keyword '{key}' is not supported")
        self.keywords(node, path)
        for key in ("properties", "$defs", "definitions"):
            if key in node:
                children = node[key]
                if not isinstance(children, Mapping):
                    self.fail(path, f"'{key}' must be an object")
                for name, child in children.items():
                    self.schema(child, f"{path}/{key}/{name}")
        for key in _SCHEMA_LISTS:
            if key in node:
                members = node[key]
                if not isinstance(members, list) or (key != "prefixItems" and not members):
                    self.fail(path, f"'{key}' must be a non-empty list of schemas")
                for index, child in enumerate(members):
                    self.schema(child, f"{path}/{key}/{index}")
        for key in _SCHEMA_VALUES:
            if key in node:
                self.schema(node[key], f"{path}/{key}")
        if "items" in node:
            items = node["items"]
            for index, child in enumerate(items if isinstance(items, list) else [items]):
                self.schema(child, f"{path}/items" + (f"/{index}" if isinstance(items, list) else ""))

    def keywords(self, node: Mapping[str, Any], path: str) -> None:
        if "type" in node:
            types = node["type"]
            listed = types if isinstance(types, list) else [types]
            if not listed or len(set(map(str, listed))) != len(listed):
                self.fail(path, "'type' must be a type name or a non-empty list of distinct ones")
            for name in listed:
                if name not in TYPES:
                    self.fail(path, f"unknown type {name!r} (expected one of {', '.join(sorted(TYPES))})")
        if "required" in node:
            required = node["required"]
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                self.fail(path, "'required' must be a list of property names")
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            self.fail(path, "'enum' must be a non-empty list")
        for key in _COUNTS:
            if key in node and (not isinstance(node[key], int) or isinstance(node[key], bool) or node[key] < 0):
                self.fail(path, f"'{key}' must be a non-negative integer")
        for key in _NUMBERS:
            if key in node and not is_number(node[key]):
                self.fail(path, f"'{key}' must be a number")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if key in node and not (is_number(node[key]) or isinstance(node[key], bool)):
                self.fail(path, f"'{key}' must be a number")
        if "multipleOf" in node and not (is_number(node["multipleOf"]) and node["multipleOf"] > 0):
            self.fail(path, "'multipleOf' must be a number greater than 0")
        if "uniqueItems" in node and not isinstance(node["uniqueItems"], bool):
            self.fail(path, "'uniqueItems' must be a boolean")
        if "format" in node and not isinstance(node["format"], str):
            self.fail(path, "'format' must be a string")
        if "pattern" in node:
            if not isinstance(node["pattern"], str):
                self.fail(path, "'pattern' must be a string")
            try:
                validate_regex(node["pattern"])
            except ConstraintError as exc:
                self.fail(path, f"'pattern': {exc}")
        if "$ref" in node:
            try:
                resolve_ref(self.root, node["$ref"])
            except ConstraintError as exc:
                self.fail(path, str(exc))
        for low, high in (
            ("minLength", "maxLength"),
            ("minItems", "maxItems"),
            ("minProperties", "maxProperties"),
            ("minimum", "maximum"),
        ):
            if low in node and high in node and node[low] > node[high]:
                self.fail(path, f"'{low}' {node[low]} is greater than '{high}' {node[high]}")


def validate_json_schema(schema: Any) -> None:
    """Raise ConstraintError unless ``schema`` is a well-formed schema in the supported subset."""
    _Checker(schema).schema(schema, "")
