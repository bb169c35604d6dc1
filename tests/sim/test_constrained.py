"""Tests for gateway.sim.constrained and the parsers it samples from (gateway.structured.syntax): every
sample is checked by an independent oracle (jsonschema, re.fullmatch, json.loads, a hand-written regex for
the language)."""

from __future__ import annotations

import json
import random
import re
import sys
from typing import Any

import jsonschema
import pytest

from gateway.sim.constrained import (
    choice_sample,
    ebnf_sample,
    gbnf_sample,
    json_instance,
    lark_sample,
    regex_sample,
    validate_json_schema,
)
from gateway.structured.syntax import (
    ConstraintError,
    ConstraintTooDeep,
    ConstraintTooLarge,
    gbnf_from_choices,
    gbnf_to_ebnf,
    regex_from_choices,
    validate_grammar,
    validate_regex,
)
from gateway.structured.syntax.grammar_ast import Alt, CharClass, Expr, Grammar, Lit, Ref, Repeat, Seq
from gateway.structured.syntax.grammar_check import CostTable
from gateway.structured.syntax.grammar_parse import parse_text_grammar

pytestmark = pytest.mark.unit

SEEDS = range(25)

# --------------------------------------------------------------------------------------- JSON
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
LINKED = {  # recursion that only ends through anyOf's null branch
    "definitions": {"link": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "next": {"$ref": "#/definitions/link"}}, "required": ["next"]}]}},
    "$ref": "#/definitions/link",
}
SCHEMAS: list[Any] = [
    PERSON,
    TREE,
    LINKED,
    {"type": "object"},
    {},
    True,
    {"type": ["string", "null"]},
    {"type": ["integer", "boolean"]},
    {"type": "null"},
    {"type": "boolean"},
    {"type": "string", "minLength": 5, "maxLength": 5},
    {"type": "string", "maxLength": 0},
    {"type": "string", "pattern": "^[A-Z]{3}-\\d{3}$"},
    {"type": "string", "pattern": "ab+c"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": ["red", 3, None, {"k": [1]}]},
    {"const": {"a": [1, 2]}},
    {"type": "integer", "minimum": -5, "maximum": -5},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 12},
    {"type": "integer", "multipleOf": 7, "minimum": 100},
    {"type": "integer", "maximum": -1000},
    {"type": "number", "minimum": 0.5, "maximum": 0.75},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "number", "multipleOf": 0.25, "minimum": 1, "maximum": 2},
    {"type": "number", "multipleOf": 0.1},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False,
     "minItems": 2},
    {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 2},
    {"type": "array", "maxItems": 0},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "maxProperties": 1},
    {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 10}]},
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    {"oneOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "string", "enum": ["b", "c"]}]},
    {"type": "object", "anyOf": [{"required": ["x"]}, {"required": ["y"]}],
     "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}},
    {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"a": {"minimum": 50}, "b": {"type": "string"}}, "required": ["b"]},
    ]},
    {"allOf": [{"type": ["number", "string"]}, {"type": "integer"}, {"multipleOf": 3}]},
    {"$defs": {"c": {"type": "string", "enum": ["x", "y"]}}, "type": "object",
     "properties": {"c": {"$ref": "#/$defs/c"}, "d": {"$ref": "#/$defs/c", "enum": ["y"]}},
     "required": ["c", "d"]},
    {"definitions": {"n": {"type": "integer"}}, "type": "array",
     "items": {"$ref": "#/definitions/n"}, "minItems": 1},
    {"title": "annotated", "description": "ignored", "examples": [1], "type": "integer",
     "default": 3},
]


FORMAT_SHAPES = {  # stricter than the format checker, which skips formats it lacks a library for
    "date": r"\d{4}-\d{2}-\d{2}",
    "date-time": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})",
    "email": r"[^@\s]+@[^@\s]+\.[a-z]+",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}


def _validate(value: Any, schema: Any) -> None:
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator, format_checker=checker)
    if isinstance(schema, dict) and schema.get("format") in FORMAT_SHAPES:
        assert re.fullmatch(FORMAT_SHAPES[schema["format"]], value), value


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: json.dumps(s)[:60])
def test_json_instance_validates(schema: Any) -> None:
    for seed in SEEDS:
        value = json_instance(schema, random.Random(seed))
        _validate(value, schema)
        json.dumps(value)  # plain JSON types only


def test_json_instance_is_deterministic_and_varies() -> None:
    first = [json_instance(PERSON, random.Random(s)) for s in range(10)]
    again = [json_instance(PERSON, random.Random(s)) for s in range(10)]
    assert first == again
    assert len({json.dumps(v, sort_keys=True) for v in first}) > 5


def test_json_instance_outputs_stay_small() -> None:
    for seed in range(50):
        assert len(json.dumps(json_instance(TREE, random.Random(seed)))) < 4000
        assert len(json.dumps(json_instance({"type": "object"}, random.Random(seed)))) < 200


def test_json_optional_properties_sometimes_present() -> None:
    seen = {k for s in range(30) for k in json_instance(PERSON, random.Random(s))}
    assert {"name", "age", "email", "tags"} <= seen


def test_json_instance_hypothesis_sweep() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    strategies = hypothesis.strategies

    @hypothesis.settings(max_examples=150, deadline=None)
    @hypothesis.given(strategies.integers(0, 2**32), strategies.sampled_from(SCHEMAS[:12]))
    def check(seed: int, schema: Any) -> None:
        _validate(json_instance(schema, random.Random(seed)), schema)

    check()


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "strin"}, "strin"),
        ({"type": []}, "type"),
        ({"type": "object", "required": "name"}, "required"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"patternProperties": {"^a": {}}}, "patternProperties"),
        ({"if": {}, "then": {}}, "'if'"),
        ({"type": "string", "pattern": "(?<=a)b"}, "lookahead"),
        ({"type": "string", "pattern": "(unclosed"}, "invalid regex"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"$ref": "http://example.com/s.json"}, "local"),
        ({"minimum": 5, "maximum": 1}, "minimum"),
        ({"minLength": -1}, "minLength"),
        ({"multipleOf": 0}, "multipleOf"),
        ({"enum": []}, "enum"),
        ("not a schema", "schema must be"),
        ({"properties": {"a": 3}}, "/properties/a"),
    ],
)
def test_json_schema_errors(schema: Any, needle: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(needle)):
        validate_json_schema(schema)
    with pytest.raises(ConstraintError):
        json_instance(schema, random.Random(0))


@pytest.mark.parametrize(
    "schema",
    [
        False,
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"type": "integer", "minimum": 1.2, "maximum": 1.8},
        {"type": "array", "items": False, "minItems": 1},
        {"$defs": {"loop": {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}},
                            "required": ["x"]}}, "$ref": "#/$defs/loop"},
    ],
)
def test_json_unsatisfiable_schemas_raise(schema: Any) -> None:
    validate_json_schema(schema)  # well-formed...
    with pytest.raises(ConstraintError):  # ...but no value satisfies it
        json_instance(schema, random.Random(0))


# -------------------------------------------------------------------------------------- regex
REGEXES = [
    r"\d{3}-\d{4}",
    r"[A-Z][a-z]+ (?:[a-z]+ )*end\.",
    r"^(ab|cd)+$",
    r"[^a-z]{2,5}",
    r".*",
    r"\w+@\w+\.(com|org)",
    r"(?i)hello [^x]",
    r"[\D][\W][\S]",
    r"[^\d\s]+",
    r"(?P<year>\d{4})-(?:0[1-9]|1[0-2])",
    r"a{2}b{1,}c{0,3}d??e*?f+?",
    r"(?:yes|no|maybe)",
    r"\\\.\*\(\)\[\]",
    r"\t\n[\u00e9-\u00ff]",
    r"",
    r"x|",
    r"(a|b(c|d(e|f)))+",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_sample_fullmatches(pattern: str) -> None:
    for seed in SEEDS:
        text = regex_sample(pattern, random.Random(seed))
        assert re.fullmatch(pattern, text), (pattern, text)


def test_regex_sample_unbounded_repeats_stay_small() -> None:
    assert max(len(regex_sample(r"a*b+", random.Random(s))) for s in range(100)) < 12
    lengths = {len(regex_sample(r"a{5,100}", random.Random(s))) for s in range(50)}
    assert min(lengths) >= 5 and max(lengths) < 12


def test_regex_sample_deterministic() -> None:
    assert [regex_sample(r"[a-z]{8}", random.Random(7)) for _ in range(2)] == [
        regex_sample(r"[a-z]{8}", random.Random(7))
    ] * 2


@pytest.mark.parametrize(
    ("pattern", "needle"),
    [
        (r"(a)\1", "backreference"),
        (r"a(?=b)", "lookahead"),
        (r"(?<!a)b", "lookahead"),
        (r"\bword\b", "word boundar"),
        (r"(?>a+)", "atomic"),
        (r"(a", "invalid regex"),
        (r"a{2,1}", "invalid regex"),
        (r"[z-a]", "invalid regex"),
    ],
)
def test_regex_errors(pattern: str, needle: str) -> None:
    with pytest.raises(ConstraintError, match=needle):
        validate_regex(pattern)
    with pytest.raises(ConstraintError):
        regex_sample(pattern, random.Random(0))


def test_regex_mid_pattern_anchor_is_reported() -> None:
    with pytest.raises(ConstraintError, match="could not generate"):
        regex_sample(r"a^b", random.Random(0))


# ------------------------------------------------------------------------------------- choice
CHOICES = ["yes", "no", 'say "hi"', "a|b", "back\\slash", "new\nline", "(x)*", "", "ünï 中"]


def test_choice_sample_and_conversions() -> None:
    rng = random.Random(0)
    assert {choice_sample(CHOICES, rng) for _ in range(300)} == set(CHOICES)
    pattern = regex_from_choices(CHOICES)
    for choice in CHOICES:
        assert re.fullmatch(pattern, choice)
    assert not re.fullmatch(pattern, "yesno")
    grammar = gbnf_from_choices(CHOICES)
    validate_grammar(grammar, "gbnf")
    samples = {gbnf_sample(grammar, random.Random(s)) for s in range(300)}
    assert samples == set(CHOICES)


@pytest.mark.parametrize("bad", [[], "abc", ["a", 1]])
def test_choice_errors(bad: Any) -> None:
    with pytest.raises(ConstraintError):
        choice_sample(bad, random.Random(0))
    with pytest.raises(ConstraintError):
        gbnf_from_choices(bad)
    with pytest.raises(ConstraintError):
        regex_from_choices(bad)


# ----------------------------------------------------------------------------------- grammars
JSON_GBNF = r"""
# JSON, after llama.cpp's grammars/json.gbnf
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt/] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""

ARITH_GBNF = r"""
root ::= expr
expr ::= term (space-op term)*
term ::= num | "(" expr ")" | "-" term
space-op ::= " "? [-+*/] " "?
num ::= [0-9]+ ("." [0-9]+)?
"""
ARITH_TOKENS = re.compile(r"(?:\(|\)|-|[0-9]+(?:\.[0-9]+)?| ?[-+*/] ?)+")


def _balanced_arith(text: str) -> bool:
    """An arithmetic-expression recogniser independent of the grammar code."""
    number = r"[0-9]+(?:\.[0-9]+)?"
    previous = None
    while previous != text:  # collapse innermost groups / unary minus / binary ops
        previous = text
        text = re.sub(rf"(^|\(|[-+*/] ?)-(N|{number})", r"\1N", text)
        text = re.sub(rf"(N|{number})( ?[-+*/] ?(N|{number}))+", "N", text)
        text = re.sub(rf"\((N|{number})\)", "N", text)
    return re.fullmatch(rf"N|{number}", text) is not None


def test_gbnf_json_samples_parse_as_json() -> None:
    kinds = set()
    for seed in range(60):
        value = json.loads(gbnf_sample(JSON_GBNF, random.Random(seed)))
        assert isinstance(value, dict)
        kinds.add(len(value) > 0)
    assert kinds == {True, False}


def test_gbnf_arithmetic_samples() -> None:
    seen = set()
    for seed in range(100):
        text = gbnf_sample(ARITH_GBNF, random.Random(seed))
        assert ARITH_TOKENS.fullmatch(text), text
        assert _balanced_arith(text), text
        seen.add(text)
    assert len(seen) > 50
    assert any("(" in s for s in seen)


def test_gbnf_features() -> None:
    grammar = r"""
root ::= greeting " " rep " " (cls) " " esc " " any-ch
greeting ::= "hi" | "hello"
rep ::= "ab"{2} "c"{1,} "d"{0,2} "e"{3,4}
cls ::= [a-c] [^a-z\n] [\x41-\x43] [\u00e9]
esc ::= "\x41\u00e9\"\\\t"
any-ch ::= .
"""
    expected = re.compile(r'(hi|hello) ababc+d{0,2}e{3,4} [a-c][^a-z\n][A-C]é Aé"\\\t .', re.S)
    for seed in SEEDS:
        text = gbnf_sample(grammar, random.Random(seed))
        assert expected.fullmatch(text), text


def test_gbnf_deterministic() -> None:
    assert gbnf_sample(JSON_GBNF, random.Random(3)) == gbnf_sample(JSON_GBNF, random.Random(3))


def test_gbnf_deep_recursion_terminates() -> None:
    grammar = 'root ::= "(" root ")" | "(" root root ")" | "x"'
    for seed in range(50):
        text = gbnf_sample(grammar, random.Random(seed))
        assert len(text) < 2000 and text.count("(") == text.count(")")


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        ('root ::= "a" (', "line 1, column 15"),
        ('root ::= "a"\nnext ::= "b" )', "line 2, column 14"),
        ('root ::= "unterminated', "unterminated string"),
        ("root ::= [a-", "unterminated character class"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= "\\x4"', "2 hex digits"),
        ('root ::= "a"{3,1}', "below lower bound"),
        ('root ::= "a"{,3}', "integer"),
        ('root = "a"', "'::='"),
        ("root ::= foo", "undefined rule 'foo'"),
        ('x ::= "a"', "no 'root' rule"),
        ('root ::= a\na ::= "x" a', "no finite derivation"),
        ('root ::= root "a" | "a"', "left recursion"),
        ('root ::= b "a" | "a"\nb ::= "" | root', "left recursion"),
        ("root ::= <think>", "token references"),
        ("under_score ::= \"a\"\nroot ::= under_score", "'::='"),
    ],
)
def test_gbnf_errors(grammar: str, needle: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(needle)):
        validate_grammar(grammar, "gbnf")
    with pytest.raises(ConstraintError):
        gbnf_sample(grammar, random.Random(0))


def test_ebnf_dialect() -> None:
    grammar = r"""
root ::= item ("," item){0,3} tail
item[capture] ::= [a-zA-Z_] [a-zA-Z0-9_]*
  | "\x1F600" | num
num ::= Regex("[0-9]{2}-[0-9]{2}")
tail ::= "" | "\e" | [\-\]] | [^]
"""
    item = r"(?:[a-zA-Z_][a-zA-Z0-9_]*|\U0001F600|[0-9]{2}-[0-9]{2})"
    pattern = re.compile(rf"{item}(?:,{item}){{0,3}}(?:|\x1b|[\-\]]|.)", re.S)
    for seed in SEEDS:
        text = ebnf_sample(grammar, random.Random(seed))
        assert pattern.fullmatch(text), text
    root_left = 'root ::= root "a" | "a"'  # xgrammar supports left recursion
    assert re.fullmatch("a+", ebnf_sample(root_left, random.Random(1)))


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        ('root ::= ("a" (= "b"))', "may only end a rule"),
        ('root ::= "a" (= "b") (= "c")', "unexpected '('"),
        ('root ::= "a"\nroot ::= "b"', "defined more than once"),
        ('root ::= TagDispatch(("<t>", r))\nr ::= "x"', "TagDispatch"),
        ('root ::= "a"++', "two repetition operators"),
        ('root ::= "a\nb"', "raw newline"),
        ("root ::= [\\d]", "shorthand"),
        ('root[lazy] ::= "a"', "lazy"),
        ('root ::= Regex("(")', "invalid regex"),
        ("root ::= missing", "undefined rule 'missing'"),
    ],
)
def test_ebnf_errors(grammar: str, needle: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(needle)):
        validate_grammar(grammar, "ebnf")


def test_gbnf_to_ebnf_is_faithful() -> None:
    tricky = r"""
root ::= "\x41BC" 9lives dot "a"*? [\x5D\x2D^] ws
9lives ::= "nine"
dot ::= .
ws ::= | " "
"""
    converted = gbnf_to_ebnf(tricky)
    validate_grammar(converted, "ebnf")
    assert "9lives" not in converted.replace("r-9lives", "")
    pattern = re.compile(r"ABCnine.(?:a*)?[\]\-^] ?", re.S)
    for seed in SEEDS:
        assert pattern.fullmatch(ebnf_sample(converted, random.Random(seed)))
        assert pattern.fullmatch(gbnf_sample(tricky, random.Random(seed)))
    for seed in range(20):
        json.loads(ebnf_sample(gbnf_to_ebnf(JSON_GBNF), random.Random(seed)))
    with pytest.raises(ConstraintError, match="left recursion"):
        gbnf_to_ebnf('root ::= root "a" | "a"')
    with pytest.raises(ConstraintError, match="surrogate"):
        gbnf_to_ebnf('root ::= "\\uD800"')


LARK_JSON = r"""
?start: value
?value: object
      | array
      | string
      | JSON_NUMBER        -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
JSON_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
%import common.ESCAPED_STRING
%import common.WS
%ignore WS
"""


def test_lark_json_samples_parse() -> None:
    for seed in range(60):
        json.loads(lark_sample(LARK_JSON, random.Random(seed)))


COMMON_LANGUAGES = {  # Lark's common.lark terminals, as Python regexes
    "SIGNED_NUMBER": r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?",
    "NUMBER": r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?",
    "INT": r"\d+",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[A-Za-z_]\w*",
    "ESCAPED_STRING": r'"(?:[^"\\\n]|\\.)*"',
    "WS": r"[ \t\f\r\n]+",
    "HEXDIGIT": r"[0-9a-fA-F]",
    "NEWLINE": r"(?:\r?\n)+",
}


@pytest.mark.parametrize("name", sorted(COMMON_LANGUAGES))
def test_lark_common_terminals(name: str) -> None:
    grammar = f"start: {name}\n%import common.{name}\n"
    for seed in SEEDS:
        text = lark_sample(grammar, random.Random(seed))
        assert re.fullmatch(COMMON_LANGUAGES[name], text, re.ASCII), (name, text)


def test_lark_features() -> None:
    grammar = r"""
start: greeting _SEP name ("!" ~ 2..3) code? list
greeting: "hello"i | "hi"
_SEP: " "
name: WORD | CNAME
code: /[A-Z]{2}\d+/ | LETTER ~ 2
list: "[" [INT ("," INT)*] "]"
%import common (WORD, CNAME, INT, LETTER)
// comments are fine
"""
    pattern = re.compile(
        r"(hello|hi) (?:[A-Za-z]+|[A-Za-z_][A-Za-z0-9_]*)!{2,3}(?:[A-Z]{2}\d+|[A-Za-z]{2})?"
        r"\[(?:\d+(?:,\d+)*)?\]"
    )
    for seed in SEEDS:
        text = lark_sample(grammar, random.Random(seed))
        assert pattern.fullmatch(text), text


@pytest.mark.parametrize(
    ("grammar", "needle"),
    [
        ('begin: "a"', "no 'start' rule"),
        ("start: missing", "undefined rule 'missing'"),
        ('start: "a" (', "line 1, column 13"),
        ("start: A\nA: b\nb: \"x\"", "terminal 'A' refers to rule 'b'"),
        ("start: X\n%import common.NOPE -> X", "common.NOPE"),
        ("start: X\n%import other.X", "only '%import common'"),
        ("start: X\n%declare X", "%declare"),
        ('start: _sep{a}\n_sep{x}: x', "templates"),
        ("start: /(?=a)a/", "lookahead"),
        ('start: "a" start', "no finite derivation"),
        ('start: "b".."a"', "range"),
    ],
)
def test_lark_errors(grammar: str, needle: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(needle)):
        validate_grammar(grammar, "lark")


def test_validate_grammar_rejects_unknown_dialect_and_non_strings() -> None:
    with pytest.raises(ConstraintError, match="dialect"):
        validate_grammar('root ::= "a"', "peg")  # type: ignore[arg-type]
    with pytest.raises(ConstraintError, match="string"):
        validate_grammar(None, "gbnf")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- bounded work
INF = 1 << 62


def naive_costs(grammar: Grammar) -> dict[str, int]:
    """The definition of the least derivation costs, iterated until nothing changes (quadratic)."""
    costs = dict.fromkeys(grammar.rules, INF)

    def cost(expr: Expr) -> int:
        if isinstance(expr, Lit):
            return len(expr.text)
        if isinstance(expr, CharClass):
            return 1 if expr.members() else INF
        if isinstance(expr, Ref):
            return costs.get(expr.name, INF)
        if isinstance(expr, Seq):
            return min(INF, sum(cost(item) for item in expr.items))
        if isinstance(expr, Alt):
            return min(cost(option) for option in expr.options)
        assert isinstance(expr, Repeat)
        return 0 if expr.lo == 0 else min(INF, expr.lo * cost(expr.item))

    changed = True
    while changed:
        changed = False
        for name, body in grammar.rules.items():
            if min(INF, 1 + cost(body)) < costs[name]:
                costs[name], changed = min(INF, 1 + cost(body)), True
    return costs


def random_expr(rng: random.Random, names: list[str], depth: int = 0) -> Expr:
    pick = rng.randrange(7 if depth < 4 else 3)
    if pick == 0:
        return Lit(rng.choice(["", "a", "bc"]))
    if pick == 1:
        return CharClass(((97, 98),)) if rng.random() < 0.8 else CharClass(())
    if pick == 2:
        return Ref(rng.choice(names))
    if pick == 3:
        return Seq(tuple(random_expr(rng, names, depth + 1) for _ in range(rng.randrange(0, 4))))
    if pick == 4:
        return Alt(tuple(random_expr(rng, names, depth + 1) for _ in range(rng.randrange(1, 4))))
    lo = rng.randrange(0, 3)
    return Repeat(random_expr(rng, names, depth + 1), lo, rng.choice([None, lo, lo + 2]))


def test_least_costs_are_those_of_the_definition() -> None:
    for seed in range(400):
        rng = random.Random(seed)
        names = [f"r{i}" for i in range(rng.randrange(1, 8))]
        grammar = Grammar({name: random_expr(rng, names) for name in names}, names[0], "gbnf")
        assert CostTable(grammar).rule_cost == naive_costs(grammar), seed


def chain(rules: int, left: bool = False, reverse: bool = False) -> str:
    """``rules`` rules each referring to the next (on its left: a long but not left-recursive chain)."""
    body = [f'r{i} ::= r{i + 1} "a"' if left else f'r{i} ::= "a" r{i + 1}' for i in range(1, rules)]
    lines = ["root ::= r1", *(reversed(body) if reverse else body), f'r{rules} ::= "a"']
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("left", "reverse"), [(False, False), (False, True), (True, False)])
def test_a_chain_of_12000_rules_is_checked_and_sampled_in_linear_time(left: bool, reverse: bool) -> None:
    text = chain(12_000, left, reverse)
    validate_grammar(text, "gbnf")
    costs = CostTable(parse_text_grammar(text, "gbnf")).rule_cost
    assert costs["root"] == 1 + 2 * 12_000 and costs["r12000"] == 2
    assert gbnf_sample(text, random.Random(0)) == "a" * 12_000  # no recursion per rule either
    assert "r12000 ::=" in gbnf_to_ebnf(text)


def test_the_work_of_checking_a_chain_grows_in_proportion_to_its_rules() -> None:
    """Linear time, counted rather than timed: the Python calls made to check a chain double when its rules do
    (the quadratic fixed point that took 42 s on 12,000 rules made four times as many; its worst case is a chain
    written backwards)."""

    def calls(rules: int) -> int:
        text, made = chain(rules, reverse=True), [0]

        def count(frame: Any, event: str, arg: Any) -> None:
            made[0] += event == "call"

        before = sys.getprofile()
        sys.setprofile(count)
        try:
            validate_grammar(text, "gbnf")
            CostTable(parse_text_grammar(text, "gbnf"))
        finally:
            sys.setprofile(before)
        return made[0]

    small, large = calls(250), calls(500)
    assert large < 2.2 * small, (small, large)


@pytest.mark.parametrize(("dialect", "make"), [
    ("gbnf", lambda n: "root ::= " + '("a" ' * n + ")" * n),
    ("gbnf", lambda n: 'root ::= "a"' + "?" * n),  # "a"** is left recursive for llama.cpp
    ("ebnf", lambda n: "root ::= " + '("a" | ' * n + '"b"' + ")" * n),
    ("ebnf", lambda n: 'root ::= Regex("' + "(" * n + "a" + ")" * n + '")'),
    ("lark", lambda n: "start: " + '["a" ' * n + "]" * n),
    ("lark", lambda n: "start: /" + "(?:" * n + "a" + ")" * n + "/"),
])
def test_grammars_nested_past_the_limit_stop_the_parser(dialect: Any, make: Any) -> None:
    validate_grammar(make(20), dialect, max_nesting=20)
    with pytest.raises(ConstraintTooDeep, match="deeper than 20 levels"):
        validate_grammar(make(21), dialect, max_nesting=20)
    for limit in (20, 200):  # never a RecursionError (past 28 Lark brackets: llguidance's own limit)
        with pytest.raises(ConstraintError, match="deeper than"):
            validate_grammar(make(5000), dialect, max_nesting=limit)


def test_regexes_nested_past_the_limit_are_refused_before_parsing() -> None:
    validate_regex("(" * 200 + "a" + ")" * 200)
    with pytest.raises(ConstraintTooDeep, match="at offset 200"):
        validate_regex("(" * 201 + "a" + ")" * 201)
    validate_regex("[(]" * 300 + "\\(" * 300, max_nesting=1)  # escaped and in classes: not groups


def test_grammars_with_more_rules_than_the_limit_are_refused_when_the_next_starts() -> None:
    validate_grammar(chain(10), "gbnf", max_rules=11)
    with pytest.raises(ConstraintTooLarge, match="more than 10 rules"):
        validate_grammar(chain(10), "gbnf", max_rules=10)
    lark = "start: a\n" + "\n".join(f'a{"" if i == 0 else i}: "x"' for i in range(5))
    validate_grammar(lark, "lark", max_rules=6)
    with pytest.raises(ConstraintTooLarge):
        validate_grammar(lark, "lark", max_rules=5)


def test_deep_expressions_convert_and_sample() -> None:
    grammar = "root ::= " + '("a" | "b" (' * 100 + '"c"' + ")*)*" * 100
    converted = gbnf_to_ebnf(grammar)
    text = ebnf_sample(converted, random.Random(1))
    assert re.fullmatch("[abc]*", text)
