"""The constraint languages the gateway validates and translates: llama.cpp GBNF, xgrammar EBNF, Lark
grammars and Python regexes, parsed into one grammar model; choices written as a grammar or a regex; the
faithful GBNF -> EBNF conversion. Pure standard library; every invalid or unsupported constraint raises
:class:`ConstraintError`, and every parser is bounded (``max_nesting``, ``max_rules``). Each module's
docstring documents its supported subset. The engine emulators sample from the same model
(``gateway.sim.constrained``); nothing here generates text.
"""

from __future__ import annotations

from .choice import gbnf_from_choices, regex_from_choices
from .convert import ebnf_as_gbnf, gbnf_to_ebnf
from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooDeep, ConstraintTooLarge
from .grammars import GrammarDialect, forget_prepared, parse_grammar, validate_grammar
from .left_recursion import first_cycle
from .regex import automaton_problem, expansion_problem, llama_parses, parse_regex, regex_nesting, validate_regex

__all__ = [
    "DEFAULT_MAX_NESTING",
    "ConstraintError",
    "ConstraintTooDeep",
    "ConstraintTooLarge",
    "GrammarDialect",
    "automaton_problem",
    "ebnf_as_gbnf",
    "expansion_problem",
    "first_cycle",
    "forget_prepared",
    "gbnf_from_choices",
    "gbnf_to_ebnf",
    "llama_parses",
    "parse_grammar",
    "parse_regex",
    "regex_from_choices",
    "regex_nesting",
    "validate_grammar",
    "validate_regex",
]
