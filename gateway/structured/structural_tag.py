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
``grammar`` format as those constraints are when that is cheap enough for the event loop (larger ones are
left to the engine, whose own validation refuses what it cannot compile). The format tree's vocabulary is
xgrammar's, which grows: a node of a type the gateway does not know is passed on, bounded by size and depth.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.structured.bounds import Bounds, ConstraintInvalid, Offload, check_size, json_depth, too_deep
from gateway.structured.checks import check_grammar, check_patterns, check_regex

WRAPPER_NESTING = 16  # vLLM's STRUCTURAL_TAG_WRAPPER_NESTING: levels a tag may add around its schemas
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
    depth, where, _ = json_depth(value, limit)
    if depth > limit:
        raise too_deep("structural tag", f" (objects and arrays, at {where[:200] or '/'})", param, limit)
    try:
        text = orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        raise ConstraintInvalid(f"{param} is not a JSON object", param) from None
    check_size(len(text), "structural tag", param, bounds)
    if "structures" in value:
        _check_legacy(value, param, bounds)
    elif isinstance(value.get("format"), dict):
        _check_format(value["format"], f"{param}.format", bounds)
    else:
        raise ConstraintInvalid(f"{param} must have a 'format' object, or 'structures' and 'triggers'", param)
    return value


def at_least_one(tag: dict[str, Any]) -> bool:
    """Whether a legacy tag asks for at least one tagged stretch (SGLang reads it; vLLM has no such field)."""
    return "structures" in tag and tag.get("at_least_one") is True


def _check_legacy(tag: dict[str, Any], param: str, bounds: Bounds) -> None:
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
        _check_schema(structure["schema"], f"{where}.schema", bounds)


def _check_format(root: dict[str, Any], param: str, bounds: Bounds) -> None:
    """Every node of xgrammar's format tree that carries a schema, regex or grammar, checked as such."""
    stack: list[tuple[Any, str]] = [(root, param)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if not isinstance(kind, str):
            raise ConstraintInvalid(f"{where} must be a format object with a 'type'", where)
        if kind in _SCHEMA_NODES:
            field = _SCHEMA_NODES[kind]
            schema = node.get(field)
            if not isinstance(schema, dict | bool):
                raise ConstraintInvalid(f"{where}.{field} must be a JSON schema", f"{where}.{field}")
            if isinstance(schema, dict):
                _check_schema(schema, f"{where}.{field}", bounds)
            continue
        try:
            if kind == "regex":
                check_regex(node.get("pattern"), f"{where}.pattern", bounds, inline=True)
            elif kind == "grammar":
                check_grammar(node.get("grammar"), "ebnf", f"{where}.grammar", bounds, inline=True)
        except Offload:
            pass  # (bounded by size and nesting already; the engine's own validation judges the rest)
        for key, child in node.items():
            if isinstance(child, dict | list):
                stack.append((child, f"{where}.{key}"))


def _check_schema(schema: dict[str, Any], param: str, bounds: Bounds) -> None:
    """As a tool's parameter schema is: nesting and regexes, no metaschema check (xgrammar judges it)."""
    depth, where, _ = json_depth(schema, bounds.max_nesting)
    if depth > bounds.max_nesting:
        raise too_deep("JSON schema", f" (objects and arrays, at {where[:200] or '/'})", param, bounds.max_nesting)
    check_patterns(schema, param, bounds)
