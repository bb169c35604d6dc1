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
    """``context``: 0 top level, 1 inside a sequence, 2 operand of a repetition.

    Post-order with an explicit stack: an expression may nest deeper than Python's recursion limit
    allows a recursive renderer (three frames per level)."""
    renamed = names or {}
    done: list[str] = []  # rendered children, in order, waiting for their parent
    stack: list[tuple[Expr, int, bool]] = [(expr, context, False)]
    while stack:
        node, where, children_done = stack.pop()
        if isinstance(node, Lit):
            done.append(render_literal(node.text, dialect))
        elif isinstance(node, CharClass):
            done.append(render_class(node, dialect))
        elif isinstance(node, Ref):
            done.append(renamed.get(node.name, node.name))
        elif isinstance(node, Seq):
            if not node.items:
                done.append('""')
            elif not children_done:
                stack.append((node, where, True))
                stack.extend((item, 1, False) for item in reversed(node.items))
            else:
                text = " ".join(_take(done, len(node.items)))
                done.append(f"({text})" if where == 2 and len(node.items) > 1 else text)
        elif isinstance(node, Alt):
            if not children_done:
                stack.append((node, where, True))
                stack.extend((option, 0, False) for option in reversed(node.options))
            else:
                text = " | ".join(_take(done, len(node.options)))
                done.append(f"({text})" if where > 0 else text)
        elif not children_done:
            stack.append((node, where, True))
            stack.append((node.item, 2, False))
        else:
            text = done.pop() + _suffix(node)
            done.append(f"({text})" if where == 2 else text)
    return done[0]


def _take(done: list[str], count: int) -> list[str]:
    taken = done[len(done) - count :]
    del done[len(done) - count :]
    return taken


def render_grammar(grammar: Grammar, dialect: TextDialect, names: dict[str, str] | None = None) -> str:
    """One rule per line, the root first. A lookahead assertion is kept in EBNF; GBNF has no way to write one,
    and dropping it would be faithful only while it holds (xgrammar prunes tokens with it), so that raises."""
    if grammar.lookaheads and dialect == "gbnf":
        raise ConstraintError("a lookahead assertion '(= ...)' cannot be written in GBNF")
    order = [grammar.root] + [n for n in grammar.rules if n != grammar.root]
    lines = []
    for name in order:
        target = (names or {}).get(name, name)
        line = f"{target} ::= {render_expr(grammar.rules[name], dialect, names)}"
        if name in grammar.lookaheads:
            line += f" (={render_expr(grammar.lookaheads[name], dialect, names)})"
        lines.append(line)
    return "\n".join(lines) + "\n"
