"""Which constraints an engine can honour, and the grammar conversions that make more of them possible.

An engine's support is a set of words: ``json_object``, ``json_schema``, ``regex``, ``choice``,
``structural_tag``, ``tool_call`` (a forced tool call), ``strict_tools`` (strict argument schemas under
``tool_choice: auto``), ``grammar:<dialect>`` for each grammar dialect it parses natively, ``beside_tools``
where a choice or grammar may come with tools the model may call (llama.cpp refuses that), and the words a
constraint may ``require`` beyond its kind: ``at_least_one`` where a legacy structural tag's ``at_least_one`` is
read (SGLang; vLLM drops it), and each of vLLM's ``structured_outputs`` options by name
(``disable_any_whitespace``, ...). An engine without one would drop it silently: the constraint goes only
where all are honoured. A grammar in another dialect is honoured where a faithful conversion exists: GBNF ->
xgrammar EBNF always (a rewrite, see ``gateway.structured.syntax.gbnf_to_ebnf``); EBNF -> GBNF when the grammar
is already valid GBNF (xgrammar's EBNF is a superset); Lark never. Validation finds the conversions once
(``Constraint.renderings``): routing asks for them per backend, and parsing a large grammar there would stall
the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.structured.constraint import Constraint, Dialect


def grammar_in(constraint: Constraint, dialects: Iterable[str]) -> tuple[Dialect, str] | None:
    """The constraint's grammar written in one of ``dialects`` (preferring its own), or None."""
    native = set(dialects)
    if constraint.dialect in native:
        return constraint.dialect, constraint.grammar
    for dialect, text in constraint.renderings:
        if dialect in native:
            return dialect, text
    return None


def can_honour(constraint: Constraint, support: frozenset[str]) -> bool:
    if constraint.beside_tools and "beside_tools" not in support:
        return False
    if not constraint.requires <= support:
        return False
    if constraint.kind == "grammar":
        dialects = [word.split(":", 1)[1] for word in support if word.startswith("grammar:")]
        return grammar_in(constraint, dialects) is not None
    return constraint.kind in support
