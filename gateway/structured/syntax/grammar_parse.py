"""Recursive-descent parser for llama.cpp GBNF and xgrammar EBNF into the grammar model.

GBNF: ``name ::= body`` rules (names of letters, digits and ``-``), ``|``, ``( )``, ``* + ?``,
``{m} {m,} {m,n}``, ``"..."`` with escapes ``\\n \\r \\t \\\\ \\" \\[ \\] \\- \\xHH \\uHHHH
\\UHHHHHHHH``, classes ``[a-z]`` / ``[^...]``, ``.`` (any character), ``#`` comments.  A rule
ends at a newline unless inside parentheses or right after ``|``.  As in llama.cpp, a rule defined
twice keeps its last definition, an upper bound past 2000 means "unbounded", and what llama.cpp's
compiler refuses (repetition counts, repeating nothing, undefined rules, its left recursion) is refused
too (gbnf_llama.py).

EBNF (xgrammar): the same core, plus names with ``_`` and ``.``, rules spanning lines freely,
the extra escapes ``\\/ \\' \\? \\b \\f \\a \\v \\0 \\e``, ``\\x`` with any number of hex digits,
``[^]``, rule options ``name[capture, temperature=..., max_tokens=N] ::=`` (no effect on the
language) and the ``Regex("...")`` macro.  The ``lazy`` / ``max_chars`` options and the other
macros (``TagDispatch``, ``Substring``, ...) raise ConstraintError.  A rule
may end with a lookahead assertion ``(= ...)``, kept in ``Grammar.lookaheads``: xgrammar reads it as
the author's promise of what follows the rule and uses it to prune tokens that run past the rule's
end, so it restricts nothing when it is true.  Samplers ignore it; it has no GBNF spelling, so a
grammar with one is not converted to GBNF.

Bounded: parentheses (and stacked repetition operators) nested deeper than ``max_nesting`` raise
ConstraintTooDeep where they are met, before the parser recurses further; more than ``max_rules``
rules raise ConstraintTooLarge when the next one starts.
"""

from __future__ import annotations

import re

from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooLarge
from .gbnf_llama import CHARACTER, NOTHING, Element, LlamaRules
from .grammar_ast import ANY_CHAR, Expr, Grammar, Ref, Repeat, alt, seq
from .grammar_lex import Scanner, TextDialect
from .regex import regex_to_expr

_EBNF_OPTIONS = {"capture", "temperature", "max_tokens"}
_EBNF_UNSUPPORTED_OPTIONS = {"lazy", "max_chars"}
_REGEX_FLAGS = {"i": re.IGNORECASE, "s": re.DOTALL, "u": 0}
Alternatives = list[Element] | None  # GBNF: what llama.cpp compiles each alternative into


class _Parser(Scanner):
    def __init__(self, text: str, dialect: TextDialect, max_nesting: int, max_rules: int | None) -> None:
        super().__init__(text, dialect, max_nesting)
        self.max_rules = max_rules
        self.depth = 0  # parentheses around the current position
        self.llama = LlamaRules() if dialect == "gbnf" else None

    def at_rule_start(self) -> bool:
        """EBNF: is the text here ``name [options] ::=`` (the start of the next rule)?"""
        save = self.pos
        try:
            if not self.name_start(self.peek()):
                return False
            self.parse_name()
            self.skip(False)
            if self.peek() == "[":
                end = self.text.find("]", self.pos)
                if end < 0:
                    return False
                self.pos = end + 1
                self.skip(False)
            return self.text.startswith("::=", self.pos)
        finally:
            self.pos = save

    # -- grammar and rules ------------------------------------------------------------------
    def parse(self) -> Grammar:
        rules: dict[str, Expr] = {}
        positions: dict[str, tuple[int, int]] = {}
        lookaheads: dict[str, Expr] = {}
        self.skip(True)
        while self.pos < self.n:
            start = self.pos
            name = self.parse_name()
            if self.max_rules is not None and len(rules) >= self.max_rules and name not in rules:
                self.fail(f"more than {self.max_rules} rules", start, ConstraintTooLarge)
            if self.ebnf and name in rules:
                self.fail(f"rule '{name}' is defined more than once", start)
            number = self.llama.symbol(name, *self.line_col(start)) if self.llama else 0
            if self.ebnf and self.peek() == "[":
                self.parse_options()
            self.skip(False)
            self.expect("::=", "'::=' after the rule name")
            self.skip(True)
            compiled: Alternatives = [] if self.llama else None
            rules[name] = self.parse_alternatives(nested=False, compiled=compiled)
            if self.llama and compiled is not None:
                self.llama.define(number, compiled)  # a later definition replaces this one, as in llama.cpp
            positions[name] = self.line_col(start)
            if self.ebnf and self.text.startswith("(=", self.pos):
                lookaheads[name] = self.parse_lookahead()
            self.skip(False)
            if self.pos < self.n and self.peek() not in "\r\n" and not self.ebnf:
                self.fail(f"unexpected {self.peek()!r}")
            if self.pos < self.n and self.ebnf and self.peek() not in "\r\n" and not self.at_rule_start():
                self.fail(f"unexpected {self.peek()!r}")
            self.skip(True)
        if self.llama:
            self.llama.check()
        return Grammar(rules, "root", self.dialect, positions, lookaheads)

    def parse_lookahead(self) -> Expr:
        """xgrammar: ``(= choices )`` after a rule's body; no lookahead inside it."""
        self.pos += 2
        self.depth += 1
        self.skip(True)
        inner = self.parse_alternatives(nested=True)
        self.skip(True)
        self.expect(")", "')' closing the lookahead assertion")
        self.depth -= 1
        return inner

    def parse_options(self) -> None:
        start = self.pos
        end = self.text.find("]", self.pos)
        if end < 0:
            self.fail("unterminated rule option list", start)
        for raw in self.text[start + 1 : end].split(","):
            key = raw.split("=", 1)[0].strip()
            if key in _EBNF_UNSUPPORTED_OPTIONS:
                self.fail(f"rule option '{key}' is not supported", start)
            if key not in _EBNF_OPTIONS:
                self.fail(f"unknown rule option '{key}'", start)
        self.pos = end + 1

    def parse_alternatives(self, nested: bool, compiled: Alternatives = None) -> Expr:
        options = [self.parse_sequence(nested, compiled)]
        while self.peek() == "|":
            self.pos += 1
            self.skip(True)
            options.append(self.parse_sequence(nested, compiled))
        return alt(options)

    def parse_sequence(self, nested: bool, compiled: Alternatives) -> Expr:
        items: list[Expr] = []
        newlines = nested or self.ebnf
        elements = self.llama.alternative() if self.llama else None
        while True:
            self.skip(newlines)
            ch = self.peek()
            if ch in ("", ")", "|", "\r", "\n") or (self.ebnf and self.at_rule_start()):
                break
            if self.ebnf and not nested and self.text.startswith("(=", self.pos):
                break  # the rule's lookahead assertion
            atom, element = self.parse_atom()
            if elements is not None:
                elements.add(element)
            operators = 0
            while True:
                self.skip(newlines)
                op = self.peek()
                if op not in ("*", "+", "?", "{"):
                    break
                if self.ebnf and operators:
                    self.fail("two repetition operators in a row; wrap the element in parentheses")
                if self.depth + operators >= self.max_nesting:  # each stacked operator nests one level
                    self.too_deep()
                at = self.pos
                lo, hi = self.parse_operator(op)
                if elements is not None:
                    try:
                        hi = elements.repeat(lo, hi, f"'{self.text[at:self.pos]}' at line {self.line_col(at)[0]}, "
                                                     f"column {self.line_col(at)[1]}")
                    except ConstraintError as exc:
                        self.fail(str(exc), at)
                atom = Repeat(atom, lo, hi)
                operators += 1
            items.append(atom)
        if elements is not None and compiled is not None:
            compiled.append(elements.done())
        return seq(items)

    def parse_operator(self, op: str) -> tuple[int, int | None]:
        self.pos += 1
        if op == "*":
            return 0, None
        if op == "+":
            return 1, None
        if op == "?":
            return 0, 1
        return self.parse_braces()

    def parse_braces(self) -> tuple[int, int | None]:
        start = self.pos - 1
        self.skip(False)
        lo = self.parse_int("the lower bound of '{m,n}'")
        hi: int | None = lo
        self.skip(False)
        if self.peek() == ",":
            self.pos += 1
            self.skip(False)
            hi = self.parse_int("the upper bound of '{m,n}'") if self.peek().isdigit() else None
            self.skip(False)
        self.expect("}", "'}' closing the repetition")
        if hi is not None and hi < lo:
            self.fail(f"repetition upper bound {hi} is below lower bound {lo}", start)
        return lo, hi

    def parse_atom(self) -> tuple[Expr, Element]:
        """The next element, and (GBNF) what llama.cpp compiles it into."""
        ch = self.peek()
        start = self.pos
        if ch == '"':
            literal = self.parse_string()
            return literal, CHARACTER if literal.text else NOTHING
        if ch == "[":
            return self.parse_class(), CHARACTER
        if ch == "(":
            if self.ebnf and self.peek(1) == "=":
                self.fail("a lookahead assertion '(= ...)' may only end a rule")
            return self.parse_group()
        if ch == ".":
            self.pos += 1
            return ANY_CHAR, CHARACTER
        if self.name_start(ch):
            name = self.parse_name()
            if self.ebnf and self.peek() == "(":
                return self.parse_macro(name, start), CHARACTER
            line, col = self.line_col(start)
            return Ref(name, line, col), self.llama.reference(name, line, col) if self.llama else CHARACTER
        if ch == "<" and not self.ebnf:
            self.fail("token references '<...>' are not supported")
        self.fail(f"unexpected {ch!r}")

    def parse_group(self) -> tuple[Expr, Element]:
        if self.depth >= self.max_nesting:
            self.too_deep()
        line, col = self.line_col(self.pos)
        group, before = self.llama.open_group(f"the group at line {line}, column {col}") if self.llama else (0, 0)
        compiled: Alternatives = [] if self.llama else None
        self.pos += 1
        self.depth += 1
        self.skip(True)
        inner = self.parse_alternatives(nested=True, compiled=compiled)
        self.skip(True)
        self.expect(")", "')'")
        self.depth -= 1
        if self.llama and compiled is not None:
            return inner, self.llama.close_group(group, before, compiled)
        return inner, CHARACTER

    def parse_macro(self, name: str, start: int) -> Expr:
        if name != "Regex":
            self.fail(f"macro {name}(...) is not supported", start)
        self.pos += 1
        self.skip(True)
        if self.peek() != '"':
            self.fail("Regex(...) takes a string pattern first")
        pattern = self.parse_string().text
        flags = 0
        self.skip(True)
        while self.peek() == ",":
            self.pos += 1
            self.skip(True)
            arg_start = self.pos
            key = self.parse_name()
            self.skip(False)
            self.expect("=", "'=' after a macro argument name")
            self.skip(False)
            if key == "json_string" and self.text.startswith("false", self.pos):
                self.pos += len("false")
            elif key == "flags" and self.peek() == '"':
                value = self.parse_string().text
                if any(f not in _REGEX_FLAGS for f in value):
                    self.fail(f"unsupported Regex flags {value!r}", arg_start)
                for flag in value:
                    flags |= _REGEX_FLAGS[flag]
            else:
                self.fail(f"unsupported Regex argument '{key}'", arg_start)
            self.skip(True)
        self.expect(")", "')' closing Regex(...)")
        try:
            return regex_to_expr(pattern, flags, self.max_nesting - self.depth)
        except ConstraintError as exc:
            line, col = self.line_col(start)
            raise type(exc)(f"ebnf grammar error at line {line}, column {col}: {exc}") from exc


def parse_text_grammar(text: str, dialect: TextDialect, max_nesting: int = DEFAULT_MAX_NESTING,
                       max_rules: int | None = None) -> Grammar:
    """Parse GBNF or xgrammar EBNF text (syntax only; see grammar_sample.check_grammar)."""
    if not isinstance(text, str):
        raise ConstraintError(f"grammar must be a string, got {type(text).__name__}")
    return _Parser(text, dialect, max_nesting, max_rules).parse()
