"""Checking a parsed grammar: a root rule, no undefined rules, a finite derivation for every reachable rule.

The check computes each rule's minimal derivation cost (characters produced plus one per rule expansion,
see least_cost.py): a rule whose cost is infinite derives no finite string. The resulting table is kept,
because a sampler needs exactly these costs to walk the grammar and stop.
"""

from __future__ import annotations

from .errors import ConstraintError
from .grammar_ast import Expr, Grammar, reachable, refs_in
from .least_cost import INFINITE, expression_cost, flatten, least_costs


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
    for name, body in [*grammar.rules.items(), *grammar.lookaheads.items()]:
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
