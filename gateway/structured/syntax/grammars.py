"""Grammar constraints by dialect (GBNF, xgrammar EBNF, Lark): parsing and full validation, memoised."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from .errors import DEFAULT_MAX_NESTING, ConstraintError
from .grammar_ast import Grammar
from .grammar_check import CostTable, check_grammar
from .grammar_parse import parse_text_grammar
from .lark import parse_lark
from .left_recursion import check_no_growing_left_recursion
from .regex import forget_regexes

GrammarDialect = Literal["gbnf", "ebnf", "lark"]


def parse_grammar(grammar: str, dialect: GrammarDialect, max_nesting: int = DEFAULT_MAX_NESTING,
                  max_rules: int | None = None) -> Grammar:
    """Parse and fully check ``grammar``; raise ConstraintError on any problem."""
    return prepared_grammar(grammar, dialect, max_nesting, max_rules).grammar


@lru_cache(maxsize=128)
def prepared_grammar(grammar: str, dialect: GrammarDialect, max_nesting: int, max_rules: int | None) -> CostTable:
    """``grammar`` parsed and fully checked, with its cost table (what a sampler walks); memoised."""
    if dialect == "lark":
        parsed = parse_lark(grammar, max_nesting, max_rules)
    elif dialect in ("gbnf", "ebnf"):
        parsed = parse_text_grammar(grammar, dialect, max_nesting, max_rules)
    else:
        raise ConstraintError(f"unknown grammar dialect {dialect!r} (gbnf, ebnf or lark)")
    table = check_grammar(parsed)
    if dialect == "gbnf":
        check_no_growing_left_recursion(parsed)
    return table


def forget_prepared() -> None:
    """Drop the parsed grammars and regexes kept for reuse (a process validating large ones in turn)."""
    prepared_grammar.cache_clear()
    forget_regexes()


def validate_grammar(grammar: str, dialect: GrammarDialect, max_nesting: int = DEFAULT_MAX_NESTING,
                     max_rules: int | None = None) -> None:
    """Raise ConstraintError if ``grammar`` is not a usable grammar of ``dialect`` (ConstraintTooDeep /
    ConstraintTooLarge past ``max_nesting`` / ``max_rules``); linear in the grammar's size."""
    if not isinstance(grammar, str):
        raise ConstraintError(f"grammar must be a string, got {type(grammar).__name__}")
    prepared_grammar(grammar, dialect, max_nesting, max_rules)
