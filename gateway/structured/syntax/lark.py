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

As in Lark and llguidance, an item takes one repetition operator (``"a"*?`` is an error; write
``("a"*)?``), and counts are at most 2**31 - 1 (llguidance reads them as 32-bit integers).

Bounded like grammar_parse.py: ``( )`` / ``[ ]`` nested deeper than ``max_nesting`` raise
ConstraintTooDeep (a ``/regex/`` counts from where it stands), more than ``max_rules`` definitions
ConstraintTooLarge. Nested past LLGUIDANCE_MAX_NESTING levels but within ``max_nesting``, they raise
ConstraintError once parsed: llguidance refuses the grammar, so no engine would take it.
"""

from __future__ import annotations

import re
from functools import lru_cache

from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooLarge
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq, alt, refs_in, seq
from .lark_common import COMMON_SOURCE
from .lark_lex import LarkScanner

_REPEAT_BRACES = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")
# llguidance (TabbyAPI, vLLM's guidance backend) refuses "( )" / "[ ]" nested deeper, measured with 1.9.1:
# LLMatcher.validate_grammar says "lark grammar too deeply nested" at 29 levels; /regex/ groups do not count
LLGUIDANCE_MAX_NESTING = 28


def is_terminal(name: str) -> bool:
    return name.lstrip("_").isupper()


class _LarkParser(LarkScanner):
    def __init__(self, text: str, max_nesting: int = DEFAULT_MAX_NESTING, max_rules: int | None = None) -> None:
        super().__init__(text, max_nesting)
        self.rules: dict[str, Expr] = {}
        self.positions: dict[str, tuple[int, int]] = {}
        self.ignores = 0
        self.max_rules = max_rules
        self.past_llguidance: int | None = None  # where brackets first nest deeper than llguidance allows
        self.defined = 0

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
        if self.past_llguidance is not None:  # reported once the gateway's own limit has had its say
            self.fail(f"'(' and '[' nested deeper than {LLGUIDANCE_MAX_NESTING} levels, which llguidance (the Lark "
                      "parser of TabbyAPI and of vLLM's guidance backend) refuses", self.past_llguidance)
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
        """``atom`` with its repetition operator, if it has one (one at most, as in Lark and llguidance)."""
        self.skip(depth > 0)
        ch = self.peek()
        if ch not in ("*", "+", "?", "~", "{"):
            return atom
        if depth >= self.max_nesting:  # the operator nests one level
            self.too_deep()
        start = self.pos
        if ch in ("*", "+", "?"):
            self.pos += 1
            atom = Repeat(atom, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[ch])
        elif ch == "~":
            self.pos += 1
            self.skip(False)
            lo = self.integer()
            hi: int | None = lo
            after = self.pos
            self.skip(False)
            if self.text.startswith("..", self.pos):
                self.pos += 2
                self.skip(False)
                hi = self.integer()
            else:
                self.pos = after
            atom = self.bounded(atom, lo, hi, start)
        else:
            match = _REPEAT_BRACES.match(self.text, self.pos)
            if not match:
                self.fail("templates are not supported")
            self.pos = match.end()
            lo = self.count(match.group(1), start)
            upper = match.group(3)
            hi = lo if not match.group(2) else (self.count(upper, start) if upper else None)
            atom = self.bounded(atom, lo, hi, start)
        self.skip(depth > 0)
        if self.peek() in ("*", "+", "?", "~", "{"):
            self.fail("one repetition operator per item (Lark and llguidance refuse a second); wrap the item "
                      "in parentheses")
        return atom

    def bounded(self, atom: Expr, lo: int, hi: int | None, start: int) -> Expr:
        if hi is not None and hi < lo:
            self.fail(f"repetition upper bound {hi} is below lower bound {lo}", start)
        return Repeat(atom, lo, hi)

    def atom(self, depth: int) -> Expr:
        ch = self.peek()
        start = self.pos
        if ch in ("(", "["):
            if depth >= self.max_nesting:
                self.too_deep()
            if depth >= LLGUIDANCE_MAX_NESTING and self.past_llguidance is None:
                self.past_llguidance = self.pos
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
