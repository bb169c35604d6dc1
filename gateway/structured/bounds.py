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
    deepest: int = 0
    where: Trail = None
    looked = 0
    # each node's path as a chain back to the root, written out for the deepest alone: a string per child copied
    # its parent's, and a deep chain of long keys over a wide array took gigabytes (the final sweep)
    stack: list[tuple[Any, int, Trail]] = [(value, 1, None)]
    while stack:
        node, depth, trail = stack.pop()
        if depth > deepest:
            deepest, where = depth, trail
            if depth > limit:
                return deepest, pointer(where), False
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            looked += 1
            if max_nodes is not None and looked > max_nodes:
                return deepest, pointer(where), False
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, (key, trail)))
    return deepest, pointer(where), True


Trail = tuple[Any, "Trail"] | None  # (key, the parent's trail): a path from the root, shared by siblings


def pointer(trail: Trail, limit: int | None = None, sep: str = "/") -> str:
    """The JSON pointer (``/a/0/b``) of a trail; with ``limit``, its last ``limit`` characters or so, after
    "..." (for a message: each rendering then costs no more than that, however deep and long the path)."""
    keys: list[str] = []
    size = 0
    while trail is not None:
        key, trail = trail
        keys.append(str(key))
        size += len(keys[-1]) + len(sep)
        if limit is not None and size > limit and trail is not None:
            return "..." + "".join(f"{sep}{key}" for key in reversed(keys))[-limit:]
    return "".join(f"{sep}{key}" for key in reversed(keys))
