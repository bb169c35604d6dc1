"""Merging schemas for ``allOf`` (and for a ``$ref`` or a branch with sibling keywords).

Simple cases merge exactly: types intersect, bounds tighten, ``required`` unions, shared
properties combine under ``allOf``, ``enum``s intersect, ``multipleOf``s take their least common
multiple.  Cases with no simple merged form raise ConstraintError.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from gateway.structured.syntax import ConstraintError

from .json_check import json_equal

_LOWER = ("minimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "maxLength", "maxItems", "maxProperties")
_SUBSCHEMAS = ("additionalProperties", "items", "additionalItems")


def _types(value: Any) -> list[str]:
    return list(value) if isinstance(value, list) else [value]


def _lcm(a: float, b: float) -> float:
    fa, fb = Fraction(str(a)), Fraction(str(b))
    num = math.lcm(fa.numerator, fb.numerator)
    den = math.gcd(fa.denominator, fb.denominator)
    result = Fraction(num, den)
    return int(result) if result.denominator == 1 and isinstance(a, int) and isinstance(b, int) else float(result)


def _exclusive(key: str, cur: Any, new: Any) -> Any:
    if isinstance(cur, bool) or isinstance(new, bool):
        raise ConstraintError(f"allOf: cannot merge boolean '{key}'")
    return max(cur, new) if key == "exclusiveMinimum" else min(cur, new)


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """One schema requiring both ``a`` and ``b`` (neither may contain ``$ref`` or ``allOf``)."""
    out = dict(a)
    for key, new in b.items():
        if key not in out:
            out[key] = new
            continue
        cur = out[key]
        if key == "type":
            common = [t for t in _types(cur) if t in _types(new)]
            if "integer" in _types(new) and "number" in _types(cur) and "integer" not in common:
                common.append("integer")
            if "integer" in _types(cur) and "number" in _types(new) and "integer" not in common:
                common.append("integer")
            if not common:
                raise ConstraintError(f"allOf: types {cur!r} and {new!r} have nothing in common")
            out[key] = common
        elif key == "required":
            out[key] = list(dict.fromkeys([*cur, *new]))
        elif key == "properties":
            props = dict(cur)
            for name, sub in new.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            out[key] = props
        elif key in _LOWER:
            out[key] = max(cur, new)
        elif key in _UPPER:
            out[key] = min(cur, new)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out[key] = _exclusive(key, cur, new)
        elif key == "enum":
            out[key] = [x for x in cur if any(json_equal(x, y) for y in new)]
            if not out[key]:
                raise ConstraintError("allOf: the enums have no value in common")
        elif key in ("const", "pattern", "format"):
            if not json_equal(cur, new):
                raise ConstraintError(f"allOf: cannot combine two different '{key}' values")
        elif key == "multipleOf":
            out[key] = _lcm(cur, new)
        elif key == "uniqueItems":
            out[key] = bool(cur or new)
        elif key in _SUBSCHEMAS:
            if isinstance(cur, list) or isinstance(new, list):
                raise ConstraintError(f"allOf: cannot merge tuple-form '{key}'")
            out[key] = False if cur is False or new is False else {"allOf": [cur, new]}
        elif key == "prefixItems":
            if len(cur) != len(new):
                raise ConstraintError("allOf: cannot merge 'prefixItems' of different lengths")
            out[key] = [{"allOf": [x, y]} for x, y in zip(cur, new, strict=True)]
        elif key in ("anyOf", "oneOf"):
            out[key] = [{"allOf": [x, y]} for x in cur for y in new] if key == "anyOf" else None
            if out[key] is None:
                raise ConstraintError("allOf: cannot merge two 'oneOf' lists")
    return out
