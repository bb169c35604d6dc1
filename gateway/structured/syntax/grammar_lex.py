"""The lexical layer of the GBNF / xgrammar EBNF parser (grammar_parse.py): positions and errors, blanks and
comments, names, integers, escapes, string literals and character classes, in either dialect's spelling."""

from __future__ import annotations

from typing import Literal

from . import charset
from .cursor import Cursor
from .gbnf_llama import MAX_COUNT
from .grammar_ast import CharClass, Lit

TextDialect = Literal["gbnf", "ebnf"]

_GBNF_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}
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
_EBNF_MAX_COUNT = 10**15  # xgrammar's kMaxIntegerInGrammar


class Scanner(Cursor):
    """A cursor over grammar text (``pos``), with the reading and error helpers both dialects share."""

    def __init__(self, text: str, dialect: TextDialect, max_nesting: int) -> None:
        super().__init__(text, dialect, max_nesting)
        self.dialect = dialect
        self.ebnf = dialect == "ebnf"

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

    def parse_int(self, what: str) -> int:
        start = self.pos
        while self.peek().isdigit() and self.peek().isascii():
            self.pos += 1
        if start == self.pos:
            self.fail(f"expected an integer for {what}")
        if self.pos - start > 20:  # past both limits below (and past what int() takes as text)
            self.fail(f"the integer for {what} is too large", start)
        value = int(self.text[start : self.pos])
        if value > (_EBNF_MAX_COUNT if self.ebnf else MAX_COUNT):
            self.fail(f"the integer for {what} is too large", start)
        return value

    # -- atoms ------------------------------------------------------------------------------
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
