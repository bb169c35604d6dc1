"""Sampling a choice constraint: one of a list of strings."""

from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.structured.syntax.choice import check_choices


def choice_sample(choices: Sequence[str], rng: random.Random) -> str:
    """One of ``choices``, uniformly."""
    check_choices(choices)
    return choices[rng.randrange(len(choices))]
