"""Character sets as sorted, merged code-point ranges, and drawing a plausible member."""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable
from functools import lru_cache

from .errors import ConstraintError

MAX_CODE_POINT = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]

ALL: Ranges = ((0, MAX_CODE_POINT),)
_SURROGATES = (0xD800, 0xDFFF)
# A few non-ASCII letters so samples are not ASCII-only when a class allows more.
_NICE_NON_ASCII = "éüßλжñ中"


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort and merge overlapping or adjacent ranges."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return tuple(merged)


def complement(ranges: Ranges) -> Ranges:
    """All code points not in ``ranges`` (which must be normalized)."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


@lru_cache(maxsize=1024)
def members(items: Ranges, negated: bool) -> Ranges:
    """The code points a class ``[items]`` (or ``[^items]``) matches."""
    base = normalize(items)
    return complement(base) if negated else base


def contains(ranges: Ranges, code_point: int) -> bool:
    idx = bisect.bisect_right(ranges, (code_point, MAX_CODE_POINT + 1)) - 1
    return idx >= 0 and ranges[idx][0] <= code_point <= ranges[idx][1]


@lru_cache(maxsize=1024)
def _printable_members(ranges: Ranges) -> str:
    return "".join(chr(cp) for cp in range(0x20, 0x7F) if contains(ranges, cp))


@lru_cache(maxsize=1024)
def _nice_members(ranges: Ranges) -> str:
    return "".join(ch for ch in _NICE_NON_ASCII if contains(ranges, ord(ch)))


def sample_char(ranges: Ranges, rng: random.Random) -> str:
    """One member of ``ranges``, preferring printable ASCII, then a few common letters."""
    if not ranges:
        raise ConstraintError("empty character class matches nothing")
    printable = _printable_members(ranges)
    nice = _nice_members(ranges)
    roll = rng.random()
    if printable and (roll < 0.97 or not nice):
        return rng.choice(printable)
    if nice:
        return rng.choice(nice)
    usable = [r for r in ranges if not (r[0] >= _SURROGATES[0] and r[1] <= _SURROGATES[1])]
    if not usable:
        raise ConstraintError("character class contains only surrogate code points")
    lo, hi = rng.choice(usable)
    for _ in range(16):
        cp = rng.randint(lo, hi)
        if not _SURROGATES[0] <= cp <= _SURROGATES[1]:
            return chr(cp)
    return chr(lo if lo < _SURROGATES[0] else hi)
