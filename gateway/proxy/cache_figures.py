"""What an answer says about the engine's prefix cache, taken out where it could reveal another cache domain's
prompt (:func:`gateway.proxy.cache_isolation.hidden_figures` says where).

Fields are named by their path (``("usage", "prompt_tokens_details", "cached_tokens")``, ``("timings",
"cache_n")``); the answer is otherwise left as it came. Only the objects along a removed field's path are
copied, so what the gateway noted for itself (usage and timings, for accounting and for learning how well its
prefix index predicts) keeps the engine's own figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FieldPath = tuple[str, ...]


def without(doc: dict[str, Any], paths: Sequence[FieldPath]) -> dict[str, Any] | None:
    """``doc`` without the fields at ``paths``; None when it has none of them (nothing to change)."""
    out: dict[str, Any] | None = None
    for path in paths:
        smaller = _without(out if out is not None else doc, path)
        if smaller is not None:
            out = smaller
    return out


def _without(doc: dict[str, Any], path: FieldPath) -> dict[str, Any] | None:
    head, rest = path[0], path[1:]
    if head not in doc:
        return None
    if not rest:
        return {k: v for k, v in doc.items() if k != head}
    inner = doc[head]
    if not isinstance(inner, dict):
        return None
    smaller = _without(inner, rest)
    return None if smaller is None else {**doc, head: smaller}
