"""Choice constraints (one of a list of strings), and their GBNF form for engines without one."""

from __future__ import annotations

import random
from collections.abc import Sequence

from .errors import ConstraintError
from .render import render_literal


def check_choices(choices: Sequence[str]) -> None:
    if isinstance(choices, str | bytes) or not isinstance(choices, Sequence):
        raise ConstraintError("choice constraint must be a list of strings")
    if not choices:
        raise ConstraintError("choice constraint must list at least one string")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise ConstraintError(f"choice[{index}] is {type(choice).__name__}, not a string")


def choice_sample(choices: Sequence[str], rng: random.Random) -> str:
    """One of ``choices``, uniformly."""
    check_choices(choices)
    return choices[rng.randrange(len(choices))]


def gbnf_from_choices(choices: Sequence[str]) -> str:
    """A GBNF grammar whose root matches exactly one of ``choices``."""
    check_choices(choices)
    return "root ::= " + " | ".join(render_literal(c, "gbnf") for c in choices) + "\n"
