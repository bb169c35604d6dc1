"""Checking a parsed grammar (undefined rules, finite derivations) and sampling from it.

Sampling is a random walk from the root.  Each rule's minimal derivation cost (characters
produced plus one per rule expansion) is precomputed by fixed point; past a depth or length
budget the walk always takes a cheapest alternative and the fewest repetitions, so the cost
strictly decreases at every rule expansion and the walk terminates.
"""

from __future__ import annotations

import random

from . import charset
from .errors import ConstraintError
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq, reachable, refs_in

INFINITE = 1 << 62
DEPTH_BUDGET = 10
LENGTH_BUDGET = 120
EXTRA_REPEATS = 3


def _cap(value: int) -> int:
    return INFINITE if value >= INFINITE else value


class CostTable:
    """Minimal derivation cost of every rule and (memoised) of every expression."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.rule_cost: dict[str, int] = {name: INFINITE for name in grammar.rules}
        self._memo: dict[int, int] = {}
        changed = True
        while changed:
            changed = False
            for name, body in grammar.rules.items():
                cost = _cap(1 + self._compute(body))
                if cost < self.rule_cost[name]:
                    self.rule_cost[name] = cost
                    changed = True
        self._memo.clear()

    def _compute(self, expr: Expr) -> int:
        if isinstance(expr, Lit):
            return len(expr.text)
        if isinstance(expr, CharClass):
            return 1 if expr.members() else INFINITE
        if isinstance(expr, Ref):
            return self.rule_cost.get(expr.name, INFINITE)
        if isinstance(expr, Seq):
            return _cap(sum(self._compute(item) for item in expr.items))
        if isinstance(expr, Alt):
            return min(self._compute(option) for option in expr.options)
        if expr.lo == 0:
            return 0
        return _cap(expr.lo * self._compute(expr.item))

    def cost(self, expr: Expr) -> int:
        key = id(expr)
        found = self._memo.get(key)
        if found is None:
            found = self._compute(expr)
            self._memo[key] = found
        return found


def _where(grammar: Grammar, name: str) -> str:
    pos = grammar.positions.get(name)
    return f" (defined at line {pos[0]}, column {pos[1]})" if pos else ""


def check_grammar(grammar: Grammar) -> CostTable:
    """Raise ConstraintError for a missing root, undefined references or rules with no finite
    derivation (reachable from the root); return the cost table for sampling."""
    if grammar.root not in grammar.rules:
        raise ConstraintError(f"{grammar.dialect} grammar has no '{grammar.root}' rule")
    for name, body in grammar.rules.items():
        for ref in refs_in(body):
            if ref.name not in grammar.rules:
                raise ConstraintError(
                    f"{grammar.dialect} grammar: undefined rule '{ref.name}' referenced in "
                    f"'{name}' at line {ref.line}, column {ref.col}"
                )
    table = CostTable(grammar)
    for name in reachable(grammar):
        if table.rule_cost[name] >= INFINITE:
            raise ConstraintError(
                f"{grammar.dialect} grammar: rule '{name}'{_where(grammar, name)} has no finite "
                "derivation (every alternative recurses forever or matches nothing)"
            )
    return table


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

    def walk(self, expr: Expr, depth: int) -> None:
        if isinstance(expr, Lit):
            self.emit(expr.text)
        elif isinstance(expr, CharClass):
            self.emit(charset.sample_char(expr.members(), self.rng))
        elif isinstance(expr, Ref):
            self.walk(self.rules[expr.name], depth + 1)
        elif isinstance(expr, Seq):
            for item in expr.items:
                self.walk(item, depth)
        elif isinstance(expr, Alt):
            self.walk(self._pick(expr, depth), depth)
        else:
            for _ in range(self._count(expr, depth)):
                self.walk(expr.item, depth)

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
