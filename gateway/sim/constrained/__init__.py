"""Constrained-output sampling for the engine emulators.

Produces model output that satisfies a structured-output constraint the way a real engine's
constrained decoder would: JSON schema, regex, choice, llama.cpp GBNF, xgrammar EBNF and Lark
grammars, vLLM's and SGLang's structural tags.  Grammars, regexes and choices are parsed and
validated by the gateway's own ``gateway.structured.syntax`` (the one direction allowed: tooling
may use the product); JSON schemas by json_schema.py here.  Every invalid or unsupported constraint raises
``gateway.structured.syntax.ConstraintError``.  Each module's docstring documents its subset.
"""

from __future__ import annotations

from .choice import choice_sample
from .grammar_sample import ebnf_sample, gbnf_sample, lark_sample
from .json_gen import json_instance
from .json_schema import validate_json_schema
from .regex_sample import regex_sample
from .structural_tag import structural_tag_sample

__all__ = [
    "choice_sample",
    "ebnf_sample",
    "gbnf_sample",
    "json_instance",
    "lark_sample",
    "regex_sample",
    "structural_tag_sample",
    "validate_json_schema",
]
