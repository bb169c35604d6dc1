"""How much work Python's ``re`` may do on a client's pattern, bounded from its parse tree before running it.

Python's engine backtracks: ``(a+)+$`` against thirty ``a`` and a ``b`` takes seconds, and nothing can stop a
match once it runs. An upper bound on the paths it may explore follows from the pattern's structure: a
sequence multiplies its items' counts, an alternation adds its branches', a repetition of a choice-free item
(one way to match, or none, at any position) tries at most one path per repetition count, and a repetition
of an item with choices may try exponentially many. Each path costs at most the text's length plus the
pattern's. A caller runs the match only when ``steps`` is within its budget.

Compiling costs too: a character range such as ``[\\x00-\\U0010ffff]`` is expanded code point by code point
(about 7 ms each), so ``compile_cost`` counts those code points.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from gateway.structured.syntax import ConstraintError, parse_regex

_constants: Any = importlib.import_module("re._constants")

MAX_PATTERN_CHARS = 1024  # longer patterns are not analysed (nor matched) on the event loop
_BMP = 0x10000
_HUGE = 10**18  # past this a count is as good as infinite

Paths = tuple[int, int]  # at most c * (n + 1) ** d paths for a text of n characters


def _times(a: int, b: int) -> int:
    return min(a * b, _HUGE)


def _sequence(items: Any) -> Paths | None:
    c, d = 1, 0
    for op, av in items:
        item = _item(str(op), av)
        if item is None:
            return None
        c, d = _times(c, item[0]), d + item[1]
    return c, d


def _item(op: str, av: Any) -> Paths | None:
    if op in ("LITERAL", "NOT_LITERAL", "ANY", "IN", "AT"):
        return 1, 0
    if op == "SUBPATTERN":
        return _sequence(av[3])
    if op == "ATOMIC_GROUP":
        return _sequence(av)
    if op == "BRANCH":
        found = [_sequence(branch) for branch in av[1]]
        if any(f is None for f in found):
            return None
        counts = [f for f in found if f is not None]
        return min(sum(c for c, _ in counts), _HUGE), max(d for _, d in counts)
    if op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        lo, hi, sub = av
        inner = _sequence(sub)
        unbounded = hi == _constants.MAXREPEAT
        if inner == (1, 0):  # one path per repetition count
            return (1, 1) if unbounded else (hi - lo + 1, 0)
        if inner is None or unbounded or inner[1] * hi > 8:
            return None  # exponential in the text's length, or as good as
        c, d = inner
        return min(sum(c**k for k in range(lo, hi + 1)), _HUGE), d * hi
    return None  # backreferences, conditionals, lookarounds: no bound claimed


@lru_cache(maxsize=512)
def analyse(pattern: str, flags: int = 0) -> tuple[Paths | None, int] | None:
    """(path bound, compile cost in code points) of ``pattern``; None when it is not analysable (too
    long to parse on the event loop, or invalid)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return None
    try:
        tree = parse_regex(pattern, flags)
    except ConstraintError:
        return None
    return _sequence(tree), len(pattern) + _range_cost(tree)


def parsed_compile_cost(tree: Any, pattern: str) -> int:
    """Code points compiling the parsed ``pattern`` expands (about 0.1 us each)."""
    return len(pattern) + _range_cost(tree)


def _range_cost(tree: Any) -> int:
    total = 0
    todo = [tree]
    while todo:
        for op, av in todo.pop():
            kind = str(op)
            if kind == "IN":
                total += sum(min(item[1][1] - item[1][0] + 1, _BMP) for item in av if str(item[0]) == "RANGE")
            elif kind == "SUBPATTERN":
                todo.append(av[3])
            elif kind == "ATOMIC_GROUP":
                todo.append(av)
            elif kind == "BRANCH":
                todo.extend(av[1])
            elif kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                todo.append(av[2])
            elif kind in ("ASSERT", "ASSERT_NOT"):
                todo.append(av[1])
            elif kind == "GROUPREF_EXISTS":
                todo.extend(branch for branch in av[1:] if branch is not None)
    return total


def compile_cost(pattern: str, flags: int = 0) -> int | None:
    """Code points (about 0.1 us each) compiling ``pattern`` expands; None when it is not analysable."""
    found = analyse(pattern, flags)
    return None if found is None else found[1]


def steps(pattern: str, length: int, search: bool = False) -> int | None:
    """An upper bound on the steps of matching ``pattern`` against a text of ``length`` characters
    (``search``: from every start position); None when no bound is known. The bound is loose: measured,
    worst-case patterns match at 28 or more estimated steps per nanosecond, and far more on long texts."""
    found = analyse(pattern)
    if found is None or found[0] is None:
        return None
    c, d = found[0]
    paths = _times(c, (length + 1) ** d if d < 20 else _HUGE)
    total = _times(paths, length + len(pattern))
    return _times(total, length + 1) if search else total
