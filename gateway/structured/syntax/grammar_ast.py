"""The grammar model shared by every dialect (GBNF, xgrammar EBNF, Lark) and by regexes."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal as TypingLiteral

from . import charset

Dialect = TypingLiteral["gbnf", "ebnf", "lark", "regex"]


@dataclass(frozen=True)
class Lit:
    """A literal string (possibly empty)."""

    text: str


@dataclass(frozen=True)
class CharClass:
    """One character from ``items`` (or, if ``negated``, one character outside them)."""

    items: charset.Ranges
    negated: bool = False

    def members(self) -> charset.Ranges:
        return charset.members(self.items, self.negated)


@dataclass(frozen=True)
class Ref:
    """A reference to a rule (or a Lark terminal), with its source position for errors."""

    name: str
    line: int = 0
    col: int = 0


@dataclass(frozen=True)
class Seq:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Expr, ...]


@dataclass(frozen=True)
class Repeat:
    """``item`` repeated between ``lo`` and ``hi`` times (``hi`` None: unbounded)."""

    item: Expr
    lo: int
    hi: int | None


Expr = Lit | CharClass | Ref | Seq | Alt | Repeat

ANY_CHAR = CharClass((), negated=True)


def seq(items: list[Expr]) -> Expr:
    """A sequence, flattened when it has exactly one item."""
    return items[0] if len(items) == 1 else Seq(tuple(items))


def alt(options: list[Expr]) -> Expr:
    """An alternation, flattened when it has exactly one option."""
    return options[0] if len(options) == 1 else Alt(tuple(options))


@dataclass
class Grammar:
    """Rules by name, the start rule, where each rule was defined (line, column), and the lookahead assertion
    a rule ends with (xgrammar EBNF only; a promise about what follows the rule, see grammar_parse.py)."""

    rules: dict[str, Expr]
    root: str
    dialect: Dialect
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)
    lookaheads: dict[str, Expr] = field(default_factory=dict)


def refs_in(expr: Expr) -> list[Ref]:
    """Every rule reference inside ``expr``, in source order."""
    out: list[Ref] = []
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Ref):
            out.append(node)
        elif isinstance(node, Seq):
            stack.extend(reversed(node.items))
        elif isinstance(node, Alt):
            stack.extend(reversed(node.options))
        elif isinstance(node, Repeat):
            stack.append(node.item)
    return out


def reachable(grammar: Grammar) -> list[str]:
    """Rule names reachable from the root (defined ones only), root first."""
    seen: dict[str, None] = {}
    todo = [grammar.root]
    while todo:
        name = todo.pop()
        if name in seen or name not in grammar.rules:
            continue
        seen[name] = None
        todo.extend(r.name for r in reversed(refs_in(grammar.rules[name])))
    return list(seen)


class LineIndex:
    """Line and column (from 1) of an offset in a text, in O(log lines): counting the newlines before
    each position from the start of the text would make parsing a long grammar quadratic."""

    def __init__(self, text: str) -> None:
        self._starts = [0]
        at = text.find("\n")
        while at >= 0:
            self._starts.append(at + 1)
            at = text.find("\n", at + 1)

    def line_col(self, pos: int) -> tuple[int, int]:
        line = bisect.bisect_right(self._starts, pos)
        return line, pos - self._starts[line - 1] + 1
