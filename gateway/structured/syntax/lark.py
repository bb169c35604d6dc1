"""A parser for the Lark grammar subset accepted by vLLM (xgrammar/guidance) and TabbyAPI
(llguidance), into the shared grammar model.

Supported: ``rule: ...`` (lowercase, optional ``?``/``!`` prefix, ``.N`` priority),
``TERMINAL: ...`` (uppercase), alternatives ``|`` (also on continuation lines), ``-> alias``,
``( )``, ``[ ]`` (optional), ``* + ?``, ``~ n`` / ``~ n..m`` and ``{m,n}``, ``"literal"`` with
an ``i`` flag, ``"a".."z"`` ranges, ``/regex/flags`` (see regex.py), ``//`` and ``#`` comments,
``%import common.X [-> Y]`` / ``%import common (X, Y)`` for WS, WS_INLINE, NEWLINE, CR, LF,
NUMBER, SIGNED_NUMBER, INT, SIGNED_INT, DECIMAL, FLOAT, SIGNED_FLOAT, WORD, LETTER,
LCASE_LETTER, UCASE_LETTER, DIGIT, HEXDIGIT, ESCAPED_STRING, CNAME; ``%ignore`` (samples
contain no ignored text).  Templates, ``%declare``, ``%override``, ``%extend`` and other
imports raise ConstraintError.  The start rule is ``start``.

Bounded like grammar_parse.py: ``( )`` / ``[ ]`` and stacked operators nested deeper than
``max_nesting`` raise ConstraintTooDeep (a ``/regex/`` counts from where it stands), more than
``max_rules`` definitions ConstraintTooLarge.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NoReturn

from . import charset
from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooDeep, ConstraintTooLarge
from .grammar_ast import Alt, CharClass, Expr, Grammar, LineIndex, Lit, Ref, Repeat, Seq, alt, refs_in, seq
from .lark_common import COMMON_SOURCE
from .regex import regex_to_expr

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPEAT_BRACES = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
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


def is_terminal(name: str) -> bool:
    return name.lstrip("_").isupper()


class _LarkParser:
    def __init__(self, text: str, max_nesting: int = DEFAULT_MAX_NESTING, max_rules: int | None = None) -> None:
        self.text = text
        self.n = len(text)
        self.pos = 0
        self.rules: dict[str, Expr] = {}
        self.positions: dict[str, tuple[int, int]] = {}
        self.ignores = 0
        self.lines = LineIndex(text)
        self.max_nesting = max_nesting
        self.max_rules = max_rules
        self.defined = 0

    def line_col(self, pos: int) -> tuple[int, int]:
        return self.lines.line_col(pos)

    def fail(self, message: str, pos: int | None = None, error: type[ConstraintError] = ConstraintError) -> NoReturn:
        line, col = self.line_col(self.pos if pos is None else pos)
        raise error(f"lark grammar error at line {line}, column {col}: {message}")

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
            elif ch == "#" or self.text.startswith("//", self.pos):
                end = self.text.find("\n", self.pos)
                self.pos = self.n if end < 0 else end
            else:
                break

    def name(self) -> str:
        match = _NAME.match(self.text, self.pos)
        if not match:
            self.fail("expected a name")
        self.pos = match.end()
        return match.group()

    def define(self, name: str, body: Expr, start: int) -> None:
        self.defined += 1
        if self.max_rules is not None and self.defined > self.max_rules:
            self.fail(f"more than {self.max_rules} rules and terminals", start, ConstraintTooLarge)
        if name in self.rules:
            self.fail(f"'{name}' is defined more than once", start)
        self.rules[name] = body
        self.positions[name] = self.line_col(start)

    # -- statements -------------------------------------------------------------------------
    def parse(self) -> Grammar:
        self.skip(True)
        while self.pos < self.n:
            if self.peek() == "%":
                self.directive()
            else:
                self.definition()
            self.skip(False)
            if self.pos < self.n and self.peek() not in "\r\n":
                self.fail(f"unexpected {self.peek()!r}")
            self.skip(True)
        self.check_terminals()
        return Grammar(self.rules, "start", "lark", self.positions)

    def definition(self) -> None:
        start = self.pos
        while self.peek() in ("?", "!"):
            self.pos += 1
        name = self.name()
        bare = name.lstrip("_")
        if not (bare.isupper() or bare.islower()) or not bare:
            self.fail(f"'{name}' is neither a lowercase rule nor an UPPERCASE terminal", start)
        if self.peek() == "{":
            self.fail("templates are not supported")
        if self.peek() == ".":
            self.pos += 1
            if self.peek() == "-":
                self.pos += 1
            if not self.peek().isdigit():
                self.fail("expected a priority number after '.'")
            while self.peek().isdigit():
                self.pos += 1
        self.skip(False)
        if self.peek() != ":":
            self.fail("expected ':' after the rule or terminal name")
        self.pos += 1
        self.skip(False)
        self.define(name, self.expansions(0), start)

    def directive(self) -> None:
        start = self.pos
        self.pos += 1
        word = self.name()
        self.skip(False)
        if word == "ignore":
            body = self.expansions(0)
            self.define(f"%ignore{self.ignores}", body, start)
            self.ignores += 1
        elif word == "import":
            self.import_common(start)
        else:
            self.fail(f"%{word} is not supported", start)

    def import_common(self, start: int) -> None:
        module = self.name()
        if module != "common":
            self.fail(f"only '%import common' is supported, not '{module}'", start)
        if self.peek() == ".":
            self.pos += 1
            name = self.name()
            self.skip(False)
            alias = name
            if self.text.startswith("->", self.pos):
                self.pos += 2
                self.skip(False)
                alias = self.name()
            self.add_common(name, alias, start)
            return
        self.skip(False)
        if self.peek() != "(":
            self.fail("expected '.NAME' or '(NAME, ...)' after '%import common'")
        self.pos += 1
        while True:
            self.skip(True)
            item_start = self.pos
            name = self.name()
            self.add_common(name, name, item_start)
            self.skip(True)
            if self.peek() == ",":
                self.pos += 1
                continue
            if self.peek() != ")":
                self.fail("expected ',' or ')' in the import list")
            self.pos += 1
            return

    def add_common(self, name: str, alias: str, start: int) -> None:
        common = _common_terminals()
        if name not in common:
            self.fail(f"common.{name} is not supported (have: {', '.join(sorted(common))})", start)
        todo = [name]
        while todo:
            dep = todo.pop()
            key = f"common__{dep}"
            if key not in self.rules:
                self.rules[key] = _rename(common[dep], "common__")
                todo.extend(r.name for r in refs_in(common[dep]))
        self.define(alias, Ref(f"common__{name}"), start)

    def check_terminals(self) -> None:
        for name, body in self.rules.items():
            if is_terminal(name):
                for ref in refs_in(body):
                    if not is_terminal(ref.name.removeprefix("common__")):
                        raise ConstraintError(
                            f"lark grammar error at line {ref.line}, column {ref.col}: terminal "
                            f"'{name}' refers to rule '{ref.name}' (terminals may only use terminals)"
                        )

    # -- expressions ------------------------------------------------------------------------
    def expansions(self, depth: int) -> Expr:
        options = [self.alias_sequence(depth)]
        while True:
            save = self.pos
            self.skip(True)
            if self.peek() == "|":
                self.pos += 1
                self.skip(depth > 0)
                options.append(self.alias_sequence(depth))
            else:
                self.pos = save
                return alt(options)

    def alias_sequence(self, depth: int) -> Expr:
        items: list[Expr] = []
        while True:
            self.skip(depth > 0)
            ch = self.peek()
            if ch in ("", ")", "]", "|", "\r", "\n"):
                break
            if self.text.startswith("->", self.pos):
                self.pos += 2
                self.skip(False)
                self.name()
                break
            items.append(self.operators(self.atom(depth), depth))
        return seq(items)

    def operators(self, atom: Expr, depth: int) -> Expr:
        stacked = 0
        while True:
            self.skip(depth > 0)
            ch = self.peek()
            if ch in ("*", "+", "?", "~", "{"):
                if depth + stacked >= self.max_nesting:  # each stacked operator nests one level
                    self.too_deep()
                stacked += 1
            if ch in ("*", "+", "?"):
                self.pos += 1
                atom = Repeat(atom, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[ch])
            elif ch == "~":
                self.pos += 1
                self.skip(False)
                lo = self.integer()
                hi: int | None = lo
                if self.text.startswith("..", self.pos):
                    self.pos += 2
                    hi = self.integer()
                atom = self.bounded(atom, lo, hi)
            elif ch == "{":
                match = _REPEAT_BRACES.match(self.text, self.pos)
                if not match:
                    self.fail("templates are not supported")
                self.pos = match.end()
                lo = int(match.group(1))
                upper = match.group(3)
                hi = lo if not match.group(2) else (int(upper) if upper else None)
                atom = self.bounded(atom, lo, hi)
            else:
                return atom

    def bounded(self, atom: Expr, lo: int, hi: int | None) -> Expr:
        if hi is not None and hi < lo:
            self.fail(f"repetition upper bound {hi} is below lower bound {lo}")
        return Repeat(atom, lo, hi)

    def integer(self) -> int:
        start = self.pos
        while self.peek().isdigit():
            self.pos += 1
        if start == self.pos:
            self.fail("expected an integer")
        return int(self.text[start : self.pos])

    def atom(self, depth: int) -> Expr:
        ch = self.peek()
        start = self.pos
        if ch in ("(", "["):
            if depth >= self.max_nesting:
                self.too_deep()
            self.pos += 1
            self.skip(True)
            inner = self.expansions(depth + 1)
            self.skip(True)
            close = ")" if ch == "(" else "]"
            if self.peek() != close:
                self.fail(f"expected '{close}'")
            self.pos += 1
            return inner if ch == "(" else Repeat(inner, 0, 1)
        if ch == '"':
            text = self.string()
            if self.peek() == "i":
                self.pos += 1
            if self.text.startswith("..", self.pos):
                self.pos += 2
                end = self.string()
                if len(text) != 1 or len(end) != 1 or ord(end) < ord(text):
                    self.fail("a range needs two single characters in order", start)
                return CharClass(((ord(text), ord(end)),))
            return Lit(text)
        if ch == "/":
            return self.regex(depth)
        if ch.isalpha() or ch == "_":
            name = self.name()
            line, col = self.line_col(start)
            return Ref(name, line, col)
        self.fail(f"unexpected {ch!r}")

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


def _rename(expr: Expr, prefix: str) -> Expr:
    if isinstance(expr, Ref):
        return Ref(prefix + expr.name, expr.line, expr.col)
    if isinstance(expr, Seq):
        return Seq(tuple(_rename(item, prefix) for item in expr.items))
    if isinstance(expr, Alt):
        return Alt(tuple(_rename(option, prefix) for option in expr.options))
    if isinstance(expr, Repeat):
        return Repeat(_rename(expr.item, prefix), expr.lo, expr.hi)
    return expr


@lru_cache(maxsize=1)
def _common_terminals() -> dict[str, Expr]:
    parser = _LarkParser(COMMON_SOURCE)
    parser.parse()
    return parser.rules


def parse_lark(text: str, max_nesting: int = DEFAULT_MAX_NESTING, max_rules: int | None = None) -> Grammar:
    """Parse Lark grammar text (syntax and terminal/rule separation; see check_grammar)."""
    if not isinstance(text, str):
        raise ConstraintError(f"grammar must be a string, got {type(text).__name__}")
    return _LarkParser(text, max_nesting, max_rules).parse()
