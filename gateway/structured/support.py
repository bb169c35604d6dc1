"""Which constraints an engine can honour, and the grammar conversions that make more of them possible.

An engine's support is a set of words: ``json_object``, ``json_schema``, ``regex``, ``choice``,
``tool_call`` (a forced tool call), ``strict_tools`` (strict argument schemas under ``tool_choice: auto``),
and ``grammar:<dialect>`` for each grammar dialect it parses natively. A grammar in another dialect is
honoured where a faithful conversion exists: GBNF -> xgrammar EBNF always (a rewrite, see
``gateway.sim.constrained.gbnf_to_ebnf``); EBNF -> GBNF when the grammar is already valid GBNF (xgrammar's
EBNF is a superset); Lark never.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.sim.constrained import ConstraintError, gbnf_to_ebnf, validate_grammar
from gateway.structured.constraint import Constraint, Dialect


def grammar_in(constraint: Constraint, dialects: Iterable[str]) -> tuple[Dialect, str] | None:
    """The constraint's grammar written in one of ``dialects`` (preferring its own), or None."""
    native = set(dialects)
    if constraint.dialect in native:
        return constraint.dialect, constraint.grammar
    if constraint.dialect == "gbnf" and "ebnf" in native:
        try:
            return "ebnf", gbnf_to_ebnf(constraint.grammar)
        except ConstraintError:
            return None
    if constraint.dialect == "ebnf" and "gbnf" in native:
        try:
            validate_grammar(constraint.grammar, "gbnf")
        except ConstraintError:
            return None
        return "gbnf", constraint.grammar
    return None


def can_honour(constraint: Constraint, support: frozenset[str]) -> bool:
    if constraint.kind == "grammar":
        dialects = [word.split(":", 1)[1] for word in support if word.startswith("grammar:")]
        return grammar_in(constraint, dialects) is not None
    return constraint.kind in support
