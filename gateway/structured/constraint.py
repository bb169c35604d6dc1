"""One constraint per request, whatever field it arrived in.

Accepted spellings (at most one constraint per request, as vLLM and SGLang require):

* OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``; ``tools`` with ``tool_choice`` ``"required"`` or a named function
  (a forced tool call), or tools marked ``strict: true`` under ``tool_choice: "auto"``.
* The gateway's own: ``regex``, ``choice`` (a list of strings), ``grammar`` with ``grammar_syntax``
  (``gbnf``, the default, ``ebnf`` for xgrammar's EBNF, or ``lark``), ``json_schema`` (object or string).
* vLLM: ``structured_outputs: {json | json_object | regex | choice | grammar}`` and its removed
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (which vLLM itself ignores
  with a 200; the gateway honours them instead).
* SGLang: ``json_schema`` (a JSON string), ``regex``, ``ebnf``.
* llama.cpp: ``json_schema`` (an object), ``grammar`` (GBNF).
* TabbyAPI: ``json_schema``, ``regex_pattern``, ``grammar_string`` (GBNF if it contains ``::=``, else Lark).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from gateway.sim.constrained import ConstraintError, validate_grammar

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "tool_call", "strict_tools"]
Dialect = Literal["gbnf", "ebnf", "lark"]

# every request field that carries a constraint in some dialect; all are removed before the adapter writes
# the engine's own
CONSTRAINT_FIELDS = (
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "json_schema", "regex", "ebnf", "grammar",
    "grammar_syntax", "choice", "regex_pattern", "grammar_string",
)


class ConstraintInvalid(ValueError):
    """The client's constraint is malformed; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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

    def describe(self) -> str:
        if self.kind == "grammar":
            return f"grammar ({self.dialect}, from {self.source})"
        return f"{self.kind} (from {self.source})"


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise ConstraintInvalid(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise ConstraintInvalid(f"{param} must be a JSON schema object", param)
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(value).check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ConstraintInvalid(f"{param} is not a valid JSON schema: {exc.message}"
                                + (f" (at {where})" if where else ""), param) from None
    return value


def _regex(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConstraintInvalid(f"{param} must be a non-empty regular expression string", param)
    try:
        re.compile(value)
    except re.error as exc:
        raise ConstraintInvalid(f"{param} is not a valid regular expression: {exc}", param) from None
    # constrained decoders (xgrammar, llguidance, outlines) build automata: no lookaround, no backreferences
    if re.search(r"\(\?<?[=!]|\\[1-9]|\(\?P=", value):
        raise ConstraintInvalid(f"{param}: lookarounds and backreferences cannot be enforced by any engine", param)
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ConstraintInvalid(f"{param} must be a non-empty array of strings", param)
    return tuple(value)


def _grammar(value: Any, dialect: Dialect, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConstraintInvalid(f"{param} must be a non-empty grammar string", param)
    try:
        validate_grammar(value, dialect)
    except ConstraintError as exc:
        raise ConstraintInvalid(f"{param} is not a valid {dialect.upper()} grammar: {exc}", param) from None
    return value


def _from_response_format(rf: Any) -> Constraint | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ConstraintInvalid("response_format must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintInvalid("response_format.json_schema must be an object with a 'schema'",
                                    "response_format.json_schema")
        schema = _schema(spec["schema"], "response_format.json_schema.schema")
        return Constraint("json_schema", "response_format", schema=schema, strict=spec.get("strict") is True,
                          name=str(spec.get("name") or "response"))
    raise ConstraintInvalid(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                            "response_format.type")


def _from_tools(body: dict[str, Any]) -> Constraint | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        return None
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
        return Constraint("tool_call", "tool_choice")
    strict = any(isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("strict") is True
                 for t in tools)
    if strict and choice in (None, "auto"):
        return Constraint("strict_tools", "tools[].function.strict")
    return None


def _from_vllm(so: Any) -> list[Constraint]:
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
            found.append(Constraint("json_schema", param, schema=_schema(value, param)))
        elif key == "json_object":
            found.append(Constraint("json_object", param))
        elif key == "regex":
            found.append(Constraint("regex", param, pattern=_regex(value, param)))
        elif key == "choice":
            found.append(Constraint("choice", param, choices=_choices(value, param)))
        elif key == "grammar":
            dialect: Dialect = "ebnf" if "::=" in str(value) else "lark"
            found.append(Constraint("grammar", param, grammar=_grammar(value, dialect, param), dialect=dialect))
        elif key not in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                         "whitespace_pattern"):
            raise ConstraintInvalid(f"unknown structured_outputs field {key!r}", param)
    return found


def extract(body: dict[str, Any]) -> Constraint | None:
    """The request's constraint, validated; ConstraintInvalid (a client error) when malformed or several."""
    found: list[Constraint] = []
    rf = _from_response_format(body.get("response_format"))
    if rf is not None:
        found.append(rf)
    tools = _from_tools(body)
    if tools is not None:
        found.append(tools)
    found += _from_vllm(body.get("structured_outputs"))
    if body.get("guided_json") is not None:
        found.append(Constraint("json_schema", "guided_json", schema=_schema(body["guided_json"], "guided_json")))
    if body.get("guided_regex") is not None:
        found.append(Constraint("regex", "guided_regex", pattern=_regex(body["guided_regex"], "guided_regex")))
    if body.get("guided_choice") is not None:
        found.append(Constraint("choice", "guided_choice", choices=_choices(body["guided_choice"], "guided_choice")))
    if body.get("guided_grammar") is not None:
        g = body["guided_grammar"]
        dialect: Dialect = "ebnf" if "::=" in str(g) else "lark"
        found.append(Constraint("grammar", "guided_grammar", grammar=_grammar(g, dialect, "guided_grammar"),
                                dialect=dialect))
    if body.get("json_schema") is not None:
        found.append(Constraint("json_schema", "json_schema", schema=_schema(body["json_schema"], "json_schema")))
    for key in ("regex", "regex_pattern"):
        if body.get(key) is not None:
            found.append(Constraint("regex", key, pattern=_regex(body[key], key)))
    if body.get("choice") is not None:
        found.append(Constraint("choice", "choice", choices=_choices(body["choice"], "choice")))
    if body.get("ebnf") is not None:
        found.append(Constraint("grammar", "ebnf", grammar=_grammar(body["ebnf"], "ebnf", "ebnf"), dialect="ebnf"))
    if body.get("grammar") is not None:
        syntax = body.get("grammar_syntax", "gbnf")
        if syntax not in ("gbnf", "ebnf", "lark"):
            raise ConstraintInvalid("grammar_syntax must be gbnf, ebnf or lark", "grammar_syntax")
        found.append(Constraint("grammar", "grammar", grammar=_grammar(body["grammar"], syntax, "grammar"),
                                dialect=syntax))
    if body.get("grammar_string") is not None:
        g = body["grammar_string"]
        dialect = "gbnf" if "::=" in str(g) else "lark"
        found.append(Constraint("grammar", "grammar_string", grammar=_grammar(g, dialect, "grammar_string"),
                                dialect=dialect))
    if len(found) > 1:
        raise ConstraintInvalid("only one structured-output constraint per request; got "
                                + ", ".join(c.source for c in found), found[1].source)
    return found[0] if found else None
