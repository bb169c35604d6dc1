"""The limits a client's constraint must stay within, the error that names the one it broke, and the cheap
linear pre-checks that run before any recursive parser or validator sees the constraint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import LimitSettings

Code = Literal["invalid_constraint", "constraint_too_large", "constraint_too_deep", "constraint_too_complex"]


class ConstraintInvalid(ValueError):
    """The client's constraint is malformed or past a limit; ``param`` names the field, ``code`` says which."""

    def __init__(self, message: str, param: str, code: Code = "invalid_constraint") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class Offload(Exception):
    """Too much work for the event loop: validate this constraint in a worker process instead."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """``LimitSettings``' constraint limits as plain data (they travel to worker processes)."""

    max_nesting: int = 64
    max_bytes: int = 128 * 1024
    max_rules: int = 2000

    @classmethod
    def of(cls, limits: LimitSettings) -> Bounds:
        return cls(limits.max_nesting, limits.max_constraint_bytes, limits.max_grammar_rules)


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_size(size: int, what: str, param: str, bounds: Bounds) -> None:
    if size > bounds.max_bytes:
        raise ConstraintInvalid(f"{param}: the {what} is {size} bytes; this gateway accepts at most "
                                f"limits.max_constraint_bytes = {bounds.max_bytes}", param, "constraint_too_large")


def too_deep(what: str, where: str, param: str, max_nesting: int) -> ConstraintInvalid:
    return ConstraintInvalid(f"{param}: the {what} nests deeper than {max_nesting} levels{where}; this gateway "
                             f"accepts at most limits.max_nesting = {max_nesting}", param, "constraint_too_deep")


def json_depth(value: Any, limit: int, max_nodes: int | None = None) -> tuple[int, str, bool]:
    """The nesting depth of a parsed JSON value (objects and arrays), a JSON pointer to its deepest point, and
    whether the walk saw everything: it stops past ``limit`` levels or ``max_nodes`` values looked at.
    Iterative, linear in the value's size."""
    if not isinstance(value, dict | list):
        return 0, "", True
    deepest, where = 0, ""
    looked = 0
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > deepest:
            deepest, where = depth, path
            if depth > limit:
                return deepest, where, False
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            looked += 1
            if max_nodes is not None and looked > max_nodes:
                return deepest, where, False
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, f"{path}/{key}"))
    return deepest, where, True
