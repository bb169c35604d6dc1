"""Left recursion that llama.cpp accepts but cannot finish preparing, and a cycle finder for graphs.

llama.cpp refuses left recursion only as its compiler sees it (gbnf_llama.py): a rule is passed over before
the first character only if one of its alternatives is empty. A rule that can match the empty string in
another way (``x ::= y``, ``y ::= ""``) slips through, and if such a cycle leaves something to match after
one of its steps (``root ::= x root "b" | "c"``), every turn of the cycle pushes one more pending element
onto llama.cpp's parse stack: the request never gets an answer (measured with llama.cpp 0.3.36). Cycles
whose every step is the last element of its alternative keep the stack as it is and finish; those are
allowed. The gateway refuses the growing ones.

Linear and without recursion: nullability is "least length 0" (least_cost with no charge per expansion);
the strongly connected components come from an iterative Tarjan search (a chain of rules may be longer than
Python's recursion limit). A reference inside a repetition (other than ``?``) or followed by anything in its
sequence counts as a growing step: llama.cpp's own rules for groups and repetitions are not in the grammar
model, so this errs on the side of refusing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import TypeVar

from .errors import ConstraintError
from .grammar_ast import Alt, Expr, Grammar, Ref, Repeat, Seq, reachable
from .least_cost import flatten, least_costs

K = TypeVar("K", bound=Hashable)


def _leading_refs(body: Expr, nullable: dict[int, bool]) -> list[tuple[str, bool]]:
    """Rules that can be expanded first (before any character) when matching ``body``, each with whether it
    is expanded in the last place of everything around it (then llama.cpp pushes nothing for it)."""
    out: list[tuple[str, bool]] = []
    stack: list[tuple[Expr, bool]] = [(body, True)]
    while stack:
        expr, last = stack.pop()
        if isinstance(expr, Ref):
            out.append((expr.name, last))
        elif isinstance(expr, Seq):
            for index, item in enumerate(expr.items):
                stack.append((item, last and index == len(expr.items) - 1))
                if not nullable[id(item)]:
                    break
        elif isinstance(expr, Alt):
            stack.extend((option, last) for option in expr.options)
        elif isinstance(expr, Repeat) and expr.hi != 0:
            stack.append((expr.item, last and expr.hi == 1))
    return out


def check_no_growing_left_recursion(grammar: Grammar) -> None:
    """Raise ConstraintError for a left-recursive cycle, among the rules reachable from the root, that has a
    step with something after it (see the module docstring)."""
    flat = flatten(grammar)
    lengths = least_costs(grammar, 0, flat)
    nullable = {id(expr): value == 0 for expr, value in zip(flat.exprs, lengths.values, strict=True)}
    rules = reachable(grammar)
    steps = {name: _leading_refs(grammar.rules[name], nullable) for name in rules}
    component = strong_components({name: [ref for ref, _ in found] for name, found in steps.items()})
    for name, found in steps.items():
        for ref, last in found:
            if not last and component[ref] == component[name]:
                cycle = " -> ".join([name, *_path(steps, component, ref, name)])
                raise ConstraintError(
                    f"gbnf grammar: left recursion through rules that can match the empty string ({cycle}) that "
                    "llama.cpp accepts but never finishes preparing (each turn leaves one more element to match)")


def _path(steps: dict[str, list[tuple[str, bool]]], component: dict[str, int], start: str, end: str) -> list[str]:
    """The rules on a shortest path from ``start`` to ``end`` within their component, both included."""
    back: dict[str, str | None] = {start: None}
    todo = deque([start])
    while todo and end not in back:
        node = todo.popleft()
        for nxt, _ in steps[node]:
            if nxt not in back and component[nxt] == component[start]:
                back[nxt] = node
                todo.append(nxt)
    path: list[str] = []
    at: str | None = end
    while at is not None:
        path.append(at)
        at = back[at]
    return path[::-1]


def strong_components(edges: Mapping[K, Iterable[K]]) -> dict[K, int]:
    """Each node's strongly connected component (Tarjan's algorithm, with an explicit stack)."""
    index: dict[K, int] = {}
    low: dict[K, int] = {}
    found: dict[K, int] = {}
    stack: list[K] = []
    on_stack: set[K] = set()
    for root in edges:
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work: list[tuple[K, Iterator[K]]] = [(root, iter(edges[root]))]
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    found[member] = index[node]
                    if member == node:
                        break
    return found


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
