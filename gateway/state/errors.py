"""The shared state's own error (a leaf: every state module raises it)."""


class StateUnavailable(Exception):
    """Redis could not be reached for an operation that needs it."""
