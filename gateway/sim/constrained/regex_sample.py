"""Sampling a string that matches a regex constraint (the subset ``gateway.structured.syntax.regex`` parses).

Unbounded quantifiers are capped a few repeats past their minimum; every sample is checked with
``re.fullmatch`` and drawn again (a few times) if an anchor or a flag made it miss.
"""

from __future__ import annotations

import random
import re

from gateway.structured.syntax import DEFAULT_MAX_NESTING, ConstraintError
from gateway.structured.syntax.regex import compiled_regex

from .grammar_sample import sample_expr

_ATTEMPTS = 12


def regex_sample(pattern: str, rng: random.Random) -> str:
    """A string that ``re.fullmatch``-es ``pattern``; deterministic for a given rng state."""
    expr, table = compiled_regex(pattern, 0, DEFAULT_MAX_NESTING)
    for _ in range(_ATTEMPTS):
        text = sample_expr(table, expr, rng)
        if re.fullmatch(pattern, text) is not None:
            return text
    raise ConstraintError(
        f"could not generate a string matching {pattern!r} (anchors placed mid-pattern, or flags"
        " interplay outside the supported subset)"
    )
