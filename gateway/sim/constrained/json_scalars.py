"""Strings (plain, ``format``, ``pattern``) and numbers within the bounds of a schema."""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from gateway.structured.syntax import ConstraintError

from .json_check import multiple_ok
from .json_schema import is_number
from .regex_sample import regex_sample

WORDS = (
    "alpha",
    "bravo",
    "delta",
    "echo",
    "lima",
    "oscar",
    "river",
    "stone",
    "cloud",
    "maple",
    "amber",
    "quiet",
    "swift",
    "north",
    "green",
    "paper",
    "light",
    "ocean",
)
_WINDOW = 100


class Stuck(Exception):
    """This attempt cannot satisfy the schema; the caller retries or tries another branch."""


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1990, 2030):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"


FORMATS: dict[str, Callable[[random.Random], str]] = {
    "date": _date,
    "time": _time,
    "date-time": lambda rng: f"{_date(rng)}T{_time(rng)}",
    "email": lambda rng: f"{rng.choice(WORDS)}{rng.randint(1, 99)}@example.com",
    "uuid": lambda rng: str(uuid.UUID(int=rng.getrandbits(128), version=4)),
    "uri": lambda rng: f"https://example.com/{rng.choice(WORDS)}",
    "hostname": lambda rng: f"{rng.choice(WORDS)}.example.com",
    "ipv4": lambda rng: ".".join(str(rng.randint(1, 254)) for _ in range(4)),
    "ipv6": lambda rng: f"2001:db8::{rng.randint(1, 0xFFFF):x}",
}


def _plain(rng: random.Random, low: int, high: int | None) -> str:
    upper = high if high is not None else low + 24
    lower = max(low, min(3, upper))
    target = rng.randint(lower, min(upper, lower + 20))
    text = ""
    while len(text) < target:
        text = f"{text} {rng.choice(WORDS)}" if text else rng.choice(WORDS)
    if high is not None and len(text) > high:
        text = text[:high].rstrip()
    return text.ljust(low, "x")


def string_value(schema: Mapping[str, Any], rng: random.Random) -> str:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if "pattern" in schema:
        for _ in range(30):
            text = regex_sample(schema["pattern"], rng)
            if len(text) >= low and (high is None or len(text) <= high):
                return text
        raise Stuck
    make = FORMATS.get(schema.get("format", ""))
    if make is not None:
        text = make(rng)
        if len(text) >= low and (high is None or len(text) <= high):
            return text
        raise ConstraintError(f"format {schema['format']!r} cannot meet minLength/maxLength")
    return _plain(rng, low, high)


def _bounds(schema: Mapping[str, Any]) -> tuple[float | None, bool, float | None, bool]:
    """(low, low is exclusive, high, high is exclusive), the tightest of all bound keywords."""
    low, high = schema.get("minimum"), schema.get("maximum")
    low_ex = schema.get("exclusiveMinimum") is True
    high_ex = schema.get("exclusiveMaximum") is True
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if is_number(ex_low) and (low is None or ex_low >= low):
        low, low_ex = ex_low, True
    if is_number(ex_high) and (high is None or ex_high <= high):
        high, high_ex = ex_high, True
    return low, low_ex, high, high_ex


def _fits(value: float, schema: Mapping[str, Any]) -> bool:
    low, low_ex, high, high_ex = _bounds(schema)
    if low is not None and (value < low or (low_ex and value == low)):
        return False
    if high is not None and (value > high or (high_ex and value == high)):
        return False
    return "multipleOf" not in schema or multiple_ok(value, schema["multipleOf"])


def _window(schema: Mapping[str, Any]) -> tuple[float, float, bool]:
    """A search window [lo, hi] and whether hi is a real bound (not a default)."""
    low, _, high, _ = _bounds(schema)
    if low is None and high is None:
        return 0, _WINDOW, False
    if high is None:
        assert low is not None
        return low, low + _WINDOW, False
    if low is None:
        return min(0, high - _WINDOW) if high >= 0 else high - _WINDOW, high, True
    return low, high, True


def integer_value(schema: Mapping[str, Any], rng: random.Random) -> int:
    lo_f, hi_f, _ = _window(schema)
    lo, hi = math.ceil(lo_f), math.floor(hi_f)
    step = 1
    if "multipleOf" in schema:
        step = Fraction(str(schema["multipleOf"])).numerator
    kmin, kmax = -(-lo // step), hi // step
    for _ in range(40):
        if kmin > kmax:
            break
        value = rng.randint(kmin, kmax) * step
        if _fits(value, schema):
            return value
    for k in range(kmin, min(kmax, kmin + 1000) + 1):
        if _fits(k * step, schema):
            return k * step
    raise Stuck


def number_value(schema: Mapping[str, Any], rng: random.Random) -> float:
    lo, hi, _ = _window(schema)
    if "multipleOf" in schema:
        step = Fraction(str(schema["multipleOf"]))
        kmin, kmax = math.ceil(Fraction(str(lo)) / step), math.floor(Fraction(str(hi)) / step)
        for _ in range(40):
            if kmin > kmax:
                break
            value = float(rng.randint(kmin, kmax) * step)
            if _fits(value, schema):
                return value
        raise Stuck
    for candidate in (round(rng.uniform(lo, hi), 2), round(lo + (hi - lo) / 2, 2), (lo + hi) / 2):
        if _fits(candidate, schema):
            return candidate
    raise Stuck
