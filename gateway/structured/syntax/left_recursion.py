"""Left-recursion detection: llama.cpp rejects left-recursive GBNF grammars (xgrammar does not).

Linear and without recursion: nullability is "least length 0" (least_cost with no charge per
expansion), and the search for a cycle among the rules that can be expanded first is a depth-first
search with an explicit stack (a chain of rules may be longer than Python's recursion limit).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import TypeVar

from .errors import ConstraintError
from .grammar_ast import Alt, Expr, Grammar, Ref, Repeat, Seq
from .least_cost import flatten, least_costs

K = TypeVar("K", bound=Hashable)


def _leading_refs(body: Expr, nullable: dict[int, bool]) -> set[str]:
    """Rules that can be expanded first (before any character) when matching ``body``."""
    out: set[str] = set()
    stack = [body]
    while stack:
        expr = stack.pop()
        if isinstance(expr, Ref):
            out.add(expr.name)
        elif isinstance(expr, Seq):
            for item in expr.items:
                stack.append(item)
                if not nullable[id(item)]:
                    break
        elif isinstance(expr, Alt):
            stack.extend(expr.options)
        elif isinstance(expr, Repeat) and expr.hi != 0:
            stack.append(expr.item)
    return out


def check_no_left_recursion(grammar: Grammar) -> None:
    flat = flatten(grammar)
    lengths = least_costs(grammar, 0, flat)
    nullable = {id(expr): value == 0 for expr, value in zip(flat.exprs, lengths.values, strict=True)}
    edges = {name: sorted(_leading_refs(body, nullable) & grammar.rules.keys())
             for name, body in grammar.rules.items()}
    cycle = first_cycle(edges)
    if cycle:
        raise ConstraintError("gbnf grammar: left recursion is not supported by llama.cpp: " + " -> ".join(cycle))


def first_cycle(edges: Mapping[K, Iterable[K]]) -> list[K]:
    """A cycle of the directed graph ``edges`` (node -> successors; every successor is a key), its first node
    repeated at its end; [] when there is none. Iterative depth-first search: no recursion per node."""
    state: dict[K, int] = {}  # 1: on the current path, 2: done
    for start in edges:
        if start in state:
            continue
        path = [start]
        todo: list[Iterator[K]] = [iter(edges[start])]
        state[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(edges[nxt]))
    return []
