"""Choice constraints (one of a list of strings), written as a GBNF grammar or a regex for engines without one."""

from __future__ import annotations

import os
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
    """A GBNF grammar whose root matches exactly one of ``choices``, written as a tree of their common beginnings
    (``"s" ("et" | "um")``, not ``"set" | "sum"``): llama.cpp keeps a parse for each alternative that matches
    the text so far and checks every candidate token against each, so a flat list of choices that begin alike
    cost it one parse per choice at every token of their common beginning. Each branching is a rule of its
    own, called last (llama.cpp's stacks do not grow with the tree's depth, nor does a parser's recursion)."""
    check_choices(choices)
    words = sorted(set(choices))
    rules: list[str] = []
    named = 0
    todo: list[tuple[str, int, int, int]] = [("root", 0, len(words), 0)]  # (rule, first word, end, common length)
    while todo:
        name, first, end, depth = todo.pop()
        alternatives: list[str] = []
        at = first
        if len(words[at]) == depth:  # (one choice ends here: sorted first)
            alternatives.append('""')
            at += 1
        while at < end:
            group_end = at + 1
            while group_end < end and words[group_end][depth] == words[at][depth]:
                group_end += 1
            # (character by character, as wanted: the beginning all the sorted group shares)
            common = len(os.path.commonprefix([words[at], words[group_end - 1]]))  # noqa: RUF071
            literal = render_literal(words[at][depth:common], "gbnf")
            if group_end - at == 1 and len(words[at]) == common:
                alternatives.append(literal)
            else:
                named += 1
                child = f"c{named}"
                todo.append((child, at, group_end, common))
                alternatives.append(f"{literal} {child}")
            at = group_end
        rules.append(f"{name} ::= " + " | ".join(alternatives))
    return "\n".join(rules) + "\n"


def widest_branch(choices: Sequence[str]) -> int:
    """The most ways :func:`gbnf_from_choices`' tree parts at one point (a choice may also end there): what
    llama.cpp's grammar sampler holds at once there, one stack each (10,000 one-character choices: 10,000 at the
    first character, 11.8 s for 4 tokens with a 128k vocabulary, sweep 25)."""
    words = sorted(set(choices))
    widest = 0
    # (in a sorted list, the words beginning with a prefix are consecutive: count the parts at each depth by
    # comparing neighbours, level by level over the groups that share a prefix)
    todo: list[tuple[int, int, int]] = [(0, len(words), 0)]
    while todo:
        first, end, depth = todo.pop()
        ways, at = 0, first
        if len(words[at]) == depth:
            ways, at = 1, at + 1
        while at < end:
            group_end = at + 1
            while group_end < end and words[group_end][depth] == words[at][depth]:
                group_end += 1
            ways += 1
            if group_end - at > 1 or len(words[at]) > depth + 1:
                todo.append((at, group_end, depth + 1))
            at = group_end
        widest = max(widest, ways)
    return widest


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
