"""Choice constraints (one of a list of strings), written as a GBNF grammar or a regex for engines without one."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConstraintError
from .render import render_literal

_REGEX_SPECIAL = set("\\.^$|?*+()[]{}/")
_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f", "\v": "\\v"}


def check_choices(choices: Sequence[str]) -> None:
    if isinstance(choices, str | bytes) or not isinstance(choices, Sequence):
        raise ConstraintError("choice constraint must be a list of strings")
    if not choices:
        raise ConstraintError("choice constraint must list at least one string")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise ConstraintError(f"choice[{index}] is {type(choice).__name__}, not a string")


def gbnf_from_choices(choices: Sequence[str]) -> str:
    """A GBNF grammar whose root matches exactly one of ``choices``."""
    check_choices(choices)
    return "root ::= " + " | ".join(render_literal(c, "gbnf") for c in choices) + "\n"


def escape_regex(text: str) -> str:
    """Escape ``text`` portably (Python, ECMAScript and Rust regex agree on this form)."""
    out: list[str] = []
    for ch in text:
        if ch in _REGEX_SPECIAL:
            out.append("\\" + ch)
        elif ch in _CONTROL_ESCAPES:
            out.append(_CONTROL_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def regex_from_choices(choices: Sequence[str]) -> str:
    """A regex matching exactly one of ``choices`` (an escaped alternation)."""
    check_choices(choices)
    return "(" + "|".join(escape_regex(c) for c in choices) + ")"
