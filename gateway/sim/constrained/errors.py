"""The one exception type of the constrained-output library."""

from __future__ import annotations


class ConstraintError(ValueError):
    """An invalid or unsupported constraint; the message says what is wrong and where."""
