"""Validating a constraint's content with bounded work: limits first, by linear scans, then validation whose
cost is linear in the (already bounded) input.

On the event loop (``inline=True``) a check does about a millisecond of work at most: past the sizes
measured to cost that much it raises Offload before starting, and the caller has a worker process do it
(offload.py) under the validation deadline. Measured costs on a 2-core machine: parsing a regex ~0.4 us a
character; jsonschema's metaschema check ~2 us a byte of schema; parsing, analysing and converting a
grammar ~0.9 us a character. Inline verdicts are memoised: clients send the same constraint each request.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Literal
from urllib.parse import unquote

import orjson

from gateway.structured.bounds import (
    Bounds,
    Code,
    ConstraintInvalid,
    Offload,
    Trail,
    check_size,
    json_depth,
    pointer,
    too_deep,
    utf8_size,
)
from gateway.structured.regex_cost import parsed_compile_cost
from gateway.structured.syntax import (
    ConstraintError,
    ConstraintTooDeep,
    ConstraintTooLarge,
    automaton_problem,
    ebnf_as_gbnf,
    expansion_problem,
    first_cycle,
    forget_prepared,
    gbnf_to_ebnf,
    llama_parses,
    parse_grammar,
    regex_nesting,
)
from gateway.structured.syntax.grammar_ast import Grammar
from gateway.structured.syntax.parses import (
    INLINE_BUDGET,
    MAX_PARSES,
    NESTING_BUDGET,
    NESTING_INLINE,
    WORKER_BUDGET,
    WORKER_SECONDS,
    Unfollowed,
    most_parses,
    nesting_problem,
    parses_problem,
)

_parser: Any = importlib.import_module("re._parser")

Dialect = Literal["gbnf", "ebnf", "lark"]
Renderings = tuple[tuple[Dialect, str], ...]

INLINE_REGEX_CHARS = 1024
INLINE_SCHEMA_BYTES = 512
INLINE_GRAMMAR_CHARS = 1024
# before a large constraint goes to a worker, the event loop looks this far for what it can refuse at once
INLINE_SCAN_CHARS = 4096  # of a regex, for nesting
INLINE_SCAN_NODES = 512  # of a schema's objects and arrays, for nesting
INLINE_COMPILE_COST = 8192  # code points the format checker's re.compile of a schema's patterns expands
# jsonschema recurses ~8 frames per level of a schema: deeper ones go to a worker, whose limit is raised
INLINE_SCHEMA_DEPTH = 64
WORKER_RECURSION_LIMIT = 6000  # 200 levels (the most max_nesting allows) need ~1,700 frames; 600 tested

# a line starting a rule: a GBNF / EBNF rule starts on a new line (an EBNF one may also follow another on its
# line: uncounted here, counted by the parser); a Lark rule or terminal always does
_BNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_.-]+[ \t]*(?:\[[^\]\n]*\])?[ \t]*::=", re.MULTILINE)
_LARK_RULE = re.compile(r"^[ \t]*[?!]*[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*:(?!:)", re.MULTILINE)
_IN_PLACE_LISTS = ("allOf", "anyOf", "oneOf")
_IN_PLACE_VALUES = ("not", "if", "then", "else")
# subschemas a schema may apply to one value through $ref, allOf, anyOf, oneOf, not and if/then/else: a ladder
# of $defs each the allOf of two $refs to the next is 2^N of them in 1.5 KB (the final sweep: N = 17 held the
# event loop 5 s checking one tool call's arguments, and engines inline references the same way). Real schemas,
# pydantic's unions of models included, apply tens.
MAX_FAN_OUT = 1000


# -- regular expressions ----------------------------------------------------------------------------------
def check_regex(pattern: Any, param: str, bounds: Bounds, inline: bool) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintInvalid(f"{param} must be a non-empty regular expression string", param)
    check_size(utf8_size(pattern), "regular expression", param, bounds)
    if inline and len(pattern) > INLINE_REGEX_CHARS:
        # a prefix nests no deeper than the whole: what it shows too deep is refused at once
        _check_nesting(pattern[:INLINE_SCAN_CHARS], param, "", bounds.max_nesting)
        raise Offload
    (_inline_regex if inline else _regex)(pattern, param, bounds.max_nesting)


def _regex(pattern: str, param: str, max_nesting: int) -> None:
    tree = _parse_regex(pattern, param, "", max_nesting)
    problem = automaton_problem(tree)
    if problem:  # constrained decoders (xgrammar, llguidance, outlines) match with automata
        raise ConstraintInvalid(f"{param}: {problem} cannot be enforced by any engine (they match with automata)",
                                param)
    problem = expansion_problem(tree)
    if problem:
        raise ConstraintInvalid(f"{param}: the regular expression has {problem}", param, "constraint_too_large")


_inline_regex = lru_cache(maxsize=512)(_regex)


def _check_nesting(pattern: str, param: str, where: str, max_nesting: int) -> None:
    deep = regex_nesting(pattern, max_nesting)
    if deep is not None:
        raise too_deep(f"regular expression{where}", f" (groups, at offset {deep})", param, max_nesting)


def _parse_regex(pattern: str, param: str, where: str, max_nesting: int) -> Any:
    """Python's parse tree of ``pattern`` (no compiling: see gateway.structured.syntax.regex)."""
    _check_nesting(pattern, param, where, max_nesting)
    try:
        return _parser.parse(pattern)
    except re.error as exc:
        raise ConstraintInvalid(f"{param} is not a valid regular expression{where}: {exc}", param) from None


# -- JSON schemas -----------------------------------------------------------------------------------------
def parse_schema(value: Any, param: str, bounds: Bounds) -> tuple[dict[str, Any], bytes]:
    """The schema (parsed when it came as a string) and its serialised form, within the size limit."""
    if isinstance(value, str):
        check_size(utf8_size(value), "JSON schema", param, bounds)
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            if "depth" in str(exc):
                raise too_deep("JSON schema", "", param, bounds.max_nesting) from None
            raise ConstraintInvalid(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise ConstraintInvalid(f"{param} must be a JSON schema object", param)
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError:  # orjson stops at 255 levels
        raise too_deep("JSON schema", "", param, bounds.max_nesting) from None
    check_size(len(text), "JSON schema", param, bounds)
    return value, text


def check_schema(schema: dict[str, Any], text: bytes, param: str, bounds: Bounds, inline: bool) -> str | None:
    """Check the schema (and ``text``, it serialised): nesting, its regexes, $ref cycles, then against its
    metaschema. Returns why llama.cpp should not take it (:func:`schema_fanout`), or None."""
    if inline and len(text) > INLINE_SCHEMA_BYTES:
        _check_depth(schema, param, bounds, INLINE_SCAN_NODES)
        raise Offload
    return (_inline_schema if inline else _schema)(text, param, bounds, inline)


def _check_depth(schema: Any, param: str, bounds: Bounds, max_nodes: int | None) -> int:
    depth, where, _ = json_depth(schema, bounds.max_nesting, max_nodes)
    if depth > bounds.max_nesting:
        raise too_deep("JSON schema", f" (objects and arrays, at {where[:200] or '/'})", param, bounds.max_nesting)
    return depth


def check_patterns(value: Any, param: str, bounds: Bounds) -> tuple[int, str | None]:
    """The schema's regexes (``pattern``, ``patternProperties``) within what engines can build automata of, as a
    regex constraint is; their compile cost, and why llama.cpp should not take one (it compiles a schema's patterns
    into its grammar, whose parse would go too many ways at once: gateway.structured.syntax.parses), or None.
    Invalid ones are left to the metaschema check (which judges them, if they are a schema's and not data that
    looks like one)."""
    compiling = 0
    budget = PATTERNS_BUDGET
    fanout: str | None = None
    for at, pattern, data in schema_patterns(value):
        try:
            tree = _parse_regex(pattern, param, f" at {at[:200]}", bounds.max_nesting)
        except ConstraintInvalid as exc:
            if exc.code != "invalid_constraint":
                raise
            continue
        problem = None if data else automaton_problem(tree)
        if problem:  # (as for a regex constraint: llama.cpp, for one, drops such a pattern and accepts any string)
            raise ConstraintInvalid(f"{param}: the pattern at {at[:200]} has {problem}, which no engine can enforce "
                                    "(they match with automata)", param)
        problem = None if data else expansion_problem(tree)
        if problem:
            raise ConstraintInvalid(f"{param}: the pattern at {at[:200]} has {problem}", param, "constraint_too_large")
        if fanout is None and not data:
            found, spent = _pattern_parses(pattern, tree, budget)
            budget -= spent
            fanout = found and f"the pattern at {at[:200]} of {param} has {found}"
        compiling += parsed_compile_cost(tree, pattern)
    return compiling, fanout


def schema_fanout(value: Any) -> str | None:
    """Why llama.cpp should not take a schema, or None: an ``enum`` whose values (or an object whose optional
    properties' names) begin alike so much, or an ``anyOf``/``oneOf`` of so many alternatives, that its grammar
    would follow too many ways at once. llama.cpp
    writes each as one flat alternation (common/json-schema-to-grammar.cpp, llama-cpp-python 0.3.36), one stack per
    alternative from its start, each kept while its value's text still matches: a value costs it the sum, over its
    characters, of the values that begin as it does up to there.

    At the start of an enum's value (or of an optional property's name) every alternative is a stack: ``n`` values
    cost each token written there ``n`` passes over the vocabulary (480 two-letter codes: 200 ms a token with a
    128k vocabulary, 2.5 plain; sweep 30). Written once, that is a few slow tokens, and the schema's such values
    together are held to MAX_ENUM_COST; where it may be written again and again (in an array, a definition a
    ``$ref`` may use, an open object's values), each is held to MAX_PARSES ways, as a union is."""
    refs = _has_ref(value)
    once = 0  # the values of the enums (and optional names) written at most once, together
    for node, trail, data in _object_trails(value):
        if data:
            continue
        at = pointer(trail, 200)
        repeats = refs or _repeats(trail)
        values = node.get("enum")
        if isinstance(values, list) and len(values) > 1:
            if repeats and len(values) > MAX_PARSES:
                return (f"the enum at {at[:200] or '/'} has {len(values)} values and may be written many times (in "
                        f"an array, a definition or an open object): llama.cpp would follow {len(values)} ways at "
                        f"once at the start of each, more than {MAX_PARSES}")
            once += 0 if repeats else len(values)
            if once > MAX_ENUM_COST:
                return (f"its enums and optional properties hold {once} values in all: llama.cpp would follow as "
                        f"many ways at once where each begins, more than {MAX_ENUM_COST} in a schema")
            cost, value_text = enum_cost([orjson.dumps(v) for v in values])
            if cost > MAX_ENUM_COST:
                return (f"the enum at {at[:200] or '/'} has {len(values)} values that begin alike: writing "
                        f"{value_text[:40]!r} llama.cpp would check every candidate token against {cost} ways in "
                        f"all, more than {MAX_ENUM_COST}")
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > 1:
            # (llama.cpp writes an object's optional properties as a choice of the one that comes next, among all
            # that may: their names begin alike as an enum's values do; 1,000 with a 40-character prefix slowed
            # another key's tokens from 3 to 524 ms, sweep 24)
            required = node.get("required")
            names = [key for key in properties if not (isinstance(required, list) and key in required)]
            if repeats and len(names) > MAX_PARSES:
                return (f"the object at {at[:200] or '/'} has {len(names)} optional properties and may be written "
                        f"many times (in an array, a definition or an open object): llama.cpp would follow "
                        f"{len(names)} ways at once where each may begin, more than {MAX_PARSES}")
            once += 0 if repeats or len(names) < 2 else len(names)
            if once > MAX_ENUM_COST:
                return (f"its enums and optional properties hold {once} values in all: llama.cpp would follow as "
                        f"many ways at once where each begins, more than {MAX_ENUM_COST} in a schema")
            cost, name = enum_cost([orjson.dumps(key) for key in names]) if len(names) > 1 else (0, "")
            if cost > MAX_ENUM_COST:
                return (f"the object at {at[:200] or '/'} has {len(names)} optional properties whose names begin "
                        f"alike: writing {name[:40]!r} llama.cpp would check every candidate token against {cost} "
                        f"ways in all, more than {MAX_ENUM_COST}")
        names = _merged_optional(value, node.get("allOf"))
        if len(names) > 1:  # (an allOf's anyOf parts: 1,500 names "required" there, ~1 s a token, sweep 28)
            cost, name = enum_cost([orjson.dumps(key) for key in names])
            if cost > MAX_ENUM_COST:
                return (f"the allOf at {at[:200] or '/'} has {len(names)} properties in its anyOf parts, which "
                        f"llama.cpp merges as optional whatever their 'required', and whose names begin alike: "
                        f"writing {name[:40]!r} it would check every candidate token against {cost} ways in all, "
                        f"more than {MAX_ENUM_COST}")
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            width = _union_width(options) if isinstance(options, list) else 0
            if width > MAX_PARSES:
                return (f"the {key} at {at[:200] or '/'} has {width} alternatives (through the unions and enums "
                        f"in it), more than {MAX_PARSES} ways llama.cpp would follow at once")
    width = _Width(value).of(value, 0)
    if width > MAX_ENUM_COST:
        shown = f"{width:,}" if width <= MAX_WIDTH else f"over {MAX_WIDTH:,}"
        return (f"its unions, enums and optional properties together may hold {shown} ways at once (each alternative "
                f"of a union with the enum or properties in it), more than {MAX_ENUM_COST}")
    return None


MAX_WIDTH = 1 << 20  # (counted to here)
# where a schema's part may be written again and again (each item of an array, each value of an open object; a
# definition, which a $ref may use in any of those)
_REPEATING = frozenset({"items", "prefixItems", "additionalItems", "contains", "additionalProperties",
                        "patternProperties", "unevaluatedItems", "unevaluatedProperties", "$defs", "definitions"})


def _repeats(trail: Trail) -> bool:
    while trail is not None:
        key, trail = trail
        if key in _REPEATING:
            return True
    return False


def _has_ref(value: Any) -> bool:
    """Whether a ``$ref`` is anywhere in the schema (a part it names may then be written from anywhere, and again)."""
    return any(not data and "$ref" in node for node, _trail, data in _object_trails(value))


class _Width:
    """The most ways llama.cpp's grammar of a schema may follow at once, counted so that none is missed: an anyOf's
    or oneOf's alternatives all at once (it writes them as one alternation, each a rule: while they begin alike all
    are followed), each with what is in it (its enum's values, its optional properties' names, a union inside, the
    widest of its properties' values and items), through local ``$ref``s. Each union, enum and object counted alone
    kept within bounds, sweep 27's schemas held their product: an anyOf of 64 objects each with an enum of 450
    through a ``$ref``, 28,800 stacks (19.6 s a token with a 128k vocabulary); 30 objects of 300 optional
    properties; 32 x 32 x 450. Alternatives told apart by their first property are counted as if they were not:
    more than exactly, never less."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.memo: dict[int, int] = {}
        self.open: set[int] = set()

    def _resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def of(self, node: Any, depth: int) -> int:
        if not isinstance(node, dict) or depth > 128:
            return 1
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        if key in self.open:  # (a recursion: its closing brackets end each level)
            return 1
        self.open.add(key)
        widths = [1]
        ref = node.get("$ref")
        if isinstance(ref, str):
            widths.append(self.of(self._resolve(ref), depth + 1))
        values = node.get("enum")
        if isinstance(values, list):
            widths.append(len(values))
        pattern = node.get("pattern")
        if isinstance(pattern, str):  # (as its search found it, check_patterns having run first: 64 strings of a
            # 47-way pattern in a union held ~3,000 stacks, each counted 1, sweep 28)
            widths.append(_pattern_ways.get(pattern, 1))
        types = node.get("type")
        if isinstance(types, list):
            widths.append(len(types))
        for union in ("anyOf", "oneOf"):
            options = node.get(union)
            if isinstance(options, list):
                total = 0
                for option in options:
                    total = min(MAX_WIDTH + 1, total + self.of(option, depth + 1))
                widths.append(total)
        parts = node.get("allOf")
        if isinstance(parts, list):
            widths.extend(self.of(part, depth + 1) for part in parts)
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            widths.append(sum(1 for name in properties if not (isinstance(required, list) and name in required)))
            widths.extend(self.of(child, depth + 1) for child in properties.values())
        for field in ("items", "additionalItems", "additionalProperties", "contains", "not"):
            widths.append(self.of(node.get(field), depth + 1))
        for field in ("prefixItems", "items"):  # (a list of items is a draft-07 tuple, as prefixItems: sweep 28)
            listed = node.get(field)
            if isinstance(listed, list):
                widths.extend(self.of(item, depth + 1) for item in listed)
        self.open.discard(key)  # (definitions count where they are used, through $ref)
        width = min(max(widths), MAX_WIDTH + 1)
        self.memo[key] = width
        return width


def _union_width(options: list[Any]) -> int:
    """The alternatives llama.cpp's grammar of a union starts with, all at once: a union's alternatives, each
    alternative that is itself a union or an enum counted by its own (an anyOf of 30 anyOfs of 30 consts held 900
    stacks through their common beginning, sweep 25). Counted to MAX_PARSES + 1."""
    width, todo = 0, list(options)
    while todo and width <= MAX_PARSES:
        option = todo.pop()
        inner = [option.get(k) for k in ("anyOf", "oneOf")] if isinstance(option, dict) else []
        nested = [o for union in inner if isinstance(union, list) for o in union]
        values = option.get("enum") if isinstance(option, dict) else None
        if nested:
            todo.extend(nested)
        elif isinstance(values, list) and values:
            width += len(values)
        else:
            width += 1
    return width


# what one enum value may cost llama.cpp's grammar sampler in stacks summed over its characters: 64 values
# alike for 16 characters (250 country names: ~520; 1,000 ids "customer-NNNN": ~10,000)
MAX_ENUM_COST = 1024


def enum_cost(texts: list[bytes]) -> tuple[int, str]:
    """The most stacks summed over its characters that writing one of ``texts`` costs (each alternative is a
    stack from the start; each stays while the text written matches its value), and that value. A trie counts
    the values through each beginning: linear in the values' length."""
    root: dict[int, Any] = {}
    counts: dict[int, int] = {}
    for text in texts:
        node = root
        for byte in text:
            node = node.setdefault(byte, {})
            counts[id(node)] = counts.get(id(node), 0) + 1
    worst, worst_text = 0, b""
    for text in texts:
        node, cost = root, len(texts)
        for byte in text[:-1]:  # (after its last character the value is done)
            node = node[byte]
            cost += counts[id(node)]
        if cost > worst:
            worst, worst_text = cost, text
    return worst, worst_text.decode(errors="replace")


# what searching a schema's patterns for llama.cpp's parses may spend in all (simple patterns take tens of steps)
PATTERNS_BUDGET = 8_000  # (~30 ms; a pattern of 1,000 characters counted 50 times 20 takes ~4,700)
_pattern_verdicts: dict[str, tuple[str | None, int]] = {}
_pattern_ways: dict[str, int] = {}  # the ways at once a pattern's parse was found to go (for _Width)


def _pattern_parses(pattern: str, tree: Any, budget: int) -> tuple[str | None, int]:
    """(what makes llama.cpp's parse of ``pattern`` go too many ways at once, or None; what the search spent),
    memoised by pattern: a schema's many equal patterns, and every request's same schema, are searched once. A
    search that cannot end within ``budget`` (what is left of its schema's) is no verdict, and says so: decoys
    placed first could spend it (sweep 24)."""
    known = _pattern_verdicts.get(pattern)
    if known is not None:
        return known[0], 0
    if budget <= 0:
        return f"a parse the gateway did not follow (its schema's {PATTERNS_BUDGET:,} steps were spent)", 0
    found = llama_parses(tree, budget)
    if found is None:
        return None, 0
    if not found.complete:
        return f"a parse the gateway could not follow within {budget:,} steps", found.spent
    verdict = parses_problem(found), found.spent
    if len(_pattern_verdicts) >= 4096:
        _pattern_verdicts.clear()
        _pattern_ways.clear()
    _pattern_verdicts[pattern] = verdict
    _pattern_ways[pattern] = found.count
    return verdict


def _schema(text: bytes, param: str, bounds: Bounds, inline: bool) -> str | None:
    value = orjson.loads(text)
    if _check_depth(value, param, bounds, None) > INLINE_SCHEMA_DEPTH and inline:
        raise Offload
    compiling, fanout = check_patterns(value, param, bounds)
    if inline and compiling > INLINE_COMPILE_COST:
        raise Offload
    problem = _unsatisfiable(value)
    if problem:
        raise ConstraintInvalid(f"{param}: {problem}", param)
    check_fan_out(value, param)
    from jsonschema.validators import validator_for

    error = next(_metaschema_validator(validator_for(value)).iter_errors(value), None)
    if error is not None:
        where = "/".join(str(p) for p in error.path)
        raise ConstraintInvalid(f"{param} is not a valid JSON schema: {error.message}"
                                + (f" (at {where})" if where else ""), param)
    return fanout or schema_fanout(value)


_inline_schema = lru_cache(maxsize=256)(_schema)


@lru_cache(maxsize=8)
def _metaschema_validator(cls: Any) -> Any:
    """What ``cls.check_schema`` builds on every call: the metaschema's validator, with format checks (the
    ``regex`` format compiles every ``pattern``, hence the checks on them first)."""
    return cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)


# keywords whose values are instances (data), not schemas: a "pattern" key inside them is not a regex to enforce
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


def _objects(root: Any) -> Iterator[tuple[dict[str, Any], str, bool]]:
    """Every object in the schema, with its JSON pointer and whether it sits inside data (``const``, ``enum``,
    ``default``, ``examples``: instances, not schemas)."""
    for node, trail, data in _object_trails(root):
        yield node, pointer(trail, 200), data


def _object_trails(root: Any) -> Iterator[tuple[dict[str, Any], Trail, bool]]:
    """As :func:`_objects`, each with its path as a trail (written out only where needed: a string per object
    copied its parent's, quadratic in a deep chain of long keys)."""
    stack: list[tuple[Any, Trail, bool]] = [(root, None, False)]
    while stack:
        node, trail, data = stack.pop()
        if isinstance(node, dict):
            yield node, trail, data
            stack.extend((child, (key, trail), data or key in _DATA_KEYWORDS) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, (index, trail), data) for index, child in enumerate(node))


def schema_patterns(root: Any) -> Iterator[tuple[str, str, bool]]:
    """(JSON pointer, regex, whether it sits inside data) for every ``pattern`` and ``patternProperties`` key in
    the schema. Inside data it is not the schema's own."""
    for node, trail, data in _object_trails(root):
        if isinstance(node.get("pattern"), str):
            yield f"{pointer(trail, 200)}/pattern", node["pattern"], data
        if isinstance(node.get("patternProperties"), dict):
            at = pointer(trail, 200)
            yield from ((f"{at}/patternProperties", key, data) for key in node["patternProperties"])


_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
           ("minimum", "maximum"))
_TYPE_OF: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _unsatisfiable(root: Any) -> str | None:
    """What in a (metaschema-shaped) schema no engine can honour, or None: a ``$ref`` that is not a local JSON
    pointer (engines fetch nothing) or that points nowhere, a lower bound above its upper bound, an ``enum`` or
    ``const`` none of whose values has the declared ``type``. Engines refuse such schemas, each in its own words,
    or (TabbyAPI) skip them and generate unconstrained output. Data is not checked."""
    for node, at, data in _objects(root):
        if data:
            continue
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref != "#" and not ref.startswith("#/"):
                return (f"$ref {ref[:200]!r} at {at or '/'} is not a local JSON pointer ('#/...'); engines resolve "
                        "no other reference")
            if _resolve(root, ref) is None:
                return f"$ref {ref[:200]!r} at {at or '/'} points at nothing in the schema"
        for low, high in _BOUNDS:
            lo, hi = node.get(low), node.get(high)
            if (isinstance(lo, int | float) and isinstance(hi, int | float) and not isinstance(lo, bool)
                    and not isinstance(hi, bool) and lo > hi):
                return f"{low} {lo} is above {high} {hi} at {at or '/'}: no value satisfies it"
        kinds = node.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if isinstance(kinds, list) and all(isinstance(k, str) and k in _TYPE_OF for k in kinds):
            values = node["enum"] if isinstance(node.get("enum"), list) else (
                [node["const"]] if "const" in node else None)
            if values is not None and not any(_TYPE_OF[k](v) for v in values for k in kinds):
                which = "enum" if isinstance(node.get("enum"), list) else "const"
                return f"no {which} value at {at or '/'} is of its type {'/'.join(kinds)}: no value satisfies it"
    return None


def _merged_optional(root: Any, parts: Any) -> list[str]:
    """The property names an ``allOf`` of ``parts`` leaves optional as llama.cpp merges it into one object
    (common/json-schema-to-grammar.cpp): those of its parts' ``anyOf`` alternatives (through a local ``$ref`` each),
    whatever their ``required``."""
    if not isinstance(parts, list):
        return []
    names: list[str] = []
    for part in parts:
        options = part.get("anyOf") if isinstance(part, dict) else None
        for option in options if isinstance(options, list) else ():
            ref = option.get("$ref") if isinstance(option, dict) else None
            if isinstance(ref, str) and ref.startswith("#"):
                option = _resolve(root, ref)
            properties = option.get("properties") if isinstance(option, dict) else None
            if isinstance(properties, dict):
                names.extend(properties)
    return names


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for raw in unquote(ref[1:]).split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_fan_out(schema: Any, param: str) -> None:
    """Refuse a schema that applies itself to one value without end (a cycle of ``$ref``s and applicators that
    never descends into the value) or more than MAX_FAN_OUT times (ConstraintInvalid)."""
    cycle, fan = in_place_fan_out(schema)
    if cycle:
        raise ConstraintInvalid(f"{param} is not a valid JSON schema: $ref cycle {' -> '.join(cycle)} (a schema "
                                "that refers back to itself without descending into the value)", param)
    if fan > MAX_FAN_OUT:
        raise ConstraintInvalid(f"{param}: the schema applies more than {MAX_FAN_OUT} subschemas to one value "
                                "(through $ref, allOf, anyOf, oneOf, not and if/then/else); this gateway accepts at "
                                f"most {MAX_FAN_OUT}", param, "constraint_too_large")


def in_place_fan_out(root: Any) -> tuple[list[str], int]:
    """(a cycle of schemas each applying the next to the same value, as JSON pointers, else []; the most
    subschemas any schema in it applies to one value, itself included, counted to MAX_FAN_OUT + 1). Linear in the
    schema's objects."""
    trails, nexts = _in_place_graph(root)
    cycle = first_cycle(nexts)
    if cycle:
        return ["#" + pointer(trails[n], 200) for n in cycle[:20]], 0
    paths: dict[int, int] = {}
    for start in nexts:  # (a DAG now: each node's count once its targets' are known, without recursion)
        stack = [(start, False)]
        while stack:
            node, ready = stack.pop()
            if node in paths:
                continue
            if ready:
                paths[node] = min(MAX_FAN_OUT + 1, 1 + sum(paths[t] for t in nexts[node]))
                continue
            stack.append((node, True))
            stack.extend((t, False) for t in nexts[node] if t not in paths)
    return [], max(paths.values(), default=1)


def _in_place_graph(root: Any) -> tuple[dict[int, Trail], dict[int, list[int]]]:
    """Every schema object (by id: its path) and the ones it applies to the same value (``$ref`` to a
    local JSON pointer, ``allOf``/``anyOf``/``oneOf``, ``not``, ``if``/``then``/``else``)."""
    trails: dict[int, Trail] = {}
    nexts: dict[int, list[int]] = {}
    stack: list[tuple[Any, Trail]] = [(root, None)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, list):
            stack.extend((child, (i, at)) for i, child in enumerate(node))
            continue
        if not isinstance(node, dict) or id(node) in trails:
            continue
        trails[id(node)] = at
        targets = [node[key] for key in _IN_PLACE_VALUES if key in node]
        targets += [item for key in _IN_PLACE_LISTS if isinstance(node.get(key), list) for item in node[key]]
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            targets.append(_resolve(root, ref))
        nexts[id(node)] = [id(t) for t in targets if isinstance(t, dict)]
        stack.extend((child, (key, at)) for key, child in node.items())
    return trails, nexts


# -- grammars ---------------------------------------------------------------------------------------------
def check_grammar(text: Any, dialect: Dialect, param: str, bounds: Bounds, inline: bool,
                  llama: bool = True) -> tuple[Renderings, str | None]:
    """The grammar written in each dialect it can be faithfully written in, its own first; and, where it may go to
    llama.cpp (``llama``: in GBNF, or EBNF that is GBNF too), why llama.cpp should not take it, or None."""
    if not isinstance(text, str) or not text.strip():
        raise ConstraintInvalid(f"{param} must be a non-empty grammar string", param)
    check_size(utf8_size(text), f"{dialect.upper()} grammar", param, bounds)
    if inline and len(text) > INLINE_GRAMMAR_CHARS:
        rules = len((_LARK_RULE if dialect == "lark" else _BNF_RULE).findall(text))  # C speed, never too many
        if rules > bounds.max_rules:
            raise ConstraintInvalid(f"{param}: the {dialect.upper()} grammar has {rules} rules; this gateway accepts "
                                    f"at most limits.max_grammar_rules = {bounds.max_rules}", param,
                                    "constraint_too_large")
        raise Offload
    return (_inline_grammar if inline else _grammar)(text, dialect, param, bounds, llama=llama)


def _grammar(text: str, dialect: Dialect, param: str, bounds: Bounds, inline: bool = False,
             llama: bool = True) -> tuple[Renderings, str | None]:
    try:
        grammar = parse_grammar(text, dialect, bounds.max_nesting, bounds.max_rules)
    except ConstraintTooDeep as exc:
        raise ConstraintInvalid(f"{param}: {exc}; this gateway accepts at most limits.max_nesting = "
                                f"{bounds.max_nesting}", param, "constraint_too_deep") from None
    except ConstraintTooLarge as exc:
        raise ConstraintInvalid(f"{param}: {exc}; this gateway accepts at most limits.max_grammar_rules = "
                                f"{bounds.max_rules}", param, "constraint_too_large") from None
    except ConstraintError as exc:
        raise ConstraintInvalid(f"{param} is not a valid {dialect.upper()} grammar: {exc}", param) from None
    renderings: list[tuple[Dialect, str]] = [(dialect, text)]
    as_llama = grammar if dialect == "gbnf" else None
    try:
        if dialect == "gbnf":  # -> xgrammar EBNF, always faithful (see gateway.structured.syntax.convert)
            renderings.append(("ebnf", gbnf_to_ebnf(text, bounds.max_nesting, bounds.max_rules)))
        elif dialect == "ebnf":  # -> GBNF when llama.cpp reads the same grammar from the text
            as_gbnf = ebnf_as_gbnf(text, bounds.max_nesting, bounds.max_rules)
            if as_gbnf is not None:
                renderings.append(("gbnf", as_gbnf))
                as_llama = parse_grammar(as_gbnf, "gbnf", bounds.max_nesting, bounds.max_rules)
    except ConstraintError:
        pass
    fanout = _llama_parses(as_llama, inline) if llama and as_llama is not None else None
    return tuple(renderings), fanout and f"the grammar of {param} has {fanout}"


def _llama_parses(grammar: Grammar, inline: bool) -> str | None:
    """What makes llama.cpp's parse of ``grammar`` go too many ways at once, or None; Offload when the event
    loop's share of the search ran out before it ended."""
    try:  # (from the grammar alone: no search tells a recursion's levels apart)
        growing = nesting_problem(grammar, NESTING_INLINE if inline else NESTING_BUDGET)
    except Unfollowed:
        if inline:
            raise Offload from None
        return (f"recursions the gateway could not follow within {NESTING_BUDGET:,} steps (whether their stacks grow "
                "with the depth they nest)")
    if growing is not None:
        return growing
    found = most_parses(grammar, INLINE_BUDGET, seconds=None) if inline else (
        most_parses(grammar, WORKER_BUDGET, seconds=WORKER_SECONDS))
    if not found.complete:  # (an unfinished search is no verdict: a grammar could hide its fan-out behind decoys)
        if inline:
            raise Offload
        return (f"a parse the gateway could not follow within {WORKER_BUDGET:,} steps or {WORKER_SECONDS:g} s of a "
                "core (llama.cpp's own example grammars take at most 92,000 steps)")
    return parses_problem(found)


_inline_grammar = lru_cache(maxsize=128)(partial(_grammar, inline=True))


# -- choices ----------------------------------------------------------------------------------------------
def check_choices(value: Any, param: str, bounds: Bounds) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ConstraintInvalid(f"{param} must be a non-empty array of strings", param)
    check_size(sum(utf8_size(v) for v in value), "list of choices", param, bounds)
    return tuple(value)


# -- in a worker process ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Verdict:
    """A check's outcome as plain data (it comes back from a worker process)."""

    renderings: Renderings = ()
    problem: str | None = None  # the ConstraintInvalid message when not valid
    code: Code = "invalid_constraint"
    fanout: str | None = None  # why llama.cpp should not take it (Constraint.fanout)


def prepare_worker() -> None:
    """Worker-process set-up: room for the deepest schema max_nesting allows (jsonschema recurses), and one
    small check of each kind, so that what the first check would build lazily (jsonschema's metaschema
    validator and format checker, the regex and grammar parsers' tables: ~50 ms) is built before the worker
    says it is ready and not against a client's deadline."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), WORKER_RECURSION_LIMIT))
    bounds = Bounds(max_nesting=16, max_bytes=4096, max_rules=16)
    schema = b'{"type":"object","properties":{"a":{"type":"string","pattern":"^[a-z]+$"}},"required":["a"]}'
    run_check("json_schema", schema, "gbnf", "warm-up", bounds)
    run_check("regex", "[a-z]+(,[0-9]{1,3})?", "gbnf", "warm-up", bounds)
    run_check("grammar", 'root ::= "a" [b-c]* ("," [0-9]+)?', "gbnf", "warm-up", bounds)


def run_check(kind: str, payload: Any, dialect: Dialect, param: str, bounds: Bounds) -> Verdict:
    """One whole check of a constraint (``kind``: json_schema, regex, grammar or structural_tag; or a request's
    tools) without the event loop's budget: it runs in a worker process."""
    try:
        if kind == "structural_tag":
            from gateway.structured.structural_tag import check_tag_nodes  # (it builds on this module's checks)

            check_tag_nodes(orjson.loads(payload), param, bounds, inline=False)
        elif kind == "json_schema":
            text = payload.encode() if isinstance(payload, str) else payload
            return Verdict(fanout=check_schema(orjson.loads(text), text, param, bounds, inline=False))
        elif kind == "regex":
            check_regex(payload, param, bounds, inline=False)
        elif kind == "tools":
            from gateway.structured.constraint import check_tools  # (it builds on this module's checks)

            text = payload.encode() if isinstance(payload, str) else payload
            return Verdict(fanout=check_tools(text, bounds))
        else:
            renderings, fanout = check_grammar(payload, dialect, param, bounds, inline=False)
            return Verdict(renderings, fanout=fanout)
    except ConstraintInvalid as exc:
        return Verdict(problem=str(exc), code=exc.code)
    except RecursionError:  # the limits keep every input shallow enough (tests/structured); a last line only
        return Verdict(problem=f"{param}: nested too deeply to validate", code="constraint_too_deep")
    finally:
        forget_prepared()  # a worker sees large grammars in turn: keeping 128 of them could take gigabytes
    return Verdict()
