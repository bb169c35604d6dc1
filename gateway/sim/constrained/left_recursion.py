"""Left-recursion detection: llama.cpp rejects left-recursive GBNF grammars (xgrammar does not)."""

from __future__ import annotations

from .errors import ConstraintError
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq


def _nullable(expr: Expr, rules: dict[str, bool]) -> bool:
    if isinstance(expr, Lit):
        return expr.text == ""
    if isinstance(expr, CharClass):
        return False
    if isinstance(expr, Ref):
        return rules.get(expr.name, False)
    if isinstance(expr, Seq):
        return all(_nullable(item, rules) for item in expr.items)
    if isinstance(expr, Alt):
        return any(_nullable(option, rules) for option in expr.options)
    return expr.lo == 0 or _nullable(expr.item, rules)


def _leading_refs(expr: Expr, nullable: dict[str, bool], out: set[str]) -> None:
    """Rules that can be expanded first (before any character) when matching ``expr``."""
    if isinstance(expr, Ref):
        out.add(expr.name)
    elif isinstance(expr, Seq):
        for item in expr.items:
            _leading_refs(item, nullable, out)
            if not _nullable(item, nullable):
                break
    elif isinstance(expr, Alt):
        for option in expr.options:
            _leading_refs(option, nullable, out)
    elif isinstance(expr, Repeat) and expr.hi != 0:
        _leading_refs(expr.item, nullable, out)


def check_no_left_recursion(grammar: Grammar) -> None:
    nullable = dict.fromkeys(grammar.rules, False)
    changed = True
    while changed:
        changed = False
        for name, body in grammar.rules.items():
            if not nullable[name] and _nullable(body, nullable):
                nullable[name] = changed = True
    edges: dict[str, set[str]] = {}
    for name, body in grammar.rules.items():
        found: set[str] = set()
        _leading_refs(body, nullable, found)
        edges[name] = found & grammar.rules.keys()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(edges[name]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt] if nxt in path else [name, nxt]
                raise ConstraintError(
                    "gbnf grammar: left recursion is not supported by llama.cpp: " + " -> ".join(cycle)
                )
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in grammar.rules:
        if name not in state:
            visit(name, [name])
