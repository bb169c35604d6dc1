"""Character sets as sorted, merged code-point ranges."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from functools import lru_cache

MAX_CODE_POINT = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]



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
