"""Writing a grammar model back out as GBNF or xgrammar EBNF text.

Escapes are chosen to mean the same thing in both dialects: code points are written with
fixed-width escapes (``\\xHH`` in GBNF, ``\\uXXXX`` / ``\\UXXXXXXXX`` in EBNF, whose ``\\x`` takes
any number of hex digits), and class members that could read as syntax (``^ - [ ] \\``) are
always escaped that way too.
"""

from __future__ import annotations

from typing import Literal

from . import charset
from .errors import ConstraintError
from .grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq

TextDialect = Literal["gbnf", "ebnf"]

_CLASS_SPECIAL = "^-[]\\"
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _code_point(cp: int, dialect: TextDialect) -> str:
    if dialect == "gbnf":
        if cp <= 0xFF:
            return f"\\x{cp:02X}"
        return f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}"
    return f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}"


def _char(ch: str, dialect: TextDialect, special: str) -> str:
    cp = ord(ch)
    if 0xD800 <= cp <= 0xDFFF:
        raise ConstraintError(f"surrogate code point U+{cp:04X} cannot be written in {dialect}")
    if ch in _NAMED:
        return _NAMED[ch]
    if ch in special or cp < 0x20 or cp == 0x7F:
        return _code_point(cp, dialect)
    return ch


def render_literal(text: str, dialect: TextDialect) -> str:
    """A double-quoted literal; ``\\"`` and ``\\\\`` are valid escapes in both dialects."""
    body = "".join("\\" + ch if ch in '"\\' else _char(ch, dialect, "") for ch in text)
    return f'"{body}"'


def render_class(expr: CharClass, dialect: TextDialect) -> str:
    if not expr.items and not expr.negated:  # matches nothing
        return f"[^{_code_point(0, dialect)}-{_code_point(charset.MAX_CODE_POINT, dialect)}]"
    parts: list[str] = []
    for lo, hi in charset.normalize(expr.items):
        first = _char(chr(lo), dialect, _CLASS_SPECIAL)
        parts.append(first if lo == hi else first + "-" + _char(chr(hi), dialect, _CLASS_SPECIAL))
    return "[" + ("^" if expr.negated else "") + "".join(parts) + "]"


def _suffix(expr: Repeat) -> str:
    lo, hi = expr.lo, expr.hi
    if (lo, hi) == (0, None):
        return "*"
    if (lo, hi) == (1, None):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    if hi is None:
        return f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


def render_expr(expr: Expr, dialect: TextDialect, names: dict[str, str] | None = None, context: int = 0) -> str:
    """``context``: 0 top level, 1 inside a sequence, 2 operand of a repetition."""
    if isinstance(expr, Lit):
        return render_literal(expr.text, dialect)
    if isinstance(expr, CharClass):
        return render_class(expr, dialect)
    if isinstance(expr, Ref):
        return (names or {}).get(expr.name, expr.name)
    if isinstance(expr, Seq):
        if not expr.items:
            return '""'
        text = " ".join(render_expr(item, dialect, names, 1) for item in expr.items)
        return f"({text})" if context == 2 and len(expr.items) > 1 else text
    if isinstance(expr, Alt):
        text = " | ".join(render_expr(option, dialect, names, 0) for option in expr.options)
        return f"({text})" if context > 0 else text
    text = render_expr(expr.item, dialect, names, 2) + _suffix(expr)
    return f"({text})" if context == 2 else text


def render_grammar(grammar: Grammar, dialect: TextDialect, names: dict[str, str] | None = None) -> str:
    """One rule per line, the root first."""
    order = [grammar.root] + [n for n in grammar.rules if n != grammar.root]
    lines = []
    for name in order:
        target = (names or {}).get(name, name)
        lines.append(f"{target} ::= {render_expr(grammar.rules[name], dialect, names)}")
    return "\n".join(lines) + "\n"
