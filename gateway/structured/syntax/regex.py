"""Regular-expression constraints: parsing, the nesting scan, validation and the grammar model of a pattern.

Supported subset (Python ``re`` syntax): literals and escapes, ``.``, character classes with
ranges, negation and ``\\d \\w \\s \\D \\W \\S``, capturing / non-capturing / named groups,
alternation, greedy and lazy quantifiers ``* + ? {m} {m,} {m,n}``, inline flags, and the anchors
``^ $ \\A \\Z`` (which only make sense at the ends).  What constrained decoders cannot enforce,
because they match with automata (xgrammar, llguidance, outlines), raises ConstraintError
(:func:`automaton_problem` names it): backreferences, conditionals, lookarounds, word boundaries,
atomic groups and possessive quantifiers (``a++`` means Python's no-backtracking match; an automaton
would silently read it as ``a+``).  So does a pattern that matches nothing.

Validation is bounded: groups nested deeper than ``max_nesting`` raise ConstraintTooDeep after a
linear scan, before Python's recursive regex parser runs; the pattern is parsed but not compiled
(compiling a wide character range costs milliseconds per range, e.g. ``[\\x00-\\U0010ffff]``, and
compilation finds no error the parser has not already reported for the supported subset).
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache
from typing import Any

from . import charset
from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooDeep
from .grammar_ast import ANY_CHAR, CharClass, Expr, Grammar, Lit, Repeat, alt, seq
from .grammar_check import CostTable
from .least_cost import INFINITE
from .parses import Parses, most_parses

_parser: Any = importlib.import_module("re._parser")
_constants: Any = importlib.import_module("re._constants")

_DIGIT: charset.Ranges = ((0x30, 0x39),)
_WORD: charset.Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE: charset.Ranges = ((0x09, 0x0D), (0x20, 0x20))
_NON_ASCII: charset.Ranges = ((0x80, charset.MAX_CODE_POINT),)
_NO_NEWLINE: charset.Ranges = ((0x0A, 0x0A),)
_GROUPING = re.compile(r"[\\\[()]")  # what the nesting scan stops at
_CLASS_REST = re.compile(r"\^?\]?(?:\\.|[^\]\\])*\]?", re.DOTALL)  # a class's body after its '['
_NOT_REGULAR = {  # parse-tree nodes no automaton can enforce
    "ASSERT": "lookahead and lookbehind assertions (?=...) (?!...) (?<=...) (?<!...)",
    "ASSERT_NOT": "lookahead and lookbehind assertions (?=...) (?!...) (?<=...) (?<!...)",
    "GROUPREF": "backreferences",
    "GROUPREF_EXISTS": "backreference conditionals (?(1)...)",
    "ATOMIC_GROUP": "atomic groups (?>...)",
    "POSSESSIVE_REPEAT": "possessive quantifiers (*+ ++ ?+ {m,n}+)",
}
_BOUNDARY = "word boundaries \\b \\B"


def regex_nesting(pattern: str, limit: int) -> int | None:
    """Where ``pattern``'s groups first nest deeper than ``limit`` (an offset), or None: a linear scan
    that skips escapes and character classes, safe on any input (Python's own parser recurses per
    group and overflows the interpreter's stack on a few hundred)."""
    depth = 0
    pos = 0
    while (found := _GROUPING.search(pattern, pos)) is not None:
        at = found.start()
        char = found.group()
        if char == "\\":
            pos = at + 2
        elif char == "[":
            rest = _CLASS_REST.match(pattern, at + 1)
            pos = rest.end() if rest is not None else at + 1
        elif char == "(":
            depth += 1
            if depth > limit:
                return at
            pos = at + 1
        else:
            depth = max(0, depth - 1)
            pos = at + 1
    return None


def parse_regex(pattern: str, flags: int = 0, max_nesting: int = DEFAULT_MAX_NESTING) -> Any:
    """Python's parse tree of ``pattern``; ConstraintTooDeep or ConstraintError when it has none."""
    deep = regex_nesting(pattern, max_nesting)
    if deep is not None:
        raise ConstraintTooDeep(f"regex groups nested deeper than {max_nesting} levels (at offset {deep})")
    try:
        return _parser.parse(pattern, flags)
    except re.error as exc:
        raise ConstraintError(f"invalid regex {pattern!r}: {exc}") from exc
    except RecursionError:  # the scan bounds groups; this is a last line, not a path
        raise ConstraintTooDeep(f"regex nested too deeply to parse (limit {max_nesting})") from None


def automaton_problem(tree: Any) -> str | None:
    """What, in a parsed pattern (see :func:`parse_regex`), no automaton-based engine can enforce; None when
    nothing. Walks the tree with an explicit stack."""
    todo = [tree]
    while todo:
        for op, av in todo.pop():
            kind = str(op)
            if kind in _NOT_REGULAR:
                return _NOT_REGULAR[kind]
            if kind == "AT" and "BOUNDARY" in str(av):
                return _BOUNDARY
            if kind == "SUBPATTERN":
                todo.append(av[3])
            elif kind == "BRANCH":
                todo.extend(av[1])
            elif kind in ("MAX_REPEAT", "MIN_REPEAT"):
                todo.append(av[2])
    return None


# What an engine's automaton may unroll from one pattern: its counted repetitions multiplied out. xgrammar,
# outlines and llguidance build states per unrolled position; ((a{999}){999}){999} (21 bytes, 10^9 positions)
# wedged every emulated engine at 100% CPU, deaf to /health and SIGTERM. llama.cpp bounds its own grammars the
# same way (2,000 generated rules); real patterns (.{0,5000}, (\w{1,100} ){1,500}) stay far below.
MAX_REGEX_POSITIONS = 100_000


def unrolled_positions(tree: Any, cap: int = MAX_REGEX_POSITIONS) -> int:
    """How many character positions a parsed pattern (see :func:`parse_regex`) has with its counted
    repetitions unrolled (an unbounded one once past its minimum), stopping once past ``cap``. Recursion is
    bounded by the pattern's group nesting, which parse_regex has already bounded."""
    total = 0
    for op, av in tree:
        kind = str(op)
        if kind == "SUBPATTERN":
            size = unrolled_positions(av[3], cap)
        elif kind == "BRANCH":
            size = sum(unrolled_positions(branch, cap) for branch in av[1])
        elif kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            copies = lo + 1 if hi == _constants.MAXREPEAT else max(hi, 1)
            size = unrolled_positions(sub, cap) * copies
        elif kind in ("ASSERT", "ASSERT_NOT"):
            size = unrolled_positions(av[1], cap)
        else:
            size = 1
        total += size
        if total > cap:
            return total
    return total


# The most ways a run of text may split between a pattern's parts of varying length (see _states): each a
# parse llama.cpp's grammar keeps and checks every candidate token against, at every token. ``(a{0,300}){0,300}``
# (90,000, under MAX_REGEX_POSITIONS) froze llama-server for minutes, every slot with it (sweep 22); so did
# ``([ab]?){0,100}``, ``[ab]{0,30}`` a hundred times over, and nests of small counts at 512 ways; 125 ways cost a
# request 20 times a plain pattern's (sweep 23). ``(\d{1,3}\.){3}`` has none: a character ends each copy.
MAX_NESTED_STATES = 100


_CAP = 1 << 40


def _states(tree: Any) -> tuple[int, bool, int, bool]:
    """The places a text may be at once in the pattern's repetitions, whether its length varies, the most places
    of any part where a run of text may split in several ways (what MAX_NESTED_STATES bounds), and whether it may
    match nothing. A repetition of varying count has its copies; one of what varies in length, its copies times
    the places inside that ((places + 1) to the copies where each copy may be empty: ``([ab]?){0,100}``); items
    of varying length side by side, the sum of their places (``[ab]{0,30}`` a hundred times over)."""
    total, varies, nest, nullable, varying_items = 0, False, 0, True, 0
    for op, av in tree:
        kind = str(op)
        if kind == "SUBPATTERN":
            states, inner, deep, empty = _states(av[3])
        elif kind == "BRANCH":
            found = [_states(branch) for branch in av[1]]
            # (alternatives of one fixed length, none varying, are a fixed-length item: (ab|cd); of several lengths,
            # a text may be at as many places in them: 25 of (a|aa|...|20 a's) side by side held 4,384 stacks in
            # llama.cpp, counted 25, sweep 26)
            lengths = len({unrolled_positions(b) for b in av[1]})
            inner = any(f[1] for f in found) or lengths > 1
            states, deep = max(max(f[0] for f in found), lengths), max(f[2] for f in found)
            empty = any(f[3] for f in found)
        elif kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, hi, sub = av
            copies = lo + 1 if hi == _constants.MAXREPEAT else max(hi, 1)
            below, inner, deep, body_empty = _states(sub)
            if inner and body_empty and copies > 1:  # (each copy empty or at any of its places)
                states = _CAP if copies * (below + 1).bit_length() > 41 else min((below + 1) ** copies, _CAP)
                deep = max(deep, states)
            elif inner and not _delimited(sub):
                states = min(copies * below, _CAP)
                deep = max(deep, states)
            else:
                states = copies if hi != lo else 1
            inner = inner or hi != lo
            empty = lo == 0 or body_empty
        elif kind in ("ASSERT", "ASSERT_NOT"):
            states, inner, deep, empty = 1, False, _states(av[1])[2], True
        elif kind == "AT":
            states, inner, deep, empty = 1, False, 0, True
        else:
            states, inner, deep, empty = 1, False, 0, False
        if inner:
            total = min(total + states, _CAP)
            varying_items += 1
        varies, nest, nullable = varies or inner, max(nest, deep), nullable and empty
    if varying_items > 1:
        nest = max(nest, total)
    return max(total, 1), varies, nest, nullable


def _one_char(node: tuple[Any, Any]) -> charset.Ranges | None:
    """The characters a node of one character matches (its own flags aside), or None if it is not one."""
    op, av = node
    kind = str(op)
    if kind == "LITERAL":
        return ((av, av),)
    if kind == "NOT_LITERAL":
        return charset.members(((av, av),), True)
    if kind == "ANY":
        return charset.members(_NO_NEWLINE, True)
    if kind == "IN":
        try:
            found = _class(list(av), 0)
        except ConstraintError:
            return None
        assert isinstance(found, CharClass)
        return found.members()
    return None


def _varying_char(node: tuple[Any, Any]) -> charset.Ranges | None:
    """The characters of a repetition of one character whose count varies, or None if the node is not one."""
    op, av = node
    if str(op) not in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") or av[0] == av[1] or len(av[2]) != 1:
        return None
    return _one_char(av[2][0])


def _delimited(body: Any) -> bool:
    """Whether what a repetition repeats begins or ends with a character its neighbouring repetition cannot
    match (``(\\w{1,100} )``, ``(-[a-z]+)``): where one copy ends and the next begins is then never in doubt."""
    items = list(body)
    while len(items) == 1 and str(items[0][0]) == "SUBPATTERN":
        items = list(items[0][1][3])
    if len(items) < 2:
        return False
    for edge, neighbour in ((items[0], items[1]), (items[-1], items[-2])):
        fixed, varying = _one_char(edge), _varying_char(neighbour)
        if fixed is not None and varying is not None and not _overlap(fixed, varying):
            return True
    return False


def _overlap(a: charset.Ranges, b: charset.Ranges) -> bool:
    return any(lo <= other_hi and other_lo <= hi for lo, hi in a for other_lo, other_hi in b)


def expansion_problem(tree: Any) -> str | None:
    """Why no engine could build an automaton for a parsed pattern, or None: its repetitions unroll past
    MAX_REGEX_POSITIONS, or nest past MAX_NESTED_STATES."""
    if unrolled_positions(tree) > MAX_REGEX_POSITIONS:
        return (f"counted repetitions that unroll to more than {MAX_REGEX_POSITIONS:,} positions (an engine "
                "builds its automaton from them)")
    if _states(tree)[2] > MAX_NESTED_STATES:
        return (f"parts of varying length (nested, optional under a count, or side by side) that a run of text may "
                f"split between in more than {MAX_NESTED_STATES:,} ways (an engine's grammar follows each, at every "
                "token)")
    return None


def llama_parses(tree: Any, budget: int) -> Parses | None:
    """The search of :func:`~gateway.structured.syntax.parses.most_parses` over a parsed pattern, as llama.cpp
    compiles a schema's ``pattern`` into its grammar; None for a pattern outside the subset converted here."""
    try:
        expr = _convert(tree, int(tree.state.flags))
    except ConstraintError:
        return None
    return most_parses(Grammar({"regex": expr}, "regex", "regex"), budget)


def _category(name: str, in_negated_class: bool) -> charset.Ranges:
    """Ranges for a category escape.  Python's classes are Unicode-aware, so in a positive
    class take an ASCII subset and in a negated class exclude a superset: either way every
    generated character really is (or is not) in the category."""
    base = {"DIGIT": _DIGIT, "WORD": _WORD, "SPACE": _SPACE}
    key = name.removeprefix("CATEGORY_NOT_").removeprefix("CATEGORY_")
    if key not in base:
        raise ConstraintError(f"unsupported regex category {name}")
    ranges = base[key]
    if not name.startswith("CATEGORY_NOT_"):
        return charset.normalize(ranges + _NON_ASCII) if in_negated_class else ranges
    outside = charset.complement(ranges)
    if in_negated_class:
        return outside
    return tuple((lo, min(hi, 0x7F)) for lo, hi in outside if lo <= 0x7F)


def _case_variants(ranges: charset.Ranges) -> charset.Ranges:
    extra: list[tuple[int, int]] = []
    for lo, hi in ranges:
        for cp in range(max(lo, 0x41), min(hi, 0x7A) + 1):
            ch = chr(cp)
            if ch.isalpha():
                other = ord(ch.swapcase())
                extra.append((other, other))
    return charset.normalize(ranges + tuple(extra))


def _class(items: list[tuple[Any, Any]], flags: int) -> Expr:
    negated = bool(items) and str(items[0][0]) == "NEGATE"
    body = items[1:] if negated else items
    ranges: list[tuple[int, int]] = []
    for op, av in body:
        kind = str(op)
        if kind == "LITERAL":
            ranges.append((av, av))
        elif kind == "RANGE":
            ranges.append((av[0], av[1]))
        elif kind == "CATEGORY":
            ranges.extend(_category(str(av), negated))
        else:
            raise ConstraintError(f"unsupported regex class item {kind}")
    norm = charset.normalize(ranges)
    if negated and flags & re.IGNORECASE:
        norm = _case_variants(norm)
    return CharClass(norm, negated)


def _convert(nodes: Any, flags: int) -> Expr:
    items: list[Expr] = []
    for op, av in nodes:
        kind = str(op)
        if kind == "LITERAL":
            items.append(Lit(chr(av)))
        elif kind == "NOT_LITERAL":
            excluded = charset.normalize([(av, av)])
            if flags & re.IGNORECASE:
                excluded = _case_variants(excluded)
            items.append(CharClass(excluded, negated=True))
        elif kind == "ANY":
            items.append(CharClass(_NO_NEWLINE, negated=True) if not flags & re.DOTALL else ANY_CHAR)
        elif kind == "IN":
            items.append(_class(list(av), flags))
        elif kind == "BRANCH":
            items.append(alt([_convert(branch, flags) for branch in av[1]]))
        elif kind == "SUBPATTERN":
            _group, add_flags, del_flags, sub = av
            items.append(_convert(sub, (flags | add_flags) & ~del_flags))
        elif kind in ("MAX_REPEAT", "MIN_REPEAT"):
            lo, hi, sub = av
            upper = None if hi == _constants.MAXREPEAT else int(hi)
            items.append(Repeat(_convert(sub, flags), int(lo), upper))
        elif kind == "AT":
            where = str(av)
            if "BOUNDARY" in where:
                raise ConstraintError(f"regex {_BOUNDARY} are not supported (engines match with automata)")
            if where not in ("AT_BEGINNING", "AT_BEGINNING_STRING", "AT_END", "AT_END_STRING"):
                raise ConstraintError(f"unsupported regex anchor {where}")
            items.append(Lit(""))
        elif kind in _NOT_REGULAR:
            raise ConstraintError(f"regex {_NOT_REGULAR[kind]} are not supported (engines match with automata)")
        else:
            raise ConstraintError(f"unsupported regex construct {kind}")
    return seq(items) if items else Lit("")


@lru_cache(maxsize=256)
def compiled_regex(pattern: str, flags: int, max_nesting: int) -> tuple[Expr, CostTable]:
    """``pattern`` as a grammar expression, with its cost table (what a sampler walks); memoised."""
    if not isinstance(pattern, str):
        raise ConstraintError(f"regex must be a string, got {type(pattern).__name__}")
    parsed = parse_regex(pattern, flags, max_nesting)
    problem = expansion_problem(parsed)
    if problem:
        raise ConstraintError(f"regex {pattern[:80]!r} has {problem}")
    expr = _convert(parsed, int(parsed.state.flags))
    table = CostTable(Grammar({"regex": expr}, "regex", "regex"))
    if table.rule_cost["regex"] >= INFINITE:
        raise ConstraintError(f"regex {pattern!r} matches nothing")
    return expr, table


def forget_regexes() -> None:
    compiled_regex.cache_clear()


def regex_to_expr(pattern: str, flags: int = 0, max_nesting: int = DEFAULT_MAX_NESTING) -> Expr:
    """The grammar expression for ``pattern`` (used for Lark and EBNF ``Regex`` terminals)."""
    return compiled_regex(pattern, flags, max_nesting)[0]


def validate_regex(pattern: str, max_nesting: int = DEFAULT_MAX_NESTING) -> None:
    """Raise ConstraintError if ``pattern`` is invalid or outside the supported subset."""
    compiled_regex(pattern, 0, max_nesting)
