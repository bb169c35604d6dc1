"""Structural tags: free text in which tagged stretches (``begin``, content, ``end``) are constrained, as vLLM and
SGLang take them (xgrammar's ``StructuralTag``; both engines hand it to xgrammar unchanged).

Two forms, in either engine (vLLM 0.23-0.34 ``entrypoints/.../protocol.py`` ``StructuralTagResponseFormat`` and
``LegacyStructuralTagResponseFormat``; SGLang 0.5.19-0.5.23 ``srt/entrypoints/openai/protocol.py``):

* ``{"type": "structural_tag", "format": {...}}``: xgrammar's format tree (``tag``, ``sequence``, ``or``,
  ``triggered_tags``, ``json_schema``, ``regex``, ``grammar``, ...);
* legacy ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``, and in
  SGLang only ``at_least_one`` (vLLM's legacy model has no such field: it would be dropped).

The gateway bounds what it can without xgrammar: the whole tag within ``limits.max_constraint_bytes``, its
nesting within ``limits.max_nesting`` plus vLLM's allowance for the tag's own wrapping
(``STRUCTURAL_TAG_WRAPPER_NESTING``, 16), and every JSON schema inside it as tool parameter schemas are (nesting
within ``limits.max_nesting``, their regexes within what engines can build automata of), every ``regex`` and
``grammar`` format as those constraints are. The format tree's vocabulary is xgrammar's, which grows: a node of a
type the gateway does not know is passed on, bounded by size and depth.

:func:`parse_tag` checks the tag's shape (cheap: one walk of a bounded document); :func:`check_tag_nodes` then
parses what its nodes carry. That is as costly as the constraints they are, and a tag may carry a hundred of
them within its size: on the event loop only while all of them together stay within one small constraint's
budget (:data:`INLINE_NODE_CHARS`), else :class:`~gateway.structured.bounds.Offload`, and the whole tag is
checked in a validation worker, in its key's turn and within ``limits.validation_timeout``, as a large schema
or grammar is (the final sweep: 120 grammars of 1 KiB in one tag, each parsed on the event loop, held it 0.4 s
a request, refused or not).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from gateway.structured.bounds import (
    Bounds,
    ConstraintInvalid,
    Offload,
    Trail,
    check_size,
    json_depth,
    pointer,
    too_deep,
)
from gateway.structured.checks import (
    INLINE_GRAMMAR_CHARS,
    check_fan_out,
    check_grammar,
    check_patterns,
    check_regex,
    schema_patterns,
)

WRAPPER_NESTING = 16  # vLLM's STRUCTURAL_TAG_WRAPPER_NESTING: levels a tag may add around its schemas
# the regexes, grammars and schema patterns of one tag, in characters, that the event loop parses itself: what
# one inline grammar may be (past it, the whole tag goes to a validation worker)
INLINE_NODE_CHARS = INLINE_GRAMMAR_CHARS
# format nodes whose field holds a JSON schema (xgrammar: JSONSchemaFormat, QwenXMLParameterFormat)
_SCHEMA_NODES = {"json_schema": "json_schema", "qwen_xml_parameter": "json_schema"}


def parse_tag(value: Any, param: str, bounds: Bounds) -> dict[str, Any]:
    """The tag as an object with ``"type": "structural_tag"`` (``value``: that object, or its JSON text as vLLM's
    ``structured_outputs.structural_tag`` takes it), checked within ``bounds``; ConstraintInvalid otherwise."""
    if isinstance(value, str):
        check_size(len(value.encode("utf-8", "surrogatepass")), "structural tag", param, bounds)
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            if "depth" in str(exc):
                raise too_deep("structural tag", "", param, bounds.max_nesting + WRAPPER_NESTING) from None
            raise ConstraintInvalid(f"{param} is not valid JSON: {exc}", param) from None
        if isinstance(value, dict):
            value = {"type": "structural_tag", **value}  # (vLLM's string form may leave the type out)
    if not isinstance(value, dict) or value.get("type") != "structural_tag":
        raise ConstraintInvalid(f"{param} must be an object with \"type\": \"structural_tag\"", param)
    limit = bounds.max_nesting + WRAPPER_NESTING
    try:
        text = orjson.dumps(value)  # (C, and bounded by the body: the size is known before anything is walked)
    except orjson.JSONEncodeError as exc:
        if "recursion" in str(exc).lower() or "depth" in str(exc).lower():
            raise too_deep("structural tag", "", param, limit) from None
        raise ConstraintInvalid(f"{param} is not a JSON object", param) from None
    except TypeError:
        raise ConstraintInvalid(f"{param} is not a JSON object", param) from None
    check_size(len(text), "structural tag", param, bounds)
    depth, where, _ = json_depth(value, limit)
    if depth > limit:
        raise too_deep("structural tag", f" (objects and arrays, at {where[:200] or '/'})", param, limit)
    list(_nodes(value, param, bounds))  # (its shape, every node's, before anything is parsed)
    return value


def check_tag_nodes(tag: dict[str, Any], param: str, bounds: Bounds, inline: bool) -> None:
    """Parse what the nodes of ``tag`` (as :func:`parse_tag` returned it) carry: JSON schemas (nesting and
    patterns), regexes and grammars, as those constraints are checked. ``inline``: on the event loop, which
    raises Offload before parsing anything when together they are more than :data:`INLINE_NODE_CHARS`."""
    nodes = list(_nodes(tag, param, bounds))
    if inline and sum(size for _, _, _, size in nodes) > INLINE_NODE_CHARS:
        raise Offload
    for kind, value, where, _ in nodes:
        if kind == "schema":
            _check_schema(value, where, bounds)
        elif kind == "regex":
            check_regex(value, where, bounds, inline=inline)  # (inline: each within the budget, memoised)
        else:
            check_grammar(value, "ebnf", where, bounds, inline=inline, llama=False)  # (no tag goes to llama.cpp)


def _nodes(tag: dict[str, Any], param: str, bounds: Bounds) -> Iterator[tuple[str, Any, str, int]]:
    """(``schema`` | ``regex`` | ``grammar``, its value, its path, the characters parsing it reads) for every
    node of the tag that carries one, its shape checked on the way (ConstraintInvalid)."""
    if "structures" in tag:
        yield from _legacy(tag, param)
    elif isinstance(tag.get("format"), dict):
        yield from _format(tag["format"], f"{param}.format")
    else:
        raise ConstraintInvalid(f"{param} must have a 'format' object, or 'structures' and 'triggers'", param)


def at_least_one(tag: dict[str, Any]) -> bool:
    """Whether a legacy tag asks for at least one tagged stretch (SGLang reads it; vLLM has no such field)."""
    return "structures" in tag and tag.get("at_least_one") is True


def _legacy(tag: dict[str, Any], param: str) -> Iterator[tuple[str, Any, str, int]]:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ConstraintInvalid(f"{param}.structures must be a non-empty array", f"{param}.structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ConstraintInvalid(f"{param}.triggers must be a non-empty array of non-empty strings",
                                f"{param}.triggers")
    if not isinstance(tag.get("at_least_one", False), bool):
        raise ConstraintInvalid(f"{param}.at_least_one must be a boolean", f"{param}.at_least_one")
    unknown = sorted(set(tag) - {"type", "structures", "triggers", "at_least_one"})
    if unknown:
        raise ConstraintInvalid(f"{param}: unknown field {unknown[0]!r} of a legacy structural tag", param)
    for i, structure in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not isinstance(structure, dict) or not all(isinstance(structure.get(k), str) for k in ("begin", "end")):
            raise ConstraintInvalid(f"{where} must be an object with string 'begin' and 'end'", where)
        if not isinstance(structure.get("schema"), dict):  # (vLLM dumps a missing one as null, which xgrammar refuses)
            raise ConstraintInvalid(f"{where}.schema must be a JSON schema object", f"{where}.schema")
        yield "schema", structure["schema"], f"{where}.schema", _pattern_chars(structure["schema"])


def _format(root: dict[str, Any], param: str) -> Iterator[tuple[str, Any, str, int]]:
    """Every node of xgrammar's format tree that carries a schema, regex or grammar."""
    stack: list[tuple[Any, Trail]] = [(root, None)]
    while stack:
        node, trail = stack.pop()
        if isinstance(node, list):
            stack.extend((child, (f"[{i}]", trail)) for i, child in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        # (a node's path written out for it alone, its last 200 characters: a string per child copied its
        # parent's, and a deep chain of long keys over a wide array took gigabytes, the final sweep)
        where = param + pointer(trail, 200, sep="")
        kind = node.get("type")
        if not isinstance(kind, str):
            raise ConstraintInvalid(f"{where} must be a format object with a 'type'", where)
        if kind in _SCHEMA_NODES:
            field = _SCHEMA_NODES[kind]
            schema = node.get(field)
            if not isinstance(schema, dict | bool):
                raise ConstraintInvalid(f"{where}.{field} must be a JSON schema", f"{where}.{field}")
            if isinstance(schema, dict):
                yield "schema", schema, f"{where}.{field}", _pattern_chars(schema)
            continue
        if kind == "regex":
            pattern = node.get("pattern")
            if not isinstance(pattern, str):
                raise ConstraintInvalid(f"{where}.pattern must be a string", f"{where}.pattern")
            yield "regex", pattern, f"{where}.pattern", len(pattern)
        elif kind == "grammar":
            grammar = node.get("grammar")
            if not isinstance(grammar, str):
                raise ConstraintInvalid(f"{where}.grammar must be a string", f"{where}.grammar")
            yield "grammar", grammar, f"{where}.grammar", len(grammar)
        for key, child in node.items():
            if isinstance(child, dict | list):
                stack.append((child, (f".{key}", trail)))


def _pattern_chars(schema: dict[str, Any]) -> int:
    """What checking a schema's patterns parses (its nesting is checked with the tag's, at no cost to speak of)."""
    return sum(len(pattern) for _, pattern, _ in schema_patterns(schema))


def _check_schema(schema: dict[str, Any], param: str, bounds: Bounds) -> None:
    """As a tool's parameter schema is: nesting and regexes, no metaschema check (xgrammar judges it)."""
    depth, where, _ = json_depth(schema, bounds.max_nesting)
    if depth > bounds.max_nesting:
        raise too_deep("JSON schema", f" (objects and arrays, at {where[:200] or '/'})", param, bounds.max_nesting)
    check_patterns(schema, param, bounds)
    check_fan_out(schema, param)
