"""What llama.cpp refuses in a GBNF grammar beyond its syntax (llama-grammar.cpp of llama-cpp-python 0.3.36).

llama.cpp compiles every group and every repetition into rules of its own: ``(A | B)`` becomes a rule,
``S{m,n}`` becomes m copies of S followed by a chain of n - m optional rules, ``S*`` the rule
``S' ::= S S' |``. It numbers every rule name and every generated rule in the order it meets them. Then:

* a repetition count past MAX_REPETITION_THRESHOLD (2000) is refused as a lower bound, or when multiplied
  by the number of rules the repeated element generated; as an upper bound it silently means "unbounded";
* a repetition operator after an element that compiled to nothing (``""*``, ``"a"{0}*``) is refused;
* an undefined rule is refused if a surviving rule refers to it, or if its number is below that of the
  last rule defined (a rule defined twice keeps its last definition, and the rules its first one generated
  stay, so a name used only in a replaced definition is still refused when anything is defined after it);
* left recursion is refused: a cycle of rules, each reaching the next before any character, where a rule
  can be passed over only if one of its alternatives compiled to no element at all. So ``x*`` with
  ``x ::= "a" | ""`` and ``("")*`` are left recursive (the repetition rule reaches itself), and
  ``("a"?)*`` is not (the group's one alternative is a reference).

A :class:`LlamaRules` follows the parser and keeps, per compiled rule, only what those checks read: each
alternative's leading references (up to the first element that is not a reference) and all its references.
Linear: copies of an element add no new references, and a bounded repetition's chain of optional rules is
one node (its rules reach each other only in one direction, so no cycle passes through the chain's inside).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConstraintError
from .left_recursion import first_cycle

MAX_REPETITION_THRESHOLD = 2000
MAX_COUNT = (1 << 64) - 1  # llama.cpp reads counts with std::stoull: anything larger is an error


@dataclass(frozen=True)
class Element:
    """What one element of a sequence compiles to: its leading references (distinct, in order), whether an
    element that is not a reference follows them, all its references, and how many rules it generated."""

    leading: tuple[int, ...] = ()
    closed: bool = False
    refs: tuple[int, ...] = ()
    generated: int = 1

    @property
    def nothing(self) -> bool:
        return not self.leading and not self.closed


NOTHING = Element()
CHARACTER = Element(closed=True)


def _then(first: Element, second: Element) -> Element:
    if first.closed or second.nothing:
        return Element(first.leading, first.closed, tuple(dict.fromkeys(first.refs + second.refs)))
    leading = tuple(dict.fromkeys(first.leading + second.leading))
    return Element(leading, second.closed, tuple(dict.fromkeys(first.refs + second.refs)))


@dataclass
class _Rule:
    leads: list[tuple[int, ...]] = field(default_factory=list)
    may_be_empty: bool = False
    refs: set[int] = field(default_factory=set)


class Alternative:
    """One alternative being parsed. The elements before the last one are kept in growing lists (a long
    sequence of references stays linear); the last one apart, because a repetition operator rewrites it."""

    def __init__(self, rules: LlamaRules) -> None:
        self._rules = rules
        self._leading: list[int] = []
        self._seen: set[int] = set()
        self._closed = False
        self._refs: set[int] = set()
        self._last = NOTHING

    def add(self, element: Element) -> None:
        self._settle()
        self._last = element

    def _settle(self) -> None:
        last = self._last
        if not self._closed:
            for ref in last.leading:
                if ref not in self._seen:
                    self._seen.add(ref)
                    self._leading.append(ref)
            self._closed = last.closed
        self._refs.update(last.refs)
        self._last = NOTHING

    def repeat(self, lo: int, hi: int | None, where: str) -> int | None:
        """Apply ``{lo,hi}`` (hi None: unbounded) to the last element as llama.cpp does; return the upper bound
        llama.cpp really uses. Raises ConstraintError (without a position) where llama.cpp refuses."""
        last = self._last
        if last.nothing:
            raise ConstraintError("a repetition operator after an element that matches nothing at all "
                                  "(llama.cpp: 'expecting preceding item')")
        if lo > MAX_REPETITION_THRESHOLD:
            raise ConstraintError(f"repetition count {lo} is past llama.cpp's limit of {MAX_REPETITION_THRESHOLD} "
                                  "(MAX_REPETITION_THRESHOLD)")
        if hi is not None and hi > MAX_REPETITION_THRESHOLD:
            hi = None  # llama.cpp's own reading of a large upper bound
        total = hi if hi else (lo or 1)
        if last.generated * total > MAX_REPETITION_THRESHOLD:
            raise ConstraintError(
                f"the repeated element generates {last.generated} rules, times {total} repetitions is past "
                f"llama.cpp's limit of {MAX_REPETITION_THRESHOLD} (MAX_REPETITION_THRESHOLD)")
        optional = 1 if hi is None else hi - lo
        kept = last if lo else NOTHING
        if optional:
            chain = self._rules.generate(optional, f"the repetition {where}", repetition=True)
            body = _then(last, Element((chain,), False, (chain,))) if hi is None else last
            self._rules.define(chain, [body, NOTHING])  # S' ::= S S' |  (a bounded chain: S |)
            kept = _then(kept, Element((chain,), False, (chain,)))
        self._last = Element(kept.leading, kept.closed, kept.refs, last.generated * total)
        return hi

    def done(self) -> Element:
        self._settle()
        return Element(tuple(self._leading), self._closed, tuple(self._refs))


class LlamaRules:
    """llama.cpp's rule numbering and the rules it compiles, for the checks in this module's docstring."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._first_use: dict[int, tuple[int, int]] = {}
        self._labels: dict[int, str] = {}
        self._rules: dict[int, _Rule] = {}
        self._repetitions: set[int] = set()
        self._next = 0

    def symbol(self, name: str, line: int, col: int) -> int:
        """The number of rule ``name`` (given at its first mention, definition or reference)."""
        found = self._ids.get(name)
        if found is None:
            found = self._ids[name] = self._next
            self._first_use[found] = (line, col)
            self._labels[found] = name
            self._next += 1
        return found

    def reference(self, name: str, line: int, col: int) -> Element:
        ref = self.symbol(name, line, col)
        return Element((ref,), False, (ref,))

    def generate(self, count: int, where: str, repetition: bool = False) -> int:
        """Number ``count`` generated rules; the last one's number (a bounded chain is that one node)."""
        self._next += count
        self._labels[self._next - 1] = where
        if repetition:
            self._repetitions.add(self._next - 1)
        return self._next - 1

    def open_group(self, where: str) -> tuple[int, int]:
        before = self._next
        return self.generate(1, where), before

    def close_group(self, group: int, before: int, alternatives: list[Element]) -> Element:
        self.define(group, alternatives)
        return Element((group,), False, (group,), max(1, self._next - before))

    def alternative(self) -> Alternative:
        return Alternative(self)

    def define(self, rule: int, alternatives: list[Element]) -> None:
        """(Re)define ``rule``: a later definition of a named rule replaces the earlier one."""
        refs: set[int] = set()
        for alternative in alternatives:
            refs.update(alternative.refs)
        self._rules[rule] = _Rule([a.leading for a in alternatives], any(a.nothing for a in alternatives), refs)

    def check(self) -> None:
        """Raise ConstraintError for an undefined rule or left recursion, as llama.cpp would."""
        size = max(self._rules, default=-1) + 1
        used: set[int] = set()
        for rule in self._rules.values():
            used.update(rule.refs)
        for name, number in self._ids.items():
            if number not in self._rules and (number < size or number in used):
                line, col = self._first_use[number]
                raise ConstraintError(f"gbnf grammar: undefined rule '{name}' (named at line {line}, column {col})")
        edges: dict[int, list[int]] = {}
        for number, rule in self._rules.items():
            nexts = edges[number] = []
            for leading in rule.leads:
                for ref in leading:
                    nexts.append(ref)
                    if not self._rules[ref].may_be_empty:
                        break
        cycle = first_cycle(edges)
        if cycle:
            chain = (f"{self._labels[cycle[0]]} reaches itself" if len(cycle) == 2 and cycle[0] in self._repetitions
                     else " -> ".join(self._labels[n] for n in cycle))
            hint = (" (llama.cpp writes x* as the rule x' ::= x x' |, so repeating an item with an empty "
                    "alternative is left recursive)") if self._repetitions.intersection(cycle) else ""
            raise ConstraintError(f"gbnf grammar: left recursion is not supported by llama.cpp: {chain}{hint}")
