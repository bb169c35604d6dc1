"""Usage figures as the translations read them from an engine's chat answer."""

from __future__ import annotations

from typing import Any


def token_count(value: Any) -> int:
    """A usage figure as an engine should write it, a whole number from 0, else 0: an engine may answer anything
    (a string, a list, a negative number), and what a client is told of its usage is never garbage relayed."""
    return value if type(value) is int and value >= 0 else 0


def details(usage: dict[str, Any], name: str, figure: str) -> int:
    """``usage[name][figure]`` (``prompt_tokens_details.cached_tokens``) as :func:`token_count` reads it."""
    found = usage.get(name)
    return token_count(found.get(figure)) if isinstance(found, dict) else 0
