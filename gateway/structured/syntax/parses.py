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
rules, a reference at an alternative's end replacing its caller's frame), and searches every text, from the root,
for one after which more than ``limit`` stacks are kept: each character chosen among those the current stacks
accept (one per class of characters they all treat alike), each set of stacks followed on once. Sets that differ
only where their futures are alike count as one (:class:`_Known`): a recursion's deeper copies, and the places
of a chain of optional copies but its last; that makes the search end on a recursive grammar, and it is the one
place a blow-up could go unseen (said in docs/security.md). A search that does not end within its ``budget`` of
stack expansions is no verdict (``complete`` False): the caller keeps such a grammar from llama.cpp. What it
reports is real: the text it returns is one after which llama.cpp keeps that many stacks.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass

from . import charset
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq, refs_in
from .least_cost import flatten, least_costs
from .left_recursion import strong_components

# The most stacks a grammar may make llama.cpp keep. llama.cpp's own example grammars keep at most 13 (c.gbnf;
# json.gbnf 12); each stack costs ~0.7 ms a token with a 128k vocabulary on 2 cores (sweep 29: 61 ways, 53 ms a
# token against 10.6 plain; a key sending such grammars back to back, under the stall guard's threshold, took
# another key's p50 from 0.11 to 1.8-2.6 s at 64): 32 cost ~20 ms.
MAX_PARSES = 32
NESTING_BUDGET = 1_000_000  # steps of nesting_problem in a worker (an expression, and a step a range it holds)
NESTING_INLINE = 2_000  # and on the event loop (past it, the check goes to a worker)
INLINE_BUDGET = 1_000  # steps on the event loop (~3 ms); past it the search goes to a worker
WORKER_BUDGET = 200_000  # in a validation worker (~3 us each: ~0.7 s of a core; limits.validation_timeout is 2 s)
# and at most this much of its CPU time there, whatever the steps (on a slower core than the one the budget was
# measured on): past it the grammar is kept from llama.cpp, rather than a 400 for a grammar the others take
WORKER_SECONDS = 0.4  # (c.gbnf's search takes ~0.3 s)

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

    def __init__(self, grammar: Grammar, budget: int, seconds: float | None = None) -> None:
        self.grammar = grammar
        self.deadline = None if seconds is None else time.thread_time() + seconds  # (this thread's CPU time)
        self._check_at = max(budget - 2048, 0)  # (the clock is read every 2,048 steps)
        self.nodes: dict[int, Expr] = {}
        self.owner: dict[int, str] = {}  # a group's or repetition's node -> the named rule it is written in
        self._alternatives: dict[RuleKey, tuple[tuple[Element, ...], ...]] = {}
        self.budget = budget
        self._stacks: list[tuple[int, Position]] = [(0, ("", 0, 0))]  # (below, top) by number; 0: empty
        self._ids: dict[tuple[int, Position], int] = {}
        self._nexts: dict[int, dict[int, None]] = {}

    def spend(self, amount: int = 1) -> None:
        self.budget -= amount
        if self.budget < self._check_at:
            if self.budget < 0 or (self.deadline is not None and time.thread_time() > self.deadline):
                raise _Exhausted
            self._check_at = max(self.budget - 2048, 0)

    def alternatives(self, rule: RuleKey) -> tuple[tuple[Element, ...], ...]:
        found = self._alternatives.get(rule)
        if found is None:
            found = self._alternatives[rule] = self._compile(rule)
        return found

    def _compile(self, rule: RuleKey) -> tuple[tuple[Element, ...], ...]:
        if isinstance(rule, str):
            defined = self.grammar.rules[rule]
            options = defined.options if isinstance(defined, Alt) else (defined,)
            return tuple(self.elements(option, rule) for option in options)
        node = self.nodes[rule[0]]
        if len(rule) == 1:
            assert isinstance(node, Alt)
            return tuple(self.elements(option, self.owner[rule[0]]) for option in node.options)
        assert isinstance(node, Repeat) and len(rule) == 3
        _, copies, optional = rule
        item = self.elements(node.item, self.owner[rule[0]])
        self.spend(len(item))
        if copies > 0:  # (a mandatory copy, then the rest)
            rest: RuleKey = (rule[0], copies - 1, optional)
            return ((*item, ("rule", rest)) if copies > 1 or optional != 0 else item,)
        if optional is None:  # S' ::= S S' |
            return ((*item, ("rule", rule)), ())
        # S'(k) ::= S S'(k-1) |   (S'(1) ::= S |)
        return ((*item, ("rule", (rule[0], 0, optional - 1))) if optional > 1 else item, ())

    def elements(self, expr: Expr, owner: str) -> tuple[Element, ...]:
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
                self.owner[id(node)] = owner
                out.append(("rule", (id(node),)))
            else:
                assert isinstance(node, Repeat)
                if node.hi == 0:
                    continue
                self.nodes[id(node)] = node
                self.owner[id(node)] = owner
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

    def frame(self, stack: int) -> tuple[int, Position]:
        """The stack's top position, and the stack below it."""
        return self._stacks[stack]

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
                out.update(self._next(stack))
        return out

    def _next(self, stack: int) -> dict[int, None]:
        """The stacks after ``stack``'s top character, expanded (once for each stack: a search meets the same
        stacks in many sets)."""
        found = self._nexts.get(stack)
        if found is None:
            found = self._nexts[stack] = {}
            self.expand(self._after(stack), found)
        else:
            self.spend()
        return found

    def children(self, stacks: dict[int, None]) -> list[tuple[int, dict[int, None]]]:
        """The sets of stacks one more character leads to: one character of each class the stacks' top elements all
        treat alike and one of them accepts, with the stacks after it (:meth:`classes` and :meth:`accept` at once)."""
        if len(stacks) == 1:  # (one way on, as along most of a grammar's literals: its class's first character)
            (stack,) = stacks
            if not stack:
                return []
            self.spend(2)
            return [(self._class(stack)[0][0], self._next(stack))]
        tops: dict[charset.Ranges, list[int]] = {}
        for stack in stacks:
            if stack:
                tops.setdefault(self._class(stack), []).append(stack)
        cuts = sorted({edge for ranges in tops for lo, hi in ranges for edge in (lo, hi + 1)})
        taking: dict[int, list[int]] = {}  # (a class, by the index of its first character in cuts -> its stacks)
        for ranges, group in tops.items():
            for lo, hi in ranges:
                for at in range(bisect_left(cuts, lo), bisect_left(cuts, hi + 1)):
                    taking.setdefault(at, []).extend(group)
        self.spend(len(cuts) + len(stacks))
        out: list[tuple[int, dict[int, None]]] = []
        for at in sorted(taking):
            after: dict[int, None] = {}
            for stack in taking[at]:
                after.update(self._next(stack))
            out.append((cuts[at], after))
        return out

    def classes(self, stacks: dict[int, None]) -> list[int]:
        """One character of each class the stacks' top elements all treat alike, accepted by one of them."""
        tops = {self._class(stack) for stack in stacks if stack}
        cuts = sorted({edge for ranges in tops for lo, hi in ranges for edge in (lo, hi + 1)})
        self.spend(len(cuts) * len(tops))
        return [c for c in cuts if any(charset.contains(t, c) for t in tops)]


def _recursive(grammar: Grammar) -> dict[str, int]:
    """The rules that may come round again through their references (``t ::= s u``, ``u ::= t | ""``), each with
    the number of the group of rules it comes round through."""
    edges = {name: [ref.name for ref in refs_in(body) if ref.name in grammar.rules]
             for name, body in grammar.rules.items()}
    component = strong_components(edges)
    sizes = Counter(component.values())
    return {name: component[name] for name, refs in edges.items() if sizes[component[name]] > 1 or name in refs}


class _Known:
    """Sets of stacks by what makes their futures differ, so that a search follows each once. A stack is known
    by its top, then its frames (the places rules were called from) down to the second of the innermost recursion
    it is in, then where that recursion was entered from, and of each recursion further down only the place it
    returns to (JSON's value in an array in an object in an array...: the set again, deeper, is known again; the
    levels between are passed over, and what each returns to is kept: a rule entered from two places goes on
    differently from each, and a recursion's second level is where it returns to itself). A chain of optional
    copies is known by whether it has one copy left or more (`[ \\t]{0,20}`: its 20 places alike, the last apart);
    a chain of mandatory copies, `"x"{1999}`, exactly (stacks that pile up one every k characters are told
    apart). A recursion whose levels add stacks as they return is :func:`nesting_problem`'s."""

    def __init__(self, compiled: _Compiled) -> None:
        self.compiled = compiled
        self.recursive = _recursive(compiled.grammar)
        self._stacks: dict[int, tuple[Position, ...]] = {}
        self.seen: set[tuple[int, frozenset[tuple[Position, ...]]]] = set()
        self._exact: set[frozenset[int]] = set()

    def add(self, stacks: dict[int, None]) -> bool:
        """Whether the set ``stacks`` is new (it is known from now on)."""
        exact = frozenset(stacks)  # (most sets met again are the very same stacks: known without their frames)
        if exact in self._exact:
            return False
        self._exact.add(exact)
        key = len(stacks), frozenset(self._stack(stack) for stack in stacks)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def _stack(self, stack: int) -> tuple[Position, ...]:
        found = self._stacks.get(stack)
        if found is None:
            out: list[Position] = []
            groups: set[int] = set()
            skipping: int | None = None  # (the recursion whose deeper frames are passed over)
            current = stack
            walked = 0
            while current:
                walked += 1
                current, (rule, alternative, index) = self.compiled.frame(current)
                group = self.recursive.get(rule if isinstance(rule, str) else self.compiled.owner[rule[0]])
                if skipping is not None:
                    if group == skipping:
                        continue
                    skipping = None  # (where the recursion was entered from: kept, it is where it returns to)
                    if group is not None:
                        skipping = group  # (and of a recursion below, only where it returns to)
                if isinstance(rule, tuple) and len(rule) == 3 and rule[1] == 0 and rule[2] is not None:
                    rule = (rule[0], 0, min(rule[2], 2))
                out.append((rule, alternative, index))
                if group is not None and skipping is None and len(out) > 1:  # (a place a rule of it was called)
                    if group in groups:
                        skipping = group
                    groups.add(group)
            # (the frames walked are steps too: 1,990 rules nested without recursion took 3.8 s in 24,000 steps)
            self.compiled.spend(walked)
            found = self._stacks[stack] = tuple(out)
        return found


def most_parses(grammar: Grammar, budget: int, limit: int = MAX_PARSES, seconds: float | None = None) -> Parses:
    """The most stacks llama.cpp keeps for ``grammar`` after any text: a search from the root through every set
    of stacks a character leads to (each set once, as :class:`_Known` tells them apart; the characters that keep
    the most stacks first), to the first set past ``limit`` or every set, within ``budget`` stack expansions and
    ``seconds`` of this thread's CPU time (``complete`` False when either ran out: an unfinished search is no
    verdict)."""
    compiled = _Compiled(grammar, budget, seconds)
    texts: list[tuple[str, int]] = [("", 0)]  # (a character, the text it follows) by number; 0: the empty text

    def text(number: int) -> str:
        out: list[str] = []
        while number:
            character, number = texts[number]
            out.append(character)
        return "".join(reversed(out))

    most = (0, 0)
    try:
        known = _Known(compiled)
        first = compiled.start(grammar.root)
        known.add(first)
        most = (len(first), 0)
        todo: list[tuple[dict[int, None], int]] = [(first, 0)]
        while todo and most[0] <= limit:
            stacks, before = todo.pop()
            found: list[tuple[int, int, dict[int, None]]] = []
            for code_point, after in compiled.children(stacks):
                if any(after) and known.add(after):  # (a set of the empty stack alone: the grammar is complete)
                    texts.append((chr(code_point), before))
                    found.append((len(after), len(texts) - 1, after))
                    most = max(most, (len(after), len(texts) - 1))
            found.sort(key=lambda f: f[0])  # (the most stacks searched on first)
            todo.extend((after, number) for _, number, after in found)
    except _Exhausted:
        return Parses(most[0], text(most[1]), grammar.root, False, budget)
    return Parses(most[0], text(most[1]), grammar.root, True, budget - compiled.budget)


class Unfollowed(Exception):
    """The check ran out of its steps before it ended: no verdict."""


def nesting_problem(grammar: Grammar, budget: int = NESTING_BUDGET) -> str | None:
    """What makes llama.cpp's stacks multiply with the depth a recursion nests to, or None; found from the grammar
    alone, since no search of sets of stacks tells a recursion's levels apart (:class:`_Known` takes its deeper
    copies as alike). llama.cpp keeps a frame at every level for what follows the reference in (its rest), and once
    the innermost ends the levels' rests follow each other:

    - a cycle of references each in last place (no frame) or with a rest that may match nothing, one at least the
      latter (``r ::= "(" r s | "x"``, ``s ::= "a" | ""``): every level's rest may come next at once, 101 stacks
      after 100 "(";
    - a cycle whose rest may, once it could end, go on with a character the next level's rest may begin with
      (``r ::= "a" r p | "b"``, ``p ::= "a" | "aa" | ... (8 a's)``: where one level's rest ends and the next's
      begins is any of several places, 3,094 stacks after 300 a's, a b and 100 a's, 6.8 s a token with a 128k
      vocabulary, sweep 27). JSON's ``]`` and ws, C's ``)``, end where the next begins.

    Among the references reachable from the root; a rest's characters are over-counted where alternatives begin
    alike (any character either may hold), never under. Unfollowed past ``budget`` steps: no verdict."""
    flat = flatten(grammar)
    lengths = least_costs(grammar, 0, flat)
    empty = {id(expr): value == 0 for expr, value in zip(flat.exprs, lengths.values, strict=True)}

    def elements(expr: Expr) -> list[Expr]:  # (as llama.cpp's rule for it holds them: groups are rules of their own)
        if isinstance(expr, Seq):
            return [element for item in expr.items for element in elements(item)]
        if (isinstance(expr, Lit) and not expr.text) or (isinstance(expr, Repeat) and expr.hi == 0):
            return []
        return [expr]

    def key(expr: Expr) -> str | int | None:
        return expr.name if isinstance(expr, Ref) else id(expr) if isinstance(expr, Alt | Repeat) else None

    edges: dict[str | int, list[str | int]] = {}  # (the references after which nothing must match)
    every: dict[str | int, list[str | int]] = {}  # (every reference)
    growing: list[tuple[str | int, str | int]] = []
    rests: list[tuple[str | int, str | int, Expr]] = []  # (a reference not in last place, and what follows it)
    owner: dict[str | int, str] = {}
    todo: list[tuple[str | int, Expr, str]] = [(grammar.root, grammar.rules[grammar.root], grammar.root)]
    while todo:
        node, body, name = todo.pop()
        if node in every:
            continue
        edges[node], every[node], owner[node] = [], [], name
        chain: list[Expr] = []
        if isinstance(body, Repeat):  # (S{m,n}: copies of S, each followed by the rest of the chain or nothing)
            lo, hi = body.lo, body.hi
            more = hi is None or hi - lo >= 2 or (lo >= 1 and hi > lo) or (lo >= 2 and empty[id(body.item)])
            options, after = [elements(body.item)], more
            chain = [Repeat(body.item, 0, None)] if more else []
        else:
            options = [elements(option) for option in (body.options if isinstance(body, Alt) else (body,))]
            after = False
        for items in options:
            for index, item in enumerate(items):
                target = key(item)
                if target is None:
                    continue
                if isinstance(item, Ref):
                    if item.name not in grammar.rules:
                        continue
                    todo.append((item.name, grammar.rules[item.name], item.name))
                else:
                    todo.append((target, item, name))
                every[node].append(target)
                rest = items[index + 1:]
                if rest or after:
                    rests.append((node, target, Seq((*rest, *chain))))
                if not all(empty[id(r)] for r in rest):
                    continue  # (what must match comes after it: a chain of levels ends here)
                edges[node].append(target)
                if rest or after:
                    growing.append((node, target))
    component = strong_components(edges)
    for node, target in growing:
        if component[node] == component[target]:
            rule = owner.get(target, str(target))
            return (f"a recursion through rule '{owner[node]}' whose every level may leave a part that matches "
                    f"nothing after rule '{rule}': each level the text nests keeps one more way at once, without "
                    f"bound (more than {MAX_PARSES} after {MAX_PARSES} levels)")
    cycles = strong_components(every)
    if not any(cycles[node] == cycles[target] for node, target, _ in rests):
        return None  # (no recursion leaves anything after its reference)
    begins: dict[int, charset.Ranges] = {}  # (what a level's rest may begin with, by recursion)
    ending: list[tuple[str | int, str | int, charset.Ranges]] = []
    try:
        sets = _CharacterSets(grammar, empty, budget)
        for node, target, after_it in rests:
            if cycles[node] != cycles[target]:
                continue
            null, first, going_on, _ = sets.of(after_it)
            begins[cycles[node]] = charset.normalize((*begins.get(cycles[node], ()), *first))
            if not null:
                ending.append((node, target, going_on))
    except _Exhausted:
        raise Unfollowed from None
    for node, target, going_on in ending:
        if _meet(going_on, begins[cycles[node]]):
            return (f"a recursion through rule '{owner[node]}' whose levels' parts after rule "
                    f"'{owner.get(target, str(target))}' may each end where the next one's may begin: as it returns, "
                    f"a text splits between the levels in more ways the deeper it nested, without bound")
    return None


def _meet(a: charset.Ranges, b: charset.Ranges) -> bool:
    """Whether two normalized sets of characters share one."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


def _callees_first(edges: dict[str, list[str]]) -> list[list[str]]:
    """The groups of rules that refer to each other (strongly connected), each after every group it refers to."""
    component = strong_components(edges)
    members: dict[int, list[str]] = {}
    for name, group in component.items():
        members.setdefault(group, []).append(name)
    after: dict[int, set[int]] = {group: set() for group in members}  # (the groups each refers to)
    for name, refs in edges.items():
        after[component[name]].update(component[ref] for ref in refs if component[ref] != component[name])
    order: list[list[str]] = []
    done: set[int] = set()
    for start in members:
        if start in done:
            continue
        work = [(start, iter(after[start]))]
        done.add(start)
        while work:
            group, pending = work[-1]
            nxt = next(pending, None)
            if nxt is None:
                work.pop()
                order.append(members[group])
            elif nxt not in done:
                done.add(nxt)
                work.append((nxt, iter(after[nxt])))
    return order


def _shared(sets: list[charset.Ranges]) -> charset.Ranges:
    """The characters two or more of ``sets`` (each normalized) hold."""
    edges = sorted([(lo, 1) for ranges in sets for lo, _ in ranges]
                   + [(hi + 1, -1) for ranges in sets for _, hi in ranges])
    out: list[tuple[int, int]] = []
    count, since = 0, 0
    for at, step in edges:
        if count >= 2 and at > since:
            out.append((since, at - 1))
        count += step
        since = at
    return charset.normalize(out)


def _next_after_prefixes(texts: list[str]) -> list[tuple[int, int]]:
    """The characters that follow, in one of ``texts`` (sorted, distinct), another that it begins with: those
    beginning with ``u`` follow it in order, and each next character is found once (by a jump past it)."""
    out: list[tuple[int, int]] = []
    for i, u in enumerate(texts):
        at = i + 1
        while at < len(texts) and texts[at].startswith(u):
            c = texts[at][len(u)]
            out.append((ord(c), ord(c)))
            at = bisect_left(texts, u + chr(ord(c) + 1), at) if ord(c) < charset.MAX_CODE_POINT else len(texts)
    return out


class _CharacterSets:
    """For an expression: whether it may match nothing, the characters it may begin with, those that may follow
    where it could already end (its match going on: ``"a" | "aa"`` after "a"), and every character it may hold.
    Named rules by a fixpoint over the grammar (each set only grows); alternatives that begin alike (or one that may
    match nothing) may go on with any character of another: counted so, more than exactly."""

    def __init__(self, grammar: Grammar, empty: dict[int, bool], budget: int) -> None:
        self.grammar = grammar
        self.empty = empty
        self.budget = budget  # (expressions evaluated: _Exhausted past it)
        none: charset.Ranges = ()
        self.rules: dict[str, tuple[charset.Ranges, charset.Ranges, charset.Ranges]] = {
            name: (none, none, none) for name in grammar.rules}
        # the rules a rule refers to first, each group of rules that refer to each other to its fixpoint, a rule
        # evaluated again only when one it refers to changed (rule by rule in the file's order, a chain of 1,900
        # rules each ending in the next took 1,900 rounds: 116 s)
        edges = {name: [ref.name for ref in refs_in(body) if ref.name in grammar.rules]
                 for name, body in grammar.rules.items()}
        callers: dict[str, list[str]] = {}
        for name, refs in edges.items():
            for ref in refs:
                callers.setdefault(ref, []).append(name)
        for group in _callees_first(edges):
            members = set(group)
            todo = dict.fromkeys(group)
            while todo:
                name = next(iter(todo))
                del todo[name]
                _, first, going_on, held = self.of(grammar.rules[name])
                if (first, going_on, held) != self.rules[name]:
                    self.rules[name] = (first, going_on, held)
                    todo.update(dict.fromkeys(c for c in callers.get(name, ()) if c in members))

    def of(self, expr: Expr) -> tuple[bool, charset.Ranges, charset.Ranges, charset.Ranges]:
        """(may match nothing, begins with, goes on with, holds): each costs a step and a step a range it holds
        (one step sorted ~100,000 ranges: a 1 KB grammar held the event loop 4 s, sweep 28)."""
        found = self._of(expr)
        self.budget -= 1 + len(found[1]) + len(found[2]) + len(found[3])
        if self.budget < 0:
            raise _Exhausted
        return found

    def _of(self, expr: Expr) -> tuple[bool, charset.Ranges, charset.Ranges, charset.Ranges]:
        none: charset.Ranges = ()
        if isinstance(expr, Lit):
            if not expr.text:
                return True, none, none, none
            held = charset.normalize((ord(c), ord(c)) for c in expr.text)
            return False, ((ord(expr.text[0]), ord(expr.text[0])),), none, held
        if isinstance(expr, CharClass):
            members = expr.members()
            return False, members, none, members
        if isinstance(expr, Ref):
            if expr.name not in self.rules:
                return False, none, none, none
            first, going_on, held = self.rules[expr.name]
            return self.empty[id(self.grammar.rules[expr.name])], first, going_on, held
        if isinstance(expr, Seq):
            parts = [self.of(item) for item in expr.items]
            null = all(p[0] for p in parts)
            first_: list[tuple[int, int]] = []
            for p in parts:
                first_.extend(p[1])
                if not p[0]:
                    break
            last = max((i for i, p in enumerate(parts) if not p[0]), default=-1)  # (what must match, last)
            going: list[tuple[int, int]] = []
            for i in range(max(last, 0), len(parts)):
                going.extend(parts[i][2])
                if i > last or (i == last and i + 1 < len(parts)):
                    for p in parts[i + 1:]:
                        going.extend(p[1])
            if last < 0:
                for p in parts:
                    going.extend(p[1])
            return (null, charset.normalize(first_), charset.normalize(going),
                    charset.normalize(r for p in parts for r in p[3]))
        if isinstance(expr, Alt):
            parts = [self.of(option) for option in expr.options]
            going = [r for p in parts for r in p[2]]
            if all(isinstance(o, Lit) for o in expr.options):  # (exact: one a beginning of another)
                going.extend(_next_after_prefixes(sorted({o.text for o in expr.options if isinstance(o, Lit)})))
            else:  # (an option that another may begin as, or follow when that one matches nothing: all it holds)
                empties = sum(p[0] for p in parts)
                shared = _shared([p[1] for p in parts])
                for part in parts:
                    if empties - part[0] > 0 or _meet(part[1], shared):
                        going.extend(part[3])
            return (any(p[0] for p in parts), charset.normalize(r for p in parts for r in p[1]),
                    charset.normalize(going), charset.normalize(r for p in parts for r in p[3]))
        assert isinstance(expr, Repeat)
        if expr.hi == 0:
            return True, none, none, none
        null, first, going_on, held = self.of(expr.item)
        more = expr.hi is None or expr.hi > max(expr.lo, 1) or (expr.hi > expr.lo)
        return (expr.lo == 0 or null, first, charset.normalize((*going_on, *(first if more else ()))), held)


def parses_problem(found: Parses) -> str | None:
    """What makes llama.cpp's parse of the grammar the search was over go too many ways at once, or None."""
    if found.count <= MAX_PARSES:
        return None
    where = f", in rule '{found.rule}'" if found.rule not in ("root", "regex") else ""
    text = found.text if len(found.text) <= 40 else "..." + found.text[-37:]  # (where it fans out: the end)
    after = f"after {text!r}{where}" if found.text else f"at the start{where}"
    return f"a parse that may go {found.count} ways at once ({after}), more than {MAX_PARSES}"
