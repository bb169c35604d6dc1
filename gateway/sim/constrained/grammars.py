"""Grammar constraints by dialect: validation and sampling (GBNF, xgrammar EBNF, Lark)."""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Literal

from .errors import DEFAULT_MAX_NESTING, ConstraintError
from .grammar_ast import Grammar, Ref
from .grammar_parse import parse_text_grammar
from .grammar_sample import CostTable, check_grammar, sample_expr
from .lark import parse_lark
from .left_recursion import check_no_left_recursion
from .regex import forget_regexes

GrammarDialect = Literal["gbnf", "ebnf", "lark"]


def parse_grammar(grammar: str, dialect: GrammarDialect, max_nesting: int = DEFAULT_MAX_NESTING,
                  max_rules: int | None = None) -> Grammar:
    """Parse and fully check ``grammar``; raise ConstraintError on any problem."""
    return _prepared(grammar, dialect, max_nesting, max_rules).grammar


@lru_cache(maxsize=128)
def _prepared(grammar: str, dialect: GrammarDialect, max_nesting: int, max_rules: int | None) -> CostTable:
    if dialect == "lark":
        parsed = parse_lark(grammar, max_nesting, max_rules)
    elif dialect in ("gbnf", "ebnf"):
        parsed = parse_text_grammar(grammar, dialect, max_nesting, max_rules)
    else:
        raise ConstraintError(f"unknown grammar dialect {dialect!r} (gbnf, ebnf or lark)")
    table = check_grammar(parsed)
    if dialect == "gbnf":
        check_no_left_recursion(parsed)
    return table


def forget_prepared() -> None:
    """Drop the parsed grammars and regexes kept for reuse (a process validating large ones in turn)."""
    _prepared.cache_clear()
    forget_regexes()


def validate_grammar(grammar: str, dialect: GrammarDialect, max_nesting: int = DEFAULT_MAX_NESTING,
                     max_rules: int | None = None) -> None:
    """Raise ConstraintError if ``grammar`` is not a usable grammar of ``dialect`` (ConstraintTooDeep /
    ConstraintTooLarge past ``max_nesting`` / ``max_rules``); linear in the grammar's size."""
    if not isinstance(grammar, str):
        raise ConstraintError(f"grammar must be a string, got {type(grammar).__name__}")
    _prepared(grammar, dialect, max_nesting, max_rules)


def _sample(grammar: str, dialect: GrammarDialect, rng: random.Random) -> str:
    validate_grammar(grammar, dialect)
    table = _prepared(grammar, dialect, DEFAULT_MAX_NESTING, None)
    return sample_expr(table, Ref(table.grammar.root), rng)


def gbnf_sample(grammar: str, rng: random.Random) -> str:
    """A string the llama.cpp GBNF ``grammar`` accepts from rule ``root``."""
    return _sample(grammar, "gbnf", rng)


def ebnf_sample(grammar: str, rng: random.Random) -> str:
    """A string the xgrammar EBNF ``grammar`` accepts from rule ``root``."""
    return _sample(grammar, "ebnf", rng)


def lark_sample(grammar: str, rng: random.Random) -> str:
    """A string the Lark ``grammar`` accepts from rule ``start`` (no ``%ignore``-d text)."""
    return _sample(grammar, "lark", rng)
