"""An upper bound on the work ``jsonschema`` does to check one answer against one schema, before it runs.

``jsonschema`` applies every subschema that reaches a value, by every path that reaches it, and never stops early
(``allOf``, and ``anyOf`` while looking for the best error): a schema applying few subschemas to one value can
still apply them to each child once per path that reached the parent, so the work is the product along the
answer's depth (the final sweep: a ladder of 2^5 paths whose leaf applies the ladder again to every child took
27 s for a 744-byte request; 2^7 never finished). This counts it: the answer is walked once, each value with the
schemas that reach it and in how many ways (the in-place closure of ``$ref``, ``allOf``, ``anyOf``, ``oneOf``,
``not``, ``if``/``then``/``else``, counted with multiplicity), each child with what its parent's schemas apply to
it (``properties``, ``patternProperties`` and ``additionalProperties`` to every key, ``items``, ``prefixItems``,
``additionalItems`` and ``contains`` to every element: over, never under; ``uniqueItems`` weighs the
comparisons it makes, every pair where the items cannot be sorted), and the count stops at the budget.

A schema whose evaluation it cannot follow is not counted but refused (:func:`check_cost` returns None): a
reference other than a local JSON pointer (``#anchor``, an ``$id`` URI, ``$dynamicRef``, ``$recursiveRef``),
an ``$id`` below the root, or a keyword that applies schemas by rules not followed here (``dependentSchemas``,
``dependencies``, ``unevaluatedProperties``, ``unevaluatedItems``). The caller then does not check the answer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gateway.structured.checks import _DATA_KEYWORDS, _IN_PLACE_LISTS, _IN_PLACE_VALUES, _resolve

_NOT_FOLLOWED = ("$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
                 "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
                 "extends", "disallow")  # (draft 3's, which apply schemas too)


def check_cost(schema: Any, value: Any, budget: int) -> int | None:
    """Subschema applications (each weighted by the ``enum`` values it compares) checking ``value`` against
    ``schema`` may take, counted to ``budget`` + 1; None when the schema uses what this does not follow."""
    if not isinstance(schema, dict) or not _followable_memo(schema):
        return None
    if "draft-03" in str(schema.get("$schema", "")):  # (draft 3's types may be schemas)
        return None
    weights: dict[int, int] = {}
    total = 0
    stack: list[tuple[Any, dict[int, int]]] = [(value, {id(schema): 1})]
    nodes: dict[int, dict[str, Any]] = {id(schema): schema}
    while stack:
        node, reaching = stack.pop()
        applied = _closure(schema, reaching, nodes, budget - total)
        if applied is None:
            return budget + 1
        for sid, count in applied.items():
            if sid not in weights:  # (an enum or const is compared whole with the value: its size)
                weights[sid] = 1 + _values(nodes[sid].get("enum")) + _values(nodes[sid].get("const"))
            total += count * weights[sid]
            if isinstance(node, list) and nodes[sid].get("uniqueItems") is True:
                total += count * _uniqueness(node)
            if total > budget:
                return budget + 1
        # (what each child would be handed, counted before it is built: a tuple of k item schemas or k patterns
        # handed to each of k children is k^2 entries)
        fan = sum(count * _handed(nodes[sid]) for sid, count in applied.items())
        if isinstance(node, dict | list) and (total := total + fan * len(node)) > budget:
            return budget + 1
        if isinstance(node, dict):
            names: dict[int, int] = defaultdict(int)  # (propertyNames: applied to every key, a string)
            for sid, count in applied.items():
                target = nodes[sid].get("propertyNames")
                if isinstance(target, dict):
                    nodes[id(target)] = target
                    names[id(target)] += count
            for key, child in node.items():
                stack.append((child, _children(applied, nodes, key, None)))
                if names:
                    stack.append((key, names))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                stack.append((child, _children(applied, nodes, None, index)))
    return total


def _handed(schema: dict[str, Any]) -> int:
    """How many subschemas a schema may hand each child (patternProperties each, a tuple's items, the rest)."""
    patterns = schema.get("patternProperties")
    return 4 + (len(patterns) if isinstance(patterns, dict) else 0)


def _values(value: Any) -> int:
    """The values in a JSON value, containers included (0 for None: no enum, no const)."""
    if value is None:
        return 0
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _uniqueness(items: list[Any]) -> int:
    """Comparisons ``uniqueItems`` makes: jsonschema sorts what it can (numbers, strings), and compares every pair
    of anything else (objects, arrays, mixed types)."""
    n = len(items)
    sortable = all(isinstance(i, int | float) and not isinstance(i, bool) for i in items) or all(
        isinstance(i, str) for i in items)
    return n * max(1, n.bit_length()) if sortable else n * (n - 1) // 2


_followed: dict[int, tuple[dict[str, Any], bool]] = {}  # id -> (the schema, kept so its id stays its, verdict)


def _followable_memo(root: dict[str, Any]) -> bool:
    """``_followable(root)``, walked once per schema object: an answer calling one strict tool forty times is
    checked against one schema forty times, and the walk of a 120 KB schema takes ~11 ms."""
    known = _followed.get(id(root))
    if known is not None and known[0] is root:
        return known[1]
    if len(_followed) >= 16:  # (parsed schemas are large: hold few)
        _followed.clear()
    verdict = _followable(root)
    _followed[id(root)] = (root, verdict)
    return verdict


def _followable(root: dict[str, Any]) -> bool:
    stack: list[tuple[Any, bool, bool]] = [(root, True, False)]
    while stack:
        node, top, data = stack.pop()
        if isinstance(node, dict):
            if not data:
                if any(key in node for key in _NOT_FOLLOWED) or ("$id" in node and not top):
                    return False
                ref = node.get("$ref")
                if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
                    return False
            stack.extend((child, False, data or key in _DATA_KEYWORDS) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, False, data) for child in node)
    return True


def _closure(root: dict[str, Any], reaching: dict[int, int], nodes: dict[int, dict[str, Any]],
             budget: int) -> dict[int, int] | None:
    """Every schema applied to one value, with the number of ways it is, from those reaching it; None past
    ``budget`` applications (request time refuses in-place cycles; a cycle here runs into the budget)."""
    applied: dict[int, int] = defaultdict(int)
    queue = list(reaching.items())
    spent = 0
    while queue:
        sid, count = queue.pop()
        applied[sid] += count
        spent += count
        if spent > budget:
            return None
        schema = nodes[sid]
        targets = [schema[key] for key in _IN_PLACE_VALUES if key in schema]
        targets += [item for key in _IN_PLACE_LISTS if isinstance(schema.get(key), list) for item in schema[key]]
        ref = schema.get("$ref")
        if isinstance(ref, str):
            targets.append(_resolve(root, ref))
        for target in targets:
            if isinstance(target, dict):
                nodes[id(target)] = target
                queue.append((id(target), count))
    return applied


def _children(applied: dict[int, int], nodes: dict[int, dict[str, Any]], key: str | None,
              index: int | None) -> dict[int, int]:
    """What the schemas applied to a value apply to its child at ``key`` (an object's) or ``index`` (an array's)."""
    out: dict[int, int] = defaultdict(int)
    for sid, count in applied.items():
        schema = nodes[sid]
        if key is not None:
            properties = schema.get("properties")
            targets = [properties[key]] if isinstance(properties, dict) and key in properties else []
            patterns = schema.get("patternProperties")
            targets += list(patterns.values()) if isinstance(patterns, dict) else []
            targets.append(schema.get("additionalProperties"))
        else:
            prefix = schema.get("prefixItems")
            items = schema.get("items")
            targets = [prefix[index]] if isinstance(prefix, list) and index is not None and index < len(prefix) else []
            if isinstance(items, list):  # (a draft-4 tuple: positional)
                targets += [items[index]] if index is not None and index < len(items) else []
            else:
                targets.append(items)
            targets += [schema.get("additionalItems"), schema.get("contains")]
        for target in targets:
            if isinstance(target, dict):
                nodes[id(target)] = target
                out[id(target)] += count
    return out
