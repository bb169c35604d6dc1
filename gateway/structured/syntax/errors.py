"""The exception types of the constraint parsers and validators, and their default nesting limit."""

from __future__ import annotations

# deepest nesting the parsers accept unless told otherwise: well inside Python's recursion limit
DEFAULT_MAX_NESTING = 200


class ConstraintError(ValueError):
    """An invalid or unsupported constraint; the message says what is wrong and where."""


class ConstraintTooDeep(ConstraintError):
    """Nested deeper than the caller's ``max_nesting`` (the parsers stop there, before recursing on)."""


class ConstraintTooLarge(ConstraintError):
    """More rules than the caller's ``max_rules``."""
