"""Structured output: one request form for every constraint, validated up front, translated per engine.

``extract`` reads any spelling a client may use (OpenAI ``response_format`` and forced/strict tools, the
gateway's own ``regex`` / ``choice`` / ``grammar`` fields, and each engine's native fields) into one
:class:`Constraint`; each engine adapter says what it can honour and writes the constraint in its native
fields; the routing filter ``structured-output`` sends a request only where its constraint will be
honoured. Nothing is forwarded to an engine that would ignore it.

Validation is bounded (``bounds``, ``checks``): limits on size, nesting and rules are checked first by linear
scans and refused with a 400 naming the limit; a constraint too big to validate within about a millisecond
is validated in a worker process under a deadline (``offload``); answers are checked only where that work is
bounded (``check``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.structured.constraint import CONSTRAINT_FIELDS, Constraint, ConstraintInvalid, extract, tools_fanout
    from gateway.structured.support import can_honour, grammar_in

__all__ = ["CONSTRAINT_FIELDS", "Constraint", "ConstraintInvalid", "can_honour", "extract", "grammar_in",
           "tools_fanout"]

# Loaded on first use, so that ``gateway.structured.syntax`` (pure standard library, also used by the engine
# emulators) can be imported without the request model and its settings.
_HOME = {"CONSTRAINT_FIELDS": "constraint", "Constraint": "constraint", "ConstraintInvalid": "constraint",
         "extract": "constraint", "tools_fanout": "constraint", "can_honour": "support", "grammar_in": "support"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
