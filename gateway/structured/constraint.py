"""One constraint per request, whatever field it arrived in.

Accepted spellings (at most one constraint per request, as vLLM and SGLang require):

* OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``; vLLM's and SGLang's ``{"type": "structural_tag", ...}`` (see
  ``structural_tag``); ``tools`` with ``tool_choice`` ``"required"`` or a named function
  (a forced tool call), or tools marked ``strict: true`` under ``tool_choice: "auto"``.
* The gateway's own: ``regex``, ``choice`` (a list of strings), ``grammar`` with ``grammar_syntax``
  (``gbnf``, the default, ``ebnf`` for xgrammar's EBNF, or ``lark``), ``json_schema`` (object or string).
* vLLM: ``structured_outputs: {json | json_object | regex | choice | grammar | structural_tag}``, with its
  options (``disable_any_whitespace``, ``disable_additional_properties``, ``whitespace_pattern``: only vLLM has
  them, so a request that sets one is routed to vLLM alone; see ``Constraint.requires``), and its removed
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (which vLLM itself ignores
  with a 200; the gateway honours them instead).
* SGLang: ``json_schema`` (a JSON string), ``regex``, ``ebnf``.
* llama.cpp: ``json_schema`` (an object), ``grammar`` (GBNF).
* TabbyAPI: ``json_schema``, ``regex_pattern``, ``grammar_string`` (GBNF if it contains ``::=``, else Lark).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

import orjson

from gateway.config import LimitSettings
from gateway.structured.bounds import Bounds, ConstraintInvalid, Offload, check_size, json_depth, too_deep
from gateway.structured.checks import (
    INLINE_REGEX_CHARS,
    MAX_ENUM_COST,
    Dialect,
    Renderings,
    check_choices,
    check_fan_out,
    check_grammar,
    check_patterns,
    check_regex,
    check_schema,
    enum_cost,
    parse_schema,
    schema_fanout,
)
from gateway.structured.structural_tag import at_least_one, check_tag_nodes, parse_tag
from gateway.structured.syntax.choice import widest_branch
from gateway.structured.syntax.parses import MAX_PARSES

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag", "tool_call",
               "strict_tools"]

# vLLM's StructuredOutputsParams options (0.23-0.34 sampling_params.py): not constraints, but how it enforces one;
# each is also the support word of the engines that honour it (gateway.structured.support)
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")

# every request field that carries a constraint in some dialect; all are removed before the adapter writes
# the engine's own
CONSTRAINT_FIELDS = (
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "json_schema", "regex", "ebnf", "grammar",
    "grammar_syntax", "choice", "regex_pattern", "grammar_string",
)
_DEFAULT_BOUNDS = Bounds.of(LimitSettings())

__all__ = ["CONSTRAINT_FIELDS", "OPTIONS", "Constraint", "ConstraintInvalid", "Dialect", "Kind", "extract",
           "tools_fanout"]


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: Kind
    source: str  # the field it came from, for messages
    schema: Any = None  # json_schema
    strict: bool = False
    name: str = "response"
    pattern: str = ""  # regex
    choices: tuple[str, ...] = ()  # choice
    grammar: str = ""
    dialect: Dialect = "gbnf"
    # grammar: its text in each dialect it can be faithfully written in, its own first (found by validation)
    renderings: Renderings = ()
    # the field whose validation was too much work for the event loop and waits for a worker process
    # (gateway.api.validation.validate_heavy); None once validated
    pending: str | None = None
    # a choice or grammar in a request that offers tools the model may call (tool_choice not "none")
    beside_tools: bool = False
    tag: Any = None  # structural_tag: the object, {"type": "structural_tag", ...} (see structural_tag.py)
    # vLLM's structured_outputs options the client set (name, value), carried to vLLM with the constraint
    options: tuple[tuple[str, Any], ...] = ()
    # why llama.cpp should not take it: a grammar, pattern or enum whose parse there would go too many ways at once
    # (gateway.structured.syntax.parses, checks.schema_fanout; RouteRequest.fanout)
    fanout: str | None = None

    @property
    def best_effort(self) -> bool:
        """Whether the constraint goes where it is honoured when such an engine serves the model, and elsewhere
        (unenforced, checked after the fact) when none does, rather than being refused. Strict tools under
        ``tool_choice: "auto"`` are: agent SDKs mark every tool strict by default (the Agents SDK's
        ``@function_tool``), and refusing them locked those agents out of every self-hosted engine."""
        return self.kind == "strict_tools"

    @property
    def requires(self) -> frozenset[str]:
        """Support words beyond the kind that an engine must have to honour this constraint as asked: each option
        set, and ``at_least_one`` for a legacy structural tag that asks for it (an engine without them would
        drop them silently)."""
        words = {name for name, _ in self.options}
        if self.kind == "structural_tag" and at_least_one(self.tag):
            words.add("at_least_one")
        return frozenset(words)

    def describe(self) -> str:
        beside = " beside tools" if self.beside_tools else ""
        extra = "".join(f" with {word}" for word in sorted(self.requires))
        if self.kind == "grammar":
            return f"grammar ({self.dialect}, from {self.source}){extra}{beside}"
        return f"{self.kind} (from {self.source}){extra}{beside}"


def _schema(source: str, value: Any, param: str, bounds: Bounds, **extra: Any) -> Constraint:
    schema, text = parse_schema(value, param, bounds)
    try:
        fanout = check_schema(schema, text, param, bounds, inline=True)
    except Offload:
        return Constraint("json_schema", source, schema=schema, pending=param, **extra)
    return Constraint("json_schema", source, schema=schema, fanout=fanout, **extra)


def _tag(source: str, value: Any, param: str, bounds: Bounds) -> Constraint:
    """A structural tag: its shape checked here, what its nodes carry here too when that is little, else in a
    validation worker (``pending``)."""
    tag = parse_tag(value, param, bounds)
    try:
        check_tag_nodes(tag, param, bounds, inline=True)
    except Offload:
        return Constraint("structural_tag", source, tag=tag, pending=param)
    return Constraint("structural_tag", source, tag=tag)


def _regex(source: str, value: Any, param: str, bounds: Bounds) -> Constraint:
    try:
        check_regex(value, param, bounds, inline=True)
    except Offload:
        return Constraint("regex", source, pattern=value, pending=param)
    return Constraint("regex", source, pattern=value)


def _choices(source: str, value: Any, param: str, bounds: Bounds) -> Constraint:
    choices = check_choices(value, param, bounds)
    ways = widest_branch(choices)  # (llama.cpp gets them as a tree of their common beginnings: one stack a branch)
    fanout = f"the choices of {param} part {ways} ways at once, more than {MAX_PARSES}" if ways > MAX_PARSES else None
    return Constraint("choice", source, choices=choices, fanout=fanout)


def _bnf_or(value: Any, otherwise: Dialect, bnf: Dialect) -> Dialect:
    """The dialect a field that takes either kind holds: BNF-like when it has a ``::=``."""
    return bnf if isinstance(value, str) and "::=" in value else otherwise


def _grammar(source: str, value: Any, dialect: Dialect, param: str, bounds: Bounds) -> Constraint:
    try:
        renderings, fanout = check_grammar(value, dialect, param, bounds, inline=True)
    except Offload:
        return Constraint("grammar", source, grammar=value, dialect=dialect, pending=param)
    return Constraint("grammar", source, grammar=value, dialect=dialect, renderings=renderings, fanout=fanout)


def _from_response_format(rf: Any, bounds: Bounds) -> Constraint | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ConstraintInvalid("response_format must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "response_format")
    if kind == "structural_tag":
        return _tag("response_format", rf, "response_format", bounds)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintInvalid("response_format.json_schema must be an object with a 'schema'",
                                    "response_format.json_schema")
        return _schema("response_format", spec["schema"], "response_format.json_schema.schema", bounds,
                       strict=spec.get("strict") is True, name=str(spec.get("name") or "response"))
    raise ConstraintInvalid(f"response_format.type must be text, json_object, json_schema or structural_tag, not "
                            f"{kind!r}",
                            "response_format.type")


def _from_tools(body: dict[str, Any], bounds: Bounds) -> Constraint | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        return None
    # every tool's parameter schema is bounded, whatever the tool_choice: an engine may compile any of them into
    # a grammar (a forced or strict call; llama.cpp builds a lazy grammar of every tool for an optional call too)
    try:
        fanout = _bound_parameters(tools, bounds, inline=True)
    except Offload:  # (too much for the event loop: parse_body's tools_fanout leaves them to a worker)
        fanout = None
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
        return Constraint("tool_call", "tool_choice", fanout=fanout)
    strict = {t["function"]["name"]: t["function"].get("parameters")
              for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
              and t["function"].get("strict") is True and isinstance(t["function"].get("name"), str)}
    if strict and choice in (None, "auto"):
        # (schema: each strict tool's parameters by name, for the check after the fact)
        return Constraint("strict_tools", "tools[].function.strict", schema=strict, fanout=fanout)
    return None


def tools_fanout(tools: Any, limits: LimitSettings | None = None, inline: bool = False) -> str | None:
    """Why llama.cpp should not take a request offering ``tools`` (bounded by it: ConstraintInvalid where they are
    not): it builds a grammar of every tool's parameters, a lazy one for an optional call, whose parse would go too
    many ways at once (Constraint.fanout); None if it may. ``inline`` (on the event loop): Offload when checking them
    would hold it too long, for a worker process to do (:func:`check_tools`)."""
    return _bound_parameters(tools, _DEFAULT_BOUNDS if limits is None else Bounds.of(limits), inline)


def check_tools(payload: bytes, bounds: Bounds) -> str | None:
    """:func:`tools_fanout` of the tools in ``payload`` (their JSON), whatever it takes: in a worker process."""
    return _bound_parameters(orjson.loads(payload), bounds, inline=False)


# what checking the tools' parameter schemas may take on the event loop: a schema past INLINE_TOOL_BYTES, or the
# tools past INLINE_TOOLS_SECONDS (each schema's own checks are bounded: PATTERNS_BUDGET), goes to a worker. 512
# tools of one distinct pattern each held the loop 2-4 s a request, another key's p50 from 5 ms to 3 s (sweep 27)
INLINE_TOOL_BYTES = 4096
INLINE_TOOLS_SECONDS = 0.005


def _bound_parameters(tools: Any, bounds: Bounds, inline: bool) -> str | None:
    """The tools' parameter schemas are a constraint like any other: within ``limits.max_constraint_bytes``
    together and ``limits.max_nesting`` each, their regexes within what engines can build automata of. An agent
    sends the same tools with every turn: each schema's verdict is remembered by its text (and, past the event
    loop's share, by the worker's memo). Returns the first schema's ``Constraint.fanout``, if any."""
    if not isinstance(tools, list):
        return None
    total = 0
    fanout: str | None = None
    started = time.thread_time()  # (the event loop's thread: what it spends, not what others do meanwhile)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or function.get("parameters") is None:
            continue
        param = f"tools[{i}].function.parameters"
        _, text = parse_schema(function["parameters"], param, bounds)
        total += len(text)
        check_size(total, "tools' parameter schemas", param, bounds)
        if inline and (len(text) > INLINE_TOOL_BYTES or time.thread_time() - started > INLINE_TOOLS_SECONDS):
            raise Offload
        found = _checked_parameters(text, param, bounds)
        fanout = fanout or found
    return fanout or _names_fanout(tools)


def _names_fanout(tools: list[Any]) -> str | None:
    """Why llama.cpp should not take ``tools`` for their names: its tool-call grammar is a choice of the tool whose
    call comes, each alternative its name's text, so names that begin alike hold as many stacks as an enum's values
    (checks.schema_fanout)."""
    names = [t["function"]["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
             and isinstance(t["function"].get("name"), str)]
    if len(names) < 2:
        return None
    cost, name = enum_cost([orjson.dumps(n) for n in names])
    if cost <= MAX_ENUM_COST:
        return None
    return (f"tools: {len(names)} tool names that begin alike: writing {name[:40]!r} llama.cpp would check every "
            f"candidate token against {cost} ways in all, more than {MAX_ENUM_COST}")


@lru_cache(maxsize=512)
def _checked_parameters(text: bytes, param: str, bounds: Bounds) -> str | None:
    schema = orjson.loads(text)
    depth, where, _ = json_depth(schema, bounds.max_nesting)
    if depth > bounds.max_nesting:
        raise too_deep("JSON schema", f" (objects and arrays, at {where[:200] or '/'})", param, bounds.max_nesting)
    _, fanout = check_patterns(schema, param, bounds)  # (regexes the engine builds automata of, as for any schema)
    check_fan_out(schema, param)  # (a strict tool's calls are checked against it; engines inline its $refs)
    return fanout or (f"{param}: {found}" if (found := schema_fanout(schema)) else None)


def _from_vllm(so: Any, bounds: Bounds) -> list[Constraint]:
    if so is None:
        return []
    if not isinstance(so, dict):
        raise ConstraintInvalid("structured_outputs must be an object", "structured_outputs")
    found: list[Constraint] = []
    for key, value in so.items():
        if value is None or value is False:
            continue
        param = f"structured_outputs.{key}"
        if key == "json":
            found.append(_schema(param, value, param, bounds))
        elif key == "json_object":
            found.append(Constraint("json_object", param))
        elif key == "regex":
            found.append(_regex(param, value, param, bounds))
        elif key == "choice":
            found.append(_choices(param, value, param, bounds))
        elif key == "grammar":
            found.append(_grammar(param, value, _bnf_or(value, "lark", "ebnf"), param, bounds))
        elif key == "structural_tag":
            found.append(_tag(param, value, param, bounds))
        elif key not in OPTIONS:
            raise ConstraintInvalid(f"unknown structured_outputs field {key!r} (vLLM's are json, regex, choice, "
                                    f"grammar, json_object, structural_tag and the options {', '.join(OPTIONS)})",
                                    param)
    return found


def _options(so: Any, bounds: Bounds) -> tuple[tuple[str, Any], ...]:
    """The vLLM options set in ``structured_outputs`` (at their defaults they ask nothing, and are left out)."""
    if not isinstance(so, dict):
        return ()
    options: list[tuple[str, Any]] = []
    for name in OPTIONS:
        value = so.get(name)
        param = f"structured_outputs.{name}"
        if name == "whitespace_pattern":
            if value is None:
                continue
            try:
                check_regex(value, param, bounds, inline=True)
            except Offload:  # (whitespace: a short pattern; a long one is not worth a worker process)
                raise ConstraintInvalid(f"{param}: a whitespace pattern of more than {INLINE_REGEX_CHARS} "
                                        "characters", param, "constraint_too_large") from None
        elif value is None or value is False:
            continue
        elif value is not True:
            raise ConstraintInvalid(f"{param} must be a boolean", param)
        options.append((name, value))
    return tuple(options)


# every field of a request body that a constraint is read from (``extract`` looks at nothing else)
_SOURCES = frozenset(("response_format", "tools", "tool_choice", "structured_outputs", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar", "json_schema", "regex", "regex_pattern",
                      "choice", "ebnf", "grammar", "grammar_syntax", "grammar_string"))


_VLLM_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_PLAIN_SOURCES = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema", "regex",
                  "regex_pattern", "choice", "ebnf", "grammar", "grammar_string")


def _named(body: dict[str, Any]) -> list[str]:
    """The fields that name a constraint, read from the body as it is (nothing checked): one request stacking every
    field, each salted and under its inline size, was checked field by field before it was refused."""
    named: list[str] = []  # (in the order extract finds them)
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        named.append("response_format")
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function")):
        named.append("tool_choice")
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        named += [f"structured_outputs.{key}" for key, value in so.items()
                  if key in _VLLM_CONSTRAINTS and value not in (None, False)]
    return named + [key for key in _PLAIN_SOURCES if body.get(key) is not None]


def extract(body: dict[str, Any], limits: LimitSettings | None = None) -> Constraint | None:
    """The request's constraint, validated within ``limits``; ConstraintInvalid (a client error) when
    malformed, past a limit or several. A constraint too big to validate on the event loop comes back with
    ``pending`` set, checked only for size: gateway.api.validation.validate_heavy finishes it."""
    if _SOURCES.isdisjoint(body):
        return None  # (most requests: one set look per field instead of a look per source)
    bounds = _DEFAULT_BOUNDS if limits is None else Bounds.of(limits)
    named = _named(body)
    if len(named) > 1:  # (before any is checked: each checked in turn cost ~110 ms of the event loop, sweep 28)
        raise ConstraintInvalid("only one structured-output constraint per request; got " + ", ".join(named),
                                named[1])
    found: list[Constraint] = []
    rf = _from_response_format(body.get("response_format"), bounds)
    if rf is not None:
        found.append(rf)
    tools = _from_tools(body, bounds)
    if tools is not None:
        found.append(tools)
    found += _from_vllm(body.get("structured_outputs"), bounds)
    if body.get("guided_json") is not None:
        found.append(_schema("guided_json", body["guided_json"], "guided_json", bounds))
    if body.get("guided_regex") is not None:
        found.append(_regex("guided_regex", body["guided_regex"], "guided_regex", bounds))
    if body.get("guided_choice") is not None:
        found.append(_choices("guided_choice", body["guided_choice"], "guided_choice", bounds))
    if body.get("guided_grammar") is not None:
        g = body["guided_grammar"]
        found.append(_grammar("guided_grammar", g, _bnf_or(g, "lark", "ebnf"), "guided_grammar", bounds))
    if body.get("json_schema") is not None:
        found.append(_schema("json_schema", body["json_schema"], "json_schema", bounds))
    for key in ("regex", "regex_pattern"):
        if body.get(key) is not None:
            found.append(_regex(key, body[key], key, bounds))
    if body.get("choice") is not None:
        found.append(_choices("choice", body["choice"], "choice", bounds))
    if body.get("ebnf") is not None:
        found.append(_grammar("ebnf", body["ebnf"], "ebnf", "ebnf", bounds))
    if body.get("grammar") is not None:
        syntax = body.get("grammar_syntax", "gbnf")
        if syntax not in ("gbnf", "ebnf", "lark"):
            raise ConstraintInvalid("grammar_syntax must be gbnf, ebnf or lark", "grammar_syntax")
        found.append(_grammar("grammar", body["grammar"], syntax, "grammar", bounds))
    if body.get("grammar_string") is not None:
        g = body["grammar_string"]
        found.append(_grammar("grammar_string", g, _bnf_or(g, "lark", "gbnf"), "grammar_string", bounds))
    if len(found) > 1:
        raise ConstraintInvalid("only one structured-output constraint per request; got "
                                + ", ".join(c.source for c in found), found[1].source)
    options = _options(body.get("structured_outputs"), bounds)
    if options and (not found or found[0].kind in ("tool_call", "strict_tools")):
        # (vLLM itself refuses options without a constraint: "You must use one kind of structured outputs")
        raise ConstraintInvalid(f"structured_outputs.{options[0][0]} is an option of a structured-output "
                                "constraint, and this request has none the gateway writes (json, regex, choice, "
                                "grammar, json_object or structural_tag)", f"structured_outputs.{options[0][0]}")
    if not found:
        return None
    constraint = replace(found[0], options=options) if options else found[0]
    tools = body.get("tools")
    if constraint.kind in ("choice", "grammar") and isinstance(tools, list) and tools and \
            body.get("tool_choice") != "none":
        return replace(constraint, beside_tools=True)
    return constraint
