"""Choice constraints (one of a list of strings), written as a GBNF grammar or a regex for engines without one."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

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


def _tree(choices: Sequence[str]) -> Iterator[tuple[int, bool, list[tuple[str, int | None]]]]:
    """The tree of the choices' common beginnings, a node at a time: its number (the root's is 0), whether a choice
    ends there, and its branches, each a text and the node it leads to (None: a choice ends with it). In a sorted
    list the words beginning alike are consecutive, so each node is a range of it."""
    words = sorted(set(choices))
    named = 0
    todo: list[tuple[int, int, int, int]] = [(0, 0, len(words), 0)]  # (node, first word, end, common length)
    while todo:
        node, at, end, depth = todo.pop()
        ends = len(words[at]) == depth  # (sorted first)
        at += ends
        branches: list[tuple[str, int | None]] = []
        while at < end:
            group_end = at + 1
            while group_end < end and words[group_end][depth] == words[at][depth]:
                group_end += 1
            # (character by character, as wanted: the beginning all the sorted group shares)
            common = len(os.path.commonprefix([words[at], words[group_end - 1]]))  # noqa: RUF071
            child: int | None = None
            if group_end - at > 1 or len(words[at]) > common:
                named += 1
                child = named
                todo.append((child, at, group_end, common))
            branches.append((words[at][depth:common], child))
            at = group_end
        yield node, ends, branches


def gbnf_from_choices(choices: Sequence[str]) -> str:
    """A GBNF grammar whose root matches exactly one of ``choices``, written as a tree of their common beginnings
    (``"s" ("et" | "um")``, not ``"set" | "sum"``): llama.cpp keeps a parse for each alternative that matches
    the text so far and checks every candidate token against each, so a flat list of choices that begin alike
    cost it one parse per choice at every token of their common beginning. Each branching is a rule of its
    own, called last (llama.cpp's stacks do not grow with the tree's depth, nor does a parser's recursion)."""
    check_choices(choices)
    rules = []
    for node, ends, branches in _tree(choices):
        alternatives = ['""'] if ends else []
        alternatives += [render_literal(text, "gbnf") + (f" c{child}" if child is not None else "")
                         for text, child in branches]
        rules.append(f"{'root' if node == 0 else f'c{node}'} ::= " + " | ".join(alternatives))
    return "\n".join(rules) + "\n"


def widest_branch(choices: Sequence[str]) -> int:
    """The most ways :func:`gbnf_from_choices`' tree parts at one point (a choice may also end there): what
    llama.cpp's grammar sampler holds at once there, one stack each (10,000 one-character choices: 10,000 at the
    first character, 11.8 s for 4 tokens with a 128k vocabulary, sweep 25)."""
    return max(ends + len(branches) for _, ends, branches in _tree(choices))


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
