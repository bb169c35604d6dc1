"""Sampling a structural tag (vLLM, SGLang: xgrammar's ``StructuralTag``): text in which each tagged stretch is
``begin``, content satisfying the tag's format, ``end``.

The emulated model always writes one tagged stretch and nothing around it: output every engine's decoder would
accept for the tag, whether or not it asks for ``at_least_one`` (free text between tags is allowed, never
required). Legacy form (``structures`` and ``triggers``): one structure, ``begin`` + JSON satisfying its schema +
``end``. Format tree: ``const_string``, ``json_schema``, ``regex``, ``grammar`` (xgrammar EBNF), ``sequence``,
``or``, ``tag``, ``any_text`` (empty), ``triggered_tags`` and ``tags_with_separator`` (one of their tags);
anything else (``qwen_xml_parameter``, newer xgrammar formats) raises ConstraintError, a 400 from the
emulator where the engine would have generated.
"""

from __future__ import annotations

import json
import random
from typing import Any

from gateway.structured.syntax import ConstraintError

from .grammar_sample import ebnf_sample
from .json_gen import json_instance
from .regex_sample import regex_sample

_MAX_DEPTH = 64


def structural_tag_sample(tag: Any, rng: random.Random) -> str:
    if not isinstance(tag, dict):
        raise ConstraintError("a structural tag must be an object")
    if tag.get("structures") is not None:
        structures = tag["structures"]
        if not isinstance(structures, list) or not structures:
            raise ConstraintError("a legacy structural tag needs structures")
        one = structures[rng.randrange(len(structures))]
        if not isinstance(one, dict) or not isinstance(one.get("begin"), str) or not isinstance(one.get("end"), str):
            raise ConstraintError("each structure of a structural tag needs a begin and an end")
        schema = one.get("schema")
        return f"{one['begin']}{json.dumps(json_instance(schema if isinstance(schema, dict) else {}, rng))}{one['end']}"
    return _format(tag.get("format"), rng, 0)


def _format(node: Any, rng: random.Random, depth: int) -> str:
    if depth > _MAX_DEPTH or not isinstance(node, dict):
        raise ConstraintError("a structural tag format must be an object (nested at most 64 deep)")
    kind = node.get("type")
    if kind == "const_string":
        return str(node.get("value", ""))
    if kind == "json_schema":
        schema = node.get("json_schema")
        return json.dumps(json_instance(schema if isinstance(schema, dict) else {}, rng))
    if kind == "regex":
        return regex_sample(node.get("pattern", ""), rng)
    if kind == "grammar":
        return ebnf_sample(node.get("grammar", ""), rng)
    if kind == "any_text":
        return ""
    if kind == "sequence":
        return "".join(_format(element, rng, depth + 1) for element in node.get("elements", []))
    if kind == "or":
        elements = node.get("elements") or []
        if not elements:
            raise ConstraintError("an 'or' format needs elements")
        return _format(elements[rng.randrange(len(elements))], rng, depth + 1)
    if kind == "tag":
        end = node.get("end", "")
        end = end[0] if isinstance(end, list) and end else end  # (newer xgrammar: several ends)
        return f"{node.get('begin', '')}{_format(node.get('content'), rng, depth + 1)}{end}"
    if kind in ("triggered_tags", "tags_with_separator"):
        tags = node.get("tags") or []
        if not tags:
            raise ConstraintError(f"a {kind} format needs tags")
        return _format({"type": "tag", **tags[rng.randrange(len(tags))]}, rng, depth + 1)
    raise ConstraintError(f"the emulator cannot write a structural tag format of type {kind!r}")
