"""The lexical layer of the Lark parser (lark.py): positions and errors, blanks and comments, names, counts,
``"literals"`` and ``/regexes/flags``."""

from __future__ import annotations

import re

from . import charset
from .cursor import Cursor
from .errors import ConstraintError
from .grammar_ast import Expr
from .regex import regex_to_expr

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_STRING_ESCAPES = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "f": "\f",
    "v": "\v",
    "0": "\0",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "a": "\a",
    "b": "\b",
}
_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "u": 0}
_MAX_COUNT = (1 << 31) - 1


class LarkScanner(Cursor):
    """A cursor over Lark grammar text (``pos``), with the reading and error helpers of its parser."""

    comment_starts = ("#", "//")

    def __init__(self, text: str, max_nesting: int) -> None:
        super().__init__(text, "lark", max_nesting)

    def name(self) -> str:
        match = _NAME.match(self.text, self.pos)
        if not match:
            self.fail("expected a name")
        self.pos = match.end()
        return match.group()

    def count(self, digits: str, start: int) -> int:
        value = int(digits) if len(digits) <= 12 else _MAX_COUNT + 1  # int() of a long text is slow, or refused
        if value > _MAX_COUNT:
            self.fail(f"repetition count past {_MAX_COUNT} (llguidance reads counts as 32-bit integers)", start)
        return value

    def integer(self) -> int:
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos:
            self.fail("expected an integer")
        return self.count(self.text[start : self.pos], start)

    def string(self) -> str:
        start = self.pos
        self.pos += 1
        out: list[str] = []
        while True:
            ch = self.peek()
            if ch in ("", "\n"):
                self.fail("unterminated string literal", start)
            self.pos += 1
            if ch == '"':
                return "".join(out)
            if ch != "\\":
                out.append(ch)
                continue
            esc = self.peek()
            self.pos += 1
            if esc in _STRING_ESCAPES:
                out.append(_STRING_ESCAPES[esc])
            elif esc in ("x", "u", "U"):
                width = {"x": 2, "u": 4, "U": 8}[esc]
                digits = self.text[self.pos : self.pos + width]
                if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                    self.fail(f"escape '\\{esc}' needs {width} hex digits", self.pos - 2)
                value = int(digits, 16)
                if value > charset.MAX_CODE_POINT:
                    self.fail("escape past the last Unicode code point", self.pos - 2)
                out.append(chr(value))
                self.pos += width
            else:
                out.extend(("\\", esc))

    def regex(self, depth: int) -> Expr:
        start = self.pos
        self.pos += 1
        out: list[str] = []
        while True:
            ch = self.peek()
            if ch in ("", "\n"):
                self.fail("unterminated regular expression", start)
            self.pos += 1
            if ch == "/":
                break
            if ch == "\\" and self.peek() == "/":
                out.append("/")
                self.pos += 1
            elif ch == "\\":
                out.extend((ch, self.peek()))
                self.pos += 1
            else:
                out.append(ch)
        flags = 0
        while self.peek().isalpha():
            flag = self.peek()
            if flag not in _REGEX_FLAGS:
                self.fail(f"unsupported regex flag '{flag}'")
            flags |= _REGEX_FLAGS[flag]
            self.pos += 1
        try:
            return regex_to_expr("".join(out), flags, self.max_nesting - depth)
        except ConstraintError as exc:
            line, col = self.line_col(start)
            raise type(exc)(f"lark grammar error at line {line}, column {col}: {exc}") from exc
