"""Generating a small JSON value that satisfies a schema (see json_schema.py for the subset).

A generator walks the schema: ``$ref`` and ``allOf`` are merged into one schema, ``anyOf`` /
``oneOf`` try branches in random order until one yields a value the whole schema accepts,
``enum`` picks a member that fits the sibling keywords.  Outputs stay small: optional
properties appear with some probability, arrays hold a few items.  Past a nesting depth the
walk goes minimal (no optional properties, ``minItems`` items, simplest branches first), which
bounds recursive schemas; one with no finite instance raises ConstraintError.  Every result is
checked with json_check before it is returned.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any, cast

from gateway.structured.syntax import ConstraintError

from .json_check import is_valid
from .json_merge import merge
from .json_scalars import WORDS, Stuck, integer_value, number_value, string_value
from .json_schema import resolve_ref, validate_json_schema

_SOFT_DEPTH = 4
_HARD_DEPTH = 40
_ATTEMPTS = 25
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "minProperties", "maxProperties")
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems", "uniqueItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_SIMPLE_FIRST = ("null", "boolean", "integer", "number", "string", "array", "object")


class _Generator:
    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    # -- schema normalisation -------------------------------------------------------------
    def flatten(self, schema: Any) -> dict[str, Any]:
        """``schema`` with its ``$ref`` and ``allOf`` merged in (Stuck for ``false``)."""
        if schema is True:
            return {}
        if cast(Any, schema) is False:
            raise Stuck
        out = dict(schema)
        for _ in range(64):
            if "$ref" in out:
                target = self.flatten(resolve_ref(self.root, out.pop("$ref")))
                out = merge(target, out)
            elif "allOf" in out:
                for part in out.pop("allOf"):
                    out = merge(out, self.flatten(part))
            else:
                return out
        raise ConstraintError("JSON schema: $ref/allOf cycle with no finite instance")

    # -- values ---------------------------------------------------------------------------
    def value(self, schema: Any, depth: int) -> Any:
        if depth > _HARD_DEPTH:
            raise ConstraintError("JSON schema recursion has no finite instance")
        flat = self.flatten(schema)
        if "anyOf" in flat or "oneOf" in flat:
            return self.branch(flat, depth)
        if "const" in flat:
            return copy.deepcopy(flat["const"])
        if "enum" in flat:
            rest = {k: v for k, v in flat.items() if k != "enum"}
            fitting = [e for e in flat["enum"] if is_valid(e, rest, self.root)]
            if not fitting:
                raise Stuck
            return copy.deepcopy(self.rng.choice(fitting))
        kind = self.pick_type(flat, depth)
        if kind == "object":
            return self.object(flat, depth)
        if kind == "array":
            return self.array(flat, depth)
        if kind == "string":
            return string_value(flat, self.rng)
        if kind == "integer":
            return integer_value(flat, self.rng)
        if kind == "number":
            return number_value(flat, self.rng)
        if kind == "boolean":
            return self.rng.random() < 0.5
        return None

    def minimal(self, depth: int) -> bool:
        return depth > _SOFT_DEPTH

    def pick_type(self, schema: Mapping[str, Any], depth: int) -> str:
        declared = schema.get("type")
        if declared is not None:
            types = list(declared) if isinstance(declared, list) else [declared]
        else:
            types = [
                kind
                for kind, keys in (
                    ("object", _OBJECT_KEYS),
                    ("array", _ARRAY_KEYS),
                    ("string", _STRING_KEYS),
                    ("number", _NUMBER_KEYS),
                )
                if any(k in schema for k in keys)
            ] or ["string", "integer", "boolean"]
        if self.minimal(depth):
            return str(min(types, key=_SIMPLE_FIRST.index))
        return str(self.rng.choice(types))

    def branch(self, schema: dict[str, Any], depth: int) -> Any:
        key = "anyOf" if "anyOf" in schema else "oneOf"
        base = {k: v for k, v in schema.items() if k != key}
        options = list(schema[key])
        self.rng.shuffle(options)
        if self.minimal(depth):
            options.sort(key=lambda o: ("$ref" in str(o), len(str(o))))
        for option in options:
            try:
                candidate = self.value(merge(base, self.flatten(option)), depth)
            except (Stuck, ConstraintError):
                continue
            if is_valid(candidate, schema, self.root):
                return candidate
        raise Stuck

    def object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        props: Mapping[str, Any] = schema.get("properties", {})
        required: list[str] = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        low, high = schema.get("minProperties", 0), schema.get("maxProperties")
        if high is not None and len(required) > high:
            raise Stuck
        chosen = [
            n
            for n in props
            if n in required or (props[n] is not False and not self.minimal(depth) and self.rng.random() < 0.6)
        ]
        chosen += [n for n in required if n not in props]
        if high is not None:
            chosen = [n for n in chosen if n in required] + [n for n in chosen if n not in required]
            chosen = chosen[:high]
        out: dict[str, Any] = {}
        for name in [n for n in props if n in chosen] + [n for n in chosen if n not in props]:
            if name not in props and extra is False:
                raise Stuck
            out[name] = self.value(props.get(name, extra), depth + 1)
        wanted = low if (props or self.minimal(depth)) else max(low, self.rng.randint(1, 2))
        spare = [n for n in props if n not in out and props[n] is not False]
        while len(out) < wanted:
            if spare:
                name = spare.pop(0)
                out[name] = self.value(props[name], depth + 1)
            elif extra is not False:
                name = next(w for w in (*WORDS, *(f"key{i}" for i in range(99))) if w not in out)
                out[name] = self.value(extra, depth + 1) if extra is not True else self.small(depth)
            else:
                raise Stuck
        return out

    def array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        items = schema.get("items", True)
        if isinstance(items, list):
            prefix, rest = items, schema.get("additionalItems", True)
        else:
            prefix, rest = schema.get("prefixItems", []), items
        low = schema.get("minItems", 0)
        cap = schema.get("maxItems", low + 3)
        if rest is False:
            cap = min(cap, len(prefix))
        if low > cap:
            raise Stuck
        count = low if self.minimal(depth) else self.rng.randint(min(max(low, 1), cap), min(cap, max(low, 1) + 2))
        out: list[Any] = []
        for index in range(count):
            sub = prefix[index] if index < len(prefix) else rest
            for _ in range(10):
                item = self.value(sub, depth + 1) if sub is not True else self.small(depth)
                if not schema.get("uniqueItems") or all(item != other for other in out):
                    break
            else:
                raise Stuck
            out.append(item)
        return out

    def small(self, depth: int) -> Any:
        """Any small value (for ``{}`` / ``true`` schemas)."""
        roll = self.rng.randrange(4)
        if roll == 0 or self.minimal(depth):
            return self.rng.choice(WORDS)
        return [self.rng.randint(0, 100), self.rng.random() < 0.5, None][roll - 1]


def json_instance(schema: Mapping[str, Any], rng: random.Random) -> Any:
    """A small value valid under ``schema``; deterministic for a given rng state."""
    validate_json_schema(schema)
    if cast(Any, schema) is False:
        raise ConstraintError("JSON schema `false` admits no value")
    generator = _Generator(schema, rng)
    for _ in range(_ATTEMPTS):
        try:
            value = generator.value(schema, 0) if schema not in ({}, True) else generator.small(0)
        except Stuck:
            continue
        if is_valid(value, schema, schema):
            return value
    raise ConstraintError("could not generate a value satisfying the JSON schema (contradictory?)")
