"""Recursive-descent parser for llama.cpp GBNF and xgrammar EBNF into the grammar model.

GBNF: ``name ::= body`` rules (names of letters, digits and ``-``), ``|``, ``( )``, ``* + ?``,
``{m} {m,} {m,n}``, ``"..."`` with escapes ``\\n \\r \\t \\\\ \\" \\[ \\] \\xHH \\uHHHH
\\UHHHHHHHH``, classes ``[a-z]`` / ``[^...]``, ``.`` (any character), ``#`` comments.  A rule
ends at a newline unless inside parentheses or right after ``|``.

EBNF (xgrammar): the same core, plus names with ``_`` and ``.``, rules spanning lines freely,
the extra escapes ``\\/ \\' \\? \\b \\f \\a \\v \\0 \\e``, ``\\x`` with any number of hex digits,
``[^]``, rule options ``name[capture, temperature=..., max_tokens=N] ::=`` (no effect on the
language) and the ``Regex("...")`` macro.  Lookahead ``(= ...)``, ``lazy`` / ``max_chars``
options and the other macros (``TagDispatch``, ``Substring``, ...) raise ConstraintError.

Bounded: parentheses (and stacked repetition operators) nested deeper than ``max_nesting`` raise
ConstraintTooDeep where they are met, before the parser recurses further; more than ``max_rules``
rules raise ConstraintTooLarge when the next one starts.
"""

from __future__ import annotations

import re
from typing import Literal, NoReturn

from . import charset
from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooDeep, ConstraintTooLarge
from .grammar_ast import ANY_CHAR, CharClass, Expr, Grammar, LineIndex, Lit, Ref, Repeat, alt, seq
from .regex import regex_to_expr

TextDialect = Literal["gbnf", "ebnf"]

_GBNF_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_EBNF_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "'": "'",
    "?": "?",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "b": "\b",
    "f": "\f",
    "a": "\a",
    "v": "\v",
    "0": "\0",
    "e": "\x1b",
}
_EBNF_CLASS_ESCAPES = set("^$\\.*+?()[]{}|/-")
_HEX = set("0123456789abcdefABCDEF")
_EBNF_OPTIONS = {"capture", "temperature", "max_tokens"}
_EBNF_UNSUPPORTED_OPTIONS = {"lazy", "max_chars"}
_REGEX_FLAGS = {"i": re.IGNORECASE, "s": re.DOTALL, "u": 0}


class _Parser:
    def __init__(self, text: str, dialect: TextDialect, max_nesting: int, max_rules: int | None) -> None:
        self.text = text
        self.n = len(text)
        self.pos = 0
        self.dialect = dialect
        self.ebnf = dialect == "ebnf"
        self.lines = LineIndex(text)
        self.max_nesting = max_nesting
        self.max_rules = max_rules
        self.depth = 0  # parentheses around the current position

    # -- positions and errors -------------------------------------------------------------
    def line_col(self, pos: int) -> tuple[int, int]:
        return self.lines.line_col(pos)

    def fail(self, message: str, pos: int | None = None, error: type[ConstraintError] = ConstraintError) -> NoReturn:
        line, col = self.line_col(self.pos if pos is None else pos)
        raise error(f"{self.dialect} grammar error at line {line}, column {col}: {message}")

    def too_deep(self) -> NoReturn:
        self.fail(f"nested deeper than {self.max_nesting} levels", error=ConstraintTooDeep)

    def peek(self, offset: int = 0) -> str:
        at = self.pos + offset
        return self.text[at] if at < self.n else ""

    def skip(self, newlines: bool) -> None:
        while self.pos < self.n:
            ch = self.text[self.pos]
            if ch in " \t" or (newlines and ch in "\r\n"):
                self.pos += 1
            elif ch == "#":
                end = self.text.find("\n", self.pos)
                self.pos = self.n if end < 0 else end
            else:
                break

    def expect(self, token: str, what: str) -> None:
        if not self.text.startswith(token, self.pos):
            found = repr(self.peek()) if self.pos < self.n else "end of input"
            self.fail(f"expected {what}, found {found}")
        self.pos += len(token)

    # -- names --------------------------------------------------------------------------------
    def name_start(self, ch: str) -> bool:
        if not ch.isascii() or not ch:
            return False
        if self.ebnf:
            return ch.isalpha() or ch in "_-"
        return ch.isalnum() or ch == "-"

    def name_char(self, ch: str) -> bool:
        return bool(ch) and ch.isascii() and (ch.isalnum() or ch in ("_-." if self.ebnf else "-"))

    def parse_name(self) -> str:
        start = self.pos
        if not self.name_start(self.peek()):
            self.fail("expected a rule name")
        while self.name_char(self.peek()):
            self.pos += 1
        return self.text[start : self.pos]

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
        self.skip(True)
        while self.pos < self.n:
            start = self.pos
            if self.max_rules is not None and len(rules) >= self.max_rules:
                self.fail(f"more than {self.max_rules} rules", error=ConstraintTooLarge)
            name = self.parse_name()
            if self.ebnf and self.peek() == "[":
                self.parse_options()
            self.skip(False)
            self.expect("::=", "'::=' after the rule name")
            self.skip(True)
            body = self.parse_alternatives(nested=False)
            if name in rules:
                self.fail(f"rule '{name}' is defined more than once", start)
            rules[name] = body
            positions[name] = self.line_col(start)
            self.skip(False)
            if self.pos < self.n and self.peek() not in "\r\n" and not self.ebnf:
                self.fail(f"unexpected {self.peek()!r}")
            if self.pos < self.n and self.ebnf and self.peek() not in "\r\n" and not self.at_rule_start():
                self.fail(f"unexpected {self.peek()!r}")
            self.skip(True)
        return Grammar(rules, "root", self.dialect, positions)

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

    def parse_alternatives(self, nested: bool) -> Expr:
        options = [self.parse_sequence(nested)]
        while self.peek() == "|":
            self.pos += 1
            self.skip(True)
            options.append(self.parse_sequence(nested))
        return alt(options)

    def parse_sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        newlines = nested or self.ebnf
        while True:
            self.skip(newlines)
            ch = self.peek()
            if ch in ("", ")", "|", "\r", "\n") or (self.ebnf and self.at_rule_start()):
                break
            atom = self.parse_atom()
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
                atom = self.parse_operator(atom, op)
                operators += 1
            items.append(atom)
        return seq(items)

    def parse_operator(self, atom: Expr, op: str) -> Expr:
        self.pos += 1
        if op == "*":
            return Repeat(atom, 0, None)
        if op == "+":
            return Repeat(atom, 1, None)
        if op == "?":
            return Repeat(atom, 0, 1)
        return self.parse_braces(atom)

    def parse_braces(self, atom: Expr) -> Expr:
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
        return Repeat(atom, lo, hi)

    def parse_int(self, what: str) -> int:
        start = self.pos
        while self.peek().isdigit() and self.peek().isascii():
            self.pos += 1
        if start == self.pos:
            self.fail(f"expected an integer for {what}")
        return int(self.text[start : self.pos])

    # -- atoms ------------------------------------------------------------------------------
    def parse_atom(self) -> Expr:
        ch = self.peek()
        start = self.pos
        if ch == '"':
            return self.parse_string()
        if ch == "[":
            return self.parse_class()
        if ch == "(":
            if self.ebnf and self.peek(1) == "=":
                self.fail("lookahead assertions '(= ...)' are not supported")
            if self.depth >= self.max_nesting:
                self.too_deep()
            self.pos += 1
            self.depth += 1
            self.skip(True)
            inner = self.parse_alternatives(nested=True)
            self.skip(True)
            self.expect(")", "')'")
            self.depth -= 1
            return inner
        if ch == ".":
            self.pos += 1
            return ANY_CHAR
        if self.name_start(ch):
            name = self.parse_name()
            if self.ebnf and self.peek() == "(":
                return self.parse_macro(name, start)
            line, col = self.line_col(start)
            return Ref(name, line, col)
        if ch == "<" and not self.ebnf:
            self.fail("token references '<...>' are not supported")
        self.fail(f"unexpected {ch!r}")

    def parse_escape(self, in_class: bool) -> str:
        start = self.pos
        self.pos += 1
        ch = self.peek()
        if ch in ("x", "u", "U"):
            self.pos += 1
            width = {"x": 2, "u": 4, "U": 8}[ch]
            digits_start = self.pos
            limit = self.n if (ch == "x" and self.ebnf) else min(self.n, self.pos + width)
            while self.pos < limit and self.text[self.pos] in _HEX:
                self.pos += 1
            digits = self.text[digits_start : self.pos]
            if not digits or (len(digits) != width and not (ch == "x" and self.ebnf)):
                self.fail(f"escape '\\{ch}' needs {width} hex digits", start)
            value = int(digits, 16)
            if value > charset.MAX_CODE_POINT:
                self.fail(f"escape '\\{ch}{digits}' is past the last Unicode code point", start)
            return chr(value)
        table = _EBNF_ESCAPES if self.ebnf else _GBNF_ESCAPES
        self.pos += 1
        if ch in table:
            return table[ch]
        if self.ebnf and in_class and ch in _EBNF_CLASS_ESCAPES:
            return ch
        if self.ebnf and in_class and ch in "dDwWsS":
            self.fail(f"shorthand class '\\{ch}' is not supported; write the ranges out", start)
        self.fail(f"unknown escape '\\{ch}'" if ch else "unterminated escape", start)

    def parse_string(self) -> Lit:
        start = self.pos
        self.pos += 1
        chars: list[str] = []
        while True:
            if self.pos >= self.n:
                self.fail("unterminated string literal", start)
            ch = self.text[self.pos]
            if ch == '"':
                self.pos += 1
                return Lit("".join(chars))
            if ch in "\r\n" and self.ebnf:
                self.fail("raw newline inside a string literal (write \\n)")
            if ch == "\\":
                chars.append(self.parse_escape(in_class=False))
            else:
                chars.append(ch)
                self.pos += 1

    def class_char(self) -> int:
        if self.pos >= self.n:
            self.fail("unterminated character class")
        ch = self.text[self.pos]
        if ch in "\r\n" and self.ebnf:
            self.fail("raw newline inside a character class (write \\n)")
        if ch == "\\":
            return ord(self.parse_escape(in_class=True))
        self.pos += 1
        return ord(ch)

    def parse_class(self) -> CharClass:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        items: list[tuple[int, int]] = []
        while True:
            if self.pos >= self.n:
                self.fail("unterminated character class", start)
            if self.peek() == "]":
                self.pos += 1
                return CharClass(charset.normalize(items), negated)
            item_start = self.pos
            lo = self.class_char()
            if self.peek() == "-" and self.peek(1) not in ("", "]"):
                self.pos += 1
                hi = self.class_char()
                if hi < lo:
                    self.fail("character range end is before its start", item_start)
                items.append((lo, hi))
            else:
                items.append((lo, lo))

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
