"""Faithful dialect conversion: llama.cpp GBNF to xgrammar EBNF.

The GBNF text is parsed and checked exactly as for validation, then re-rendered rule by rule.
The two dialects share their core, but their texts differ in ways a textual copy would get
wrong, which rendering from the parsed model avoids:

* ``\\x`` reads exactly two hex digits in GBNF but any number in EBNF (``"\\x41B"``);
* GBNF's ``.`` becomes ``[^]`` and double operators (``"a"*?``) get parentheses;
* GBNF names may start with a digit, EBNF names may not (such rules are renamed);
* GBNF rules end at a newline, EBNF rules at the next ``name ::=``.

A grammar that cannot be written faithfully (e.g. one with surrogate code points) raises
ConstraintError, as does any GBNF grammar llama.cpp itself would reject.

The other way, an xgrammar EBNF text is offered to llama.cpp as it is, and only when llama.cpp reads
the same grammar from it: ``"\\x41B"`` or ``"a"{0,3000}`` (unbounded for llama.cpp) are not.
"""

from __future__ import annotations

from .errors import DEFAULT_MAX_NESTING, ConstraintError
from .grammars import parse_grammar
from .render import render_grammar


def gbnf_to_ebnf(grammar: str, max_nesting: int = DEFAULT_MAX_NESTING, max_rules: int | None = None) -> str:
    """The xgrammar EBNF grammar accepting exactly the strings GBNF ``grammar`` accepts."""
    parsed = parse_grammar(grammar, "gbnf", max_nesting, max_rules)
    names: dict[str, str] = {}
    taken = set(parsed.rules)
    for name in parsed.rules:
        if name[0].isdigit():
            candidate = f"r-{name}"
            while candidate in taken:
                candidate = f"r-{candidate}"
            taken.add(candidate)
            names[name] = candidate
    return render_grammar(parsed, "ebnf", names)


def ebnf_as_gbnf(grammar: str, max_nesting: int = DEFAULT_MAX_NESTING, max_rules: int | None = None) -> str | None:
    """``grammar`` (xgrammar EBNF) itself when llama.cpp reads it as the same grammar, else None."""
    try:
        as_gbnf = parse_grammar(grammar, "gbnf", max_nesting, max_rules)
    except ConstraintError:
        return None
    as_ebnf = parse_grammar(grammar, "ebnf", max_nesting, max_rules)
    return grammar if render_grammar(as_gbnf, "ebnf") == render_grammar(as_ebnf, "ebnf") else None
