"""How many ways at once llama.cpp's grammar sampler may follow a grammar's parse: found by searching, bounded.

llama.cpp keeps one *stack* per way the text so far may parse (llama-grammar.cpp of llama-cpp-python 0.3.36,
``llama_grammar_advance_stack``: each stack is the positions of the rules entered, the innermost on top, always
a character element; equal stacks are kept once), and at every token checks each candidate token of the whole
vocabulary against each stack, on the main loop every slot shares. Stacks multiply where alternatives share a
beginning and stay apart where those alternatives differ in length under a repetition: ``root ::= s+`` with
``s ::= "a" | "aa" | ... (60 a's)`` holds ~1,800 stacks after 60 a's, and cost 649 ms a token with a 128k
vocabulary, stopping every other slot's stream (sweep 22). A grammar with one way at a time costs one stack.

:func:`most_parses` follows llama.cpp's own steps on the gateway's grammar model, compiled as llama.cpp compiles
it (each group and repetition a rule of its own, ``S{m,n}`` as m copies of S and a chain of n - m optional
rules, a reference at an alternative's end replacing its caller's frame), and searches the texts for one after
which more than ``limit`` stacks are kept. It cannot try every text, so it searches where stacks multiply:
from the root, every repetition and every recursive rule (each other rule and group counted at its start),
each character chosen among those the current stacks accept (one per class of characters they all treat
alike), keeping the ``BEAM`` texts with the most stacks at each step, for ``steps`` characters, then along
the root's, each repetition's and each recursion's greediest text for ``RUN_STEPS`` (where stacks pile up one
every few characters, or fan out behind a long beginning), within a ``budget`` of stack expansions
(``complete`` says whether it ended within it). A grammar whose blow-up it does not reach within those is not
reported (the limit of a search, said in docs/security.md); what it reports is real: the text it
returns is one after which llama.cpp keeps that many stacks.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from . import charset
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq, reachable, refs_in
from .left_recursion import strong_components

# The most stacks a grammar may make llama.cpp keep. llama.cpp's own example grammars keep at most 13 (c.gbnf;
# json.gbnf 12); each stack costs ~2.8 ns a candidate token, so 64 cost ~23 ms a token with a 128k vocabulary.
MAX_PARSES = 64
STEPS = 32  # characters the beam search follows from each start (a slow pile-up is followed by _run)
BEAM = 3  # texts kept at each step of a search
# characters the root, a repetition or a recursion is followed along its greediest text: one stack more every k
# characters reaches 65 only after 65k (`("x"{1999} ... | "x"{30})+`: 667 stacks after 20,000 x's), and what comes
# after a long beginning (130 x's) is past what the beam search follows
RUN_STEPS = 4096
SHAPE_DEPTH = 3  # the innermost frames by which sets of stacks already searched from are known again
INLINE_BUDGET = 2_000  # stack expansions on the event loop (~1 ms); past it the search goes to a worker
WORKER_BUDGET = 400_000  # in a validation worker (~1-2 us each on a loaded core; limits.validation_timeout is 2 s)

# A rule: a named one, a group (an alternation inside a sequence: id of its Alt node), or a repetition's state
# (id of its Repeat node, mandatory copies left, optional copies left or None for unbounded)
RuleKey = str | tuple[int] | tuple[int, int, int | None]
# An element: a rule reference ("rule", key), or a character class as the code-point ranges it matches
Element = tuple[str, RuleKey] | charset.Ranges
Position = tuple[RuleKey, int, int]  # (rule, alternative, element)


@dataclass(frozen=True, slots=True)
class Parses:
    """The most stacks the search found, the text (from the start of ``rule``) after which it found them."""

    count: int
    text: str
    rule: str
    complete: bool  # whether the search ended within its budget
    spent: int = 0  # stack expansions it took


class _Exhausted(Exception):
    pass


class _Compiled:
    """The grammar as llama.cpp compiles it, built lazily: only the rules a search reaches, so a chain of 2,000
    optional copies costs only the copies the search enters."""

    def __init__(self, grammar: Grammar, budget: int) -> None:
        self.grammar = grammar
        self.nodes: dict[int, Expr] = {}
        self._alternatives: dict[RuleKey, tuple[tuple[Element, ...], ...]] = {}
        self.budget = budget
        self._stacks: list[tuple[int, Position]] = [(0, ("", 0, 0))]  # (below, top) by number; 0: empty
        self._ids: dict[tuple[int, Position], int] = {}
        # sets of stacks already searched from, from any start, by their size and innermost frames: a nesting rule
        # (JSON's value in an array in an array...) makes new stacks at every step, the same set again but deeper
        self.shapes: set[tuple[int, frozenset[tuple[Position, ...]]]] = set()

    def spend(self, amount: int = 1) -> None:
        self.budget -= amount
        if self.budget < 0:
            raise _Exhausted

    def alternatives(self, rule: RuleKey) -> tuple[tuple[Element, ...], ...]:
        found = self._alternatives.get(rule)
        if found is None:
            found = self._alternatives[rule] = self._compile(rule)
        return found

    def _compile(self, rule: RuleKey) -> tuple[tuple[Element, ...], ...]:
        if isinstance(rule, str):
            defined = self.grammar.rules[rule]
            options = defined.options if isinstance(defined, Alt) else (defined,)
            return tuple(self.elements(option) for option in options)
        node = self.nodes[rule[0]]
        if len(rule) == 1:
            assert isinstance(node, Alt)
            return tuple(self.elements(option) for option in node.options)
        assert isinstance(node, Repeat) and len(rule) == 3
        _, copies, optional = rule
        item = self.elements(node.item)
        self.spend(len(item))
        if copies > 0:  # (a mandatory copy, then the rest)
            rest: RuleKey = (rule[0], copies - 1, optional)
            return ((*item, ("rule", rest)) if copies > 1 or optional != 0 else item,)
        if optional is None:  # S' ::= S S' |
            return ((*item, ("rule", rule)), ())
        # S'(k) ::= S S'(k-1) |   (S'(1) ::= S |)
        return ((*item, ("rule", (rule[0], 0, optional - 1))) if optional > 1 else item, ())

    def elements(self, expr: Expr) -> tuple[Element, ...]:
        out: list[Element] = []
        todo = [expr]
        while todo:
            node = todo.pop()
            if isinstance(node, Lit):
                out.extend(((ord(ch), ord(ch)),) for ch in node.text)
            elif isinstance(node, CharClass):
                out.append(node.members())
            elif isinstance(node, Ref):
                out.append(("rule", node.name))
            elif isinstance(node, Seq):
                todo.extend(reversed(node.items))
            elif isinstance(node, Alt):
                self.nodes[id(node)] = node
                out.append(("rule", (id(node),)))
            else:
                assert isinstance(node, Repeat)
                if node.hi == 0:
                    continue
                self.nodes[id(node)] = node
                out.append(("rule", (id(node), node.lo, None if node.hi is None else node.hi - node.lo)))
        self.spend(len(out))
        return tuple(out)

    def push(self, below: int, position: Position) -> int:
        """The stack ``below`` with ``position`` on top (stacks are interned: equal stacks are one number)."""
        key = (below, position)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._stacks)
            self._stacks.append(key)
        return found

    def top(self, stack: int) -> Position:
        return self._stacks[stack][1]

    def depth_key(self, stack: int, depth: int) -> tuple[Position, ...]:
        """The ``depth`` innermost positions of a stack."""
        out: list[Position] = []
        while stack and len(out) < depth:
            stack, position = self._stacks[stack]
            out.append(position)
        return tuple(out)

    def _after(self, stack: int) -> int:
        """The stack with its top element passed: the next element of that alternative, or the caller's frame."""
        below, (rule, alternative, index) = self._stacks[stack]
        if index + 1 < len(self.alternatives(rule)[alternative]):
            return self.push(below, (rule, alternative, index + 1))
        return below

    def expand(self, stack: int, into: dict[int, None]) -> None:
        """llama_grammar_advance_stack: the stacks ``stack`` stands for, each with a character element on top
        (or empty, 0: the grammar complete), added to ``into``."""
        todo = [stack]
        seen: set[int] = set()
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            self.spend()
            if not current:
                into[current] = None
                continue
            rule, alternative, index = self.top(current)
            element = self.alternatives(rule)[alternative][index]
            if not element or element[0] != "rule":
                into[current] = None
                continue
            called: RuleKey = element[1]
            below = self._after(current)
            for number, option in enumerate(self.alternatives(called)):
                todo.append(self.push(below, (called, number, 0)) if option else below)

    def start(self, rule: RuleKey, alternative: int | None = None) -> dict[int, None]:
        """The stacks at the start of ``rule`` (of its ``alternative`` alone, if given)."""
        stacks: dict[int, None] = {}
        for number, option in enumerate(self.alternatives(rule)):
            if alternative is None or number == alternative:
                self.expand(self.push(0, (rule, number, 0)) if option else 0, stacks)
        return stacks

    def _class(self, stack: int) -> charset.Ranges:
        rule, alternative, index = self.top(stack)
        return self.alternatives(rule)[alternative][index]  # type: ignore[return-value]

    def accept(self, stacks: dict[int, None], code_point: int) -> dict[int, None]:
        """llama_grammar_accept: the stacks after one more character."""
        out: dict[int, None] = {}
        for stack in stacks:
            if stack and charset.contains(self._class(stack), code_point):
                self.expand(self._after(stack), out)
        return out

    def classes(self, stacks: dict[int, None]) -> list[int]:
        """One character of each class the stacks' top elements all treat alike, accepted by one of them."""
        tops = {self._class(stack) for stack in stacks if stack}
        cuts = sorted({edge for ranges in tops for lo, hi in ranges for edge in (lo, hi + 1)})
        self.spend(len(cuts) * len(tops))
        return [c for c in cuts if any(charset.contains(t, c) for t in tops)]


def _starts(compiled: _Compiled) -> Iterator[tuple[RuleKey, int | None, str, bool]]:
    """Where to search from (a rule, and one of its alternatives or all), and whether to search on or only count
    the stacks it starts with: the root, every repetition and every recursive rule (where stacks may multiply as the
    text goes on) searched; every other rule and group counted at its start, and each alternative of one with
    several searched on its own (a search from where they part follows the few texts keeping the most stacks at
    first, and a decoy alternative of forty short ones drew it from a plain one that piled up 962 later, sweep 25).
    Each expression once (a grammar repeats its pieces: 1,300 rules each ending in ``("," [0-9]+)?``), and no
    repetition of what has one way through (``[a-z]*``: one stack, or two where it may end)."""
    grammar = compiled.grammar
    yield grammar.root, None, grammar.root, True
    entered: list[tuple[RuleKey, int | None, str, bool]] = []
    known: set[Expr] = set()  # (repetitions and groups searched or counted already)
    bodies: set[Expr] = set()  # (rules counted already: a rule that is one repetition is searched as that too)
    recursive = _recursive(grammar)

    def branches(key: RuleKey, node: Expr, name: str) -> None:
        if isinstance(node, Alt):
            entered.extend((key, number, name, True) for number in range(len(node.options)))

    for name in reachable(grammar):  # (a rule nothing refers to is never entered: sweep 24's decoys were such)
        body = grammar.rules[name]
        if name in recursive and name != grammar.root:  # (a rule that may come round again repeats as `*` does)
            yield name, None, name, True
        elif name != grammar.root and body not in bodies:
            bodies.add(body)
            entered.append((name, None, name, False))
            branches(name, body, name)
        elif name == grammar.root:
            branches(name, body, name)
        todo = [body]
        while todo:
            node = todo.pop()
            if isinstance(node, Repeat):
                if node.hi != 0 and not _one_way(node.item) and node not in known:
                    known.add(node)
                    compiled.nodes[id(node)] = node
                    yield (id(node), node.lo, None if node.hi is None else node.hi - node.lo), None, name, True
                todo.append(node.item)
            elif isinstance(node, Seq):
                todo.extend(node.items)
            elif isinstance(node, Alt):
                if node not in known:
                    known.add(node)
                    compiled.nodes[id(node)] = node
                    entered.append(((id(node),), None, name, False))
                    if node is not body:
                        branches((id(node),), node, name)
                todo.extend(node.options)
    yield from entered


def _recursive(grammar: Grammar) -> set[str]:
    """The rules that may come round again through their references (``t ::= s u``, ``u ::= t | ""``)."""
    edges = {name: [ref.name for ref in refs_in(body) if ref.name in grammar.rules]
             for name, body in grammar.rules.items()}
    component = strong_components(edges)
    sizes = Counter(component.values())
    return {name for name, refs in edges.items() if sizes[component[name]] > 1 or name in refs}


def _one_way(expr: Expr) -> bool:
    """Whether ``expr`` is characters and character classes in a fixed sequence (no choice, nothing repeated, no
    rule that may hold either)."""
    if isinstance(expr, Seq):
        return all(isinstance(item, Lit | CharClass) for item in expr.items)
    return isinstance(expr, Lit | CharClass)


def most_parses(grammar: Grammar, budget: int, limit: int = MAX_PARSES, steps: int = STEPS) -> Parses:
    """The most stacks llama.cpp keeps for ``grammar`` after any text the search tried: it stops at the first
    text past ``limit``, after ``steps`` characters from each rule's start, or when ``budget`` stack expansions
    are spent (``complete`` False: rules may be left unsearched)."""
    compiled = _Compiled(grammar, budget)
    most = Parses(0, "", grammar.root, True)
    try:
        for start, alternative, name, search in _starts(compiled):
            first = compiled.start(start, alternative)
            count, text = _search(compiled, first, limit, steps if search else 0)
            if count <= limit and search:  # (the root, repetitions, recursive rules and alternatives)
                # (from the root too: what comes after a long beginning is out of its beam search's reach, and parts
                # side by side are no repetition of their own: `"x"{130} "a"{0,40} "a"{0,40} ... "a"{100}`, 1,001
                # stacks, held another key's stream from 0.18 to 120 s, sweep 24)
                count, text = max((count, text), _run(compiled, first, limit, RUN_STEPS))
            if count > most.count:
                most = Parses(count, text, name, True)
                if count > limit:
                    break
    except _Exhausted:
        return Parses(most.count, most.text, most.rule, False, budget)
    return Parses(most.count, most.text, most.rule, True, budget - compiled.budget)


def _search(compiled: _Compiled, first: dict[int, None], limit: int, steps: int) -> tuple[int, str]:
    """The most stacks found from the stacks ``first``, and after what text."""
    most = (len(first), "")
    beam: list[tuple[str, dict[int, None]]] = [("", first)]
    seen = compiled.shapes
    seen.add(_shape(compiled, first))
    for _ in range(steps):
        if most[0] > limit:
            break
        found: list[tuple[int, str, dict[int, None]]] = []
        for text, stacks in beam:
            for code_point in compiled.classes(stacks):
                after = compiled.accept(stacks, code_point)
                shape = _shape(compiled, after)
                if shape not in seen:
                    seen.add(shape)
                    found.append((len(after), text + chr(code_point), after))
        if not found:
            break
        found = heapq.nlargest(BEAM, found, key=lambda f: f[0])
        most = max(most, found[0][:2])
        beam = [(text, stacks) for _, text, stacks in found]
    return most


def _run(compiled: _Compiled, stacks: dict[int, None], limit: int, steps: int) -> tuple[int, str]:
    """The most stacks along the text that, character by character, keeps the most (the first such character of
    the lowest class), from ``start``, for up to ``steps`` characters or until the stacks come round again:
    where stacks pile up slowly (one more every k characters, a repetition's long alternatives each started at
    another offset), this follows them further than the beam search."""
    most, text = (len(stacks), ""), []
    seen = {_shape(compiled, stacks)}
    taken = 0
    while taken < steps:
        best: tuple[int, int, dict[int, None]] | None = None
        classes = compiled.classes(stacks)
        for code_point in classes:
            after = compiled.accept(stacks, code_point)
            if best is None or len(after) > best[0]:
                best = (len(after), code_point, after)
        # (a character forced, the stacks as many: a literal's run, which costs the budget and not the steps: 4,200
        # x's took a pile-up of 962 stacks past 4,096 steps, sweep 25)
        if not (len(classes) == 1 and best is not None and best[0] == len(stacks)):
            taken += 1
        if best is None or not any(best[2]):
            break
        stacks = best[2]
        text.append(chr(best[1]))
        if best[0] > most[0]:
            most = (best[0], "".join(text))
            if best[0] > limit:
                break
        shape = _shape(compiled, stacks)  # (as the beam search knows sets again: nesting runs come round too)
        if shape in seen:
            break
        seen.add(shape)
    return most


def _shape(compiled: _Compiled, stacks: dict[int, None]) -> tuple[int, frozenset[tuple[Position, ...]]]:
    return len(stacks), frozenset(compiled.depth_key(stack, SHAPE_DEPTH) for stack in stacks)


def parses_problem(found: Parses) -> str | None:
    """What makes llama.cpp's parse of the grammar the search was over go too many ways at once, or None."""
    if found.count <= MAX_PARSES:
        return None
    where = f", in rule '{found.rule}'" if found.rule not in ("root", "regex") else ""
    text = found.text if len(found.text) <= 40 else "..." + found.text[-37:]  # (where it fans out: the end)
    after = f"after {text!r}{where}" if found.text else f"at the start{where}"
    return f"a parse that may go {found.count} ways at once ({after}), more than {MAX_PARSES}"
