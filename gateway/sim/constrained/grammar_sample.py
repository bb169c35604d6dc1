"""Sampling a string from a grammar constraint (GBNF, xgrammar EBNF, Lark), as a constrained decoder would.

The grammar is parsed and checked by ``gateway.structured.syntax`` (the gateway's own validator), which also
computes each rule's minimal derivation cost (characters produced plus one per rule expansion). Sampling is a
random walk from the root; past a depth or length budget the walk always takes a cheapest alternative and the
fewest repetitions, so the cost strictly decreases at every rule expansion and the walk terminates.
"""

from __future__ import annotations

import random
from functools import lru_cache

from gateway.structured.syntax import DEFAULT_MAX_NESTING, ConstraintError, GrammarDialect, charset, validate_grammar
from gateway.structured.syntax.grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq
from gateway.structured.syntax.grammar_check import CostTable, check_grammar
from gateway.structured.syntax.grammars import prepared_grammar
from gateway.structured.syntax.least_cost import INFINITE

DEPTH_BUDGET = 10
LENGTH_BUDGET = 120
EXTRA_REPEATS = 3
_SURROGATES = (0xD800, 0xDFFF)
# A few non-ASCII letters so samples are not ASCII-only when a class allows more.
_NICE_NON_ASCII = "éüßλжñ中"


@lru_cache(maxsize=1024)
def _printable_members(ranges: charset.Ranges) -> str:
    return "".join(chr(cp) for cp in range(0x20, 0x7F) if charset.contains(ranges, cp))


@lru_cache(maxsize=1024)
def _nice_members(ranges: charset.Ranges) -> str:
    return "".join(ch for ch in _NICE_NON_ASCII if charset.contains(ranges, ord(ch)))


def sample_char(ranges: charset.Ranges, rng: random.Random) -> str:
    """One member of ``ranges``, preferring printable ASCII, then a few common letters."""
    if not ranges:
        raise ConstraintError("empty character class matches nothing")
    printable = _printable_members(ranges)
    nice = _nice_members(ranges)
    roll = rng.random()
    if printable and (roll < 0.97 or not nice):
        return rng.choice(printable)
    if nice:
        return rng.choice(nice)
    usable = [r for r in ranges if not (r[0] >= _SURROGATES[0] and r[1] <= _SURROGATES[1])]
    if not usable:
        raise ConstraintError("character class contains only surrogate code points")
    lo, hi = rng.choice(usable)
    for _ in range(16):
        cp = rng.randint(lo, hi)
        if not _SURROGATES[0] <= cp <= _SURROGATES[1]:
            return chr(cp)
    return chr(lo if lo < _SURROGATES[0] else hi)


class _Walker:
    def __init__(self, table: CostTable, rng: random.Random) -> None:
        self.table = table
        self.rules = table.grammar.rules
        self.rng = rng
        self.out: list[str] = []
        self.length = 0

    def _minimal(self, depth: int) -> bool:
        return depth > DEPTH_BUDGET or self.length > LENGTH_BUDGET

    def emit(self, text: str) -> None:
        self.out.append(text)
        self.length += len(text)

    def walk(self, start: Expr, depth: int) -> None:
        # depth first with an explicit stack (a chain of rules may be deeper than Python's recursion
        # limit); each choice is made when its node is reached, as a recursive walk would make it
        stack = [(start, depth)]
        while stack:
            expr, depth = stack.pop()
            if isinstance(expr, Lit):
                self.emit(expr.text)
            elif isinstance(expr, CharClass):
                self.emit(sample_char(expr.members(), self.rng))
            elif isinstance(expr, Ref):
                stack.append((self.rules[expr.name], depth + 1))
            elif isinstance(expr, Seq):
                stack.extend((item, depth) for item in reversed(expr.items))
            elif isinstance(expr, Alt):
                stack.append((self._pick(expr, depth), depth))
            else:
                stack.extend([(expr.item, depth)] * self._count(expr, depth))

    def _pressure(self, depth: int) -> float:
        """0 at the start, rising to 1 at the depth or length budget."""
        return min(1.0, max(depth / DEPTH_BUDGET, self.length / LENGTH_BUDGET))

    def _pick(self, expr: Alt, depth: int) -> Expr:
        costs = [self.table.cost(option) for option in expr.options]
        if self._minimal(depth) or self.rng.random() < self._pressure(depth) ** 2:
            best = min(costs)
            return self.rng.choice([o for o, c in zip(expr.options, costs, strict=True) if c == best])
        return self.rng.choice([o for o, c in zip(expr.options, costs, strict=True) if c < INFINITE])

    def _count(self, expr: Repeat, depth: int) -> int:
        if self.table.cost(expr.item) >= INFINITE:
            return 0  # only reachable with lo == 0: a finite-cost repeat of nothing
        if self._minimal(depth):
            return expr.lo
        keep_going = 0.55 * (1.0 - self._pressure(depth))
        extra = 0
        while extra < EXTRA_REPEATS and self.rng.random() < keep_going:
            extra += 1
        if expr.lo == 0 and extra == 0 and self.rng.random() < keep_going:
            extra = 1
        count = expr.lo + extra
        return count if expr.hi is None else min(count, expr.hi)


def sample_expr(table: CostTable, expr: Expr, rng: random.Random) -> str:
    walker = _Walker(table, rng)
    walker.walk(expr, 0)
    return "".join(walker.out)


def sample_grammar(grammar: Grammar, rng: random.Random) -> str:
    """Check ``grammar`` and return one string it derives from its root."""
    table = check_grammar(grammar)
    return sample_expr(table, Ref(grammar.root), rng)


def _sample(grammar: str, dialect: GrammarDialect, rng: random.Random) -> str:
    validate_grammar(grammar, dialect)
    table = prepared_grammar(grammar, dialect, DEFAULT_MAX_NESTING, None)
    return sample_expr(table, Ref(table.grammar.root), rng)


def gbnf_sample(grammar: str, rng: random.Random) -> str:
    """A string the llama.cpp GBNF ``grammar`` accepts from rule ``root``."""
    return _sample(grammar, "gbnf", rng)


def ebnf_sample(grammar: str, rng: random.Random) -> str:
    """A string the xgrammar EBNF ``grammar`` accepts from rule ``root``."""
    return _sample(grammar, "ebnf", rng)


def lark_sample(grammar: str, rng: random.Random) -> str:
    """A string the Lark ``grammar`` accepts from rule ``start`` (no ``%ignore``-d text)."""
    return _sample(grammar, "lark", rng)
