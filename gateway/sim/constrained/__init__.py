"""Constrained-output sampling for the engine emulators.

Produces model output that satisfies a structured-output constraint the way a real engine's
constrained decoder would: JSON schema, regex, choice, llama.cpp GBNF, xgrammar EBNF and Lark
grammars.  Pure standard library; every invalid or unsupported constraint raises
:class:`ConstraintError`.  Each module's docstring documents its supported subset.
"""

from __future__ import annotations

from .choice import choice_sample, gbnf_from_choices
from .convert import gbnf_to_ebnf
from .errors import DEFAULT_MAX_NESTING, ConstraintError, ConstraintTooDeep, ConstraintTooLarge
from .grammars import ebnf_sample, forget_prepared, gbnf_sample, lark_sample, validate_grammar
from .json_gen import json_instance
from .json_schema import validate_json_schema
from .left_recursion import first_cycle
from .regex import parse_regex, regex_from_choices, regex_nesting, regex_sample, validate_regex

__all__ = [
    "DEFAULT_MAX_NESTING",
    "ConstraintError",
    "ConstraintTooDeep",
    "ConstraintTooLarge",
    "choice_sample",
    "ebnf_sample",
    "first_cycle",
    "forget_prepared",
    "gbnf_from_choices",
    "gbnf_sample",
    "gbnf_to_ebnf",
    "json_instance",
    "lark_sample",
    "parse_regex",
    "regex_from_choices",
    "regex_nesting",
    "regex_sample",
    "validate_grammar",
    "validate_json_schema",
    "validate_regex",
]
