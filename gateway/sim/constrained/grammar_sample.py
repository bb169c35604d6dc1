"""Checking a parsed grammar (undefined rules, finite derivations) and sampling from it.

Sampling is a random walk from the root.  Each rule's minimal derivation cost (characters
produced plus one per rule expansion) is precomputed (least_cost.py); past a depth or length
budget the walk always takes a cheapest alternative and the fewest repetitions, so the cost
strictly decreases at every rule expansion and the walk terminates.
"""

from __future__ import annotations

import random

from . import charset
from .errors import ConstraintError
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq, reachable, refs_in
from .least_cost import INFINITE, expression_cost, flatten, least_costs

DEPTH_BUDGET = 10
LENGTH_BUDGET = 120
EXTRA_REPEATS = 3


class CostTable:
    """Minimal derivation cost of every rule and of every expression of the grammar (see least_cost)."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        flat = flatten(grammar)
        costs = least_costs(grammar, 1, flat)
        self.rule_cost: dict[str, int] = costs.rules
        # keyed by identity: equal costs for an expression object wherever it occurs
        self._memo: dict[int, int] = {id(expr): value for expr, value in zip(flat.exprs, costs.values, strict=True)}

    def cost(self, expr: Expr) -> int:
        found = self._memo.get(id(expr))
        if found is not None:
            return found
        return expression_cost(expr, self.rule_cost)  # an expression from outside the grammar


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

    def walk(self, start: Expr, depth: int) -> None:
        # depth first with an explicit stack (a chain of rules may be deeper than Python's recursion
        # limit); each choice is made when its node is reached, as a recursive walk would make it
        stack = [(start, depth)]
        while stack:
            expr, depth = stack.pop()
            if isinstance(expr, Lit):
                self.emit(expr.text)
            elif isinstance(expr, CharClass):
                self.emit(charset.sample_char(expr.members(), self.rng))
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
