"""One constraint from any spelling; malformed ones refused up front; what each engine can honour."""

from __future__ import annotations

import json

import orjson
import pytest

from gateway.engines.registry import ENGINES, create_adapter
from gateway.structured import ConstraintInvalid, can_honour, extract

pytestmark = pytest.mark.unit

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
GBNF = 'root ::= "yes" | "no"'
EBNF_ONLY = 'root ::= Regex("[a-z]+")'  # xgrammar's Regex macro: EBNF, not GBNF


@pytest.mark.parametrize(
    ("body", "kind", "source"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         "json_schema", "response_format"),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": GBNF}}, "grammar", "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
        ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
        ({"guided_regex": "a+"}, "regex", "guided_regex"),
        ({"guided_choice": ["x"]}, "choice", "guided_choice"),
        ({"json_schema": '{"type": "object"}'}, "json_schema", "json_schema"),  # SGLang: a string
        ({"json_schema": SCHEMA}, "json_schema", "json_schema"),  # llama.cpp, TabbyAPI: an object
        ({"regex": "a|b"}, "regex", "regex"),
        ({"ebnf": 'root ::= "a"'}, "grammar", "ebnf"),
        ({"grammar": GBNF}, "grammar", "grammar"),
        ({"grammar": 'start: "a" | "b"', "grammar_syntax": "lark"}, "grammar", "grammar"),
        ({"regex_pattern": "[a-z]+"}, "regex", "regex_pattern"),
        ({"grammar_string": 'start: "a"'}, "grammar", "grammar_string"),
        ({"choice": ["red", "green"]}, "choice", "choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"},
         "tool_call", "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {}}}]},
         "strict_tools", "tools[].function.strict"),
    ],
)
def test_every_spelling_becomes_one_constraint(body: dict[str, object], kind: str, source: str) -> None:
    constraint = extract(body)
    assert constraint is not None and constraint.kind == kind and constraint.source == source


def test_dialects_are_recognised() -> None:
    assert extract({"grammar_string": GBNF}).dialect == "gbnf"  # type: ignore[union-attr]
    assert extract({"grammar_string": 'start: "a"'}).dialect == "lark"  # type: ignore[union-attr]
    assert extract({"structured_outputs": {"grammar": 'start: "a"'}}).dialect == "lark"  # type: ignore[union-attr]
    assert extract({"ebnf": 'root ::= "a"'}).dialect == "ebnf"  # type: ignore[union-attr]


def test_no_constraint() -> None:
    assert extract({}) is None
    assert extract({"response_format": {"type": "text"}}) is None
    assert extract({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}) is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "not a valid JSON schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type",
         "must be text, json_object, json_schema or structural_tag"),
        ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
        ({"regex": "(unclosed"}, "regex", "not a valid regular expression"),
        ({"regex": "(?=a)b"}, "regex", "lookahead and lookbehind assertions"),
        ({"guided_regex": r"(a)\1"}, "guided_regex", "backreferences cannot be enforced"),
        # a schema's own patterns too (llama.cpp drops such a pattern and accepts any string)
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "^(?=a)a+$"}}}},
         "response_format.json_schema.schema", "/pattern has lookahead and lookbehind assertions"),
        # schemas no engine can honour (TabbyAPI skipped them and generated unconstrained output)
        ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}, "json_schema",
         "'#/$defs/A' at /properties/a points at nothing"),
        ({"json_schema": {"$ref": "https://example.com/s.json"}}, "json_schema", "is not a local JSON pointer"),
        ({"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}}, "json_schema",
         "minLength 5 is above maxLength 2"),
        ({"json_schema": {"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 1}}},
         "json_schema", "minimum 3 is above maximum 1 at /items"),
        ({"json_schema": {"type": "integer", "enum": ["a", "b"]}}, "json_schema", "no enum value at / is of its type"),
        ({"json_schema": {"type": ["string", "null"], "const": 3}}, "json_schema", "no const value"),
        ({"json_schema": {"type": "object", "properties": {"p": {"type": "object", "patternProperties": {
            r"^(x)\1$": {"type": "string"}}}}}},
         "json_schema", "/properties/p/patternProperties has backreferences"),
        # 21 bytes that unroll to 10^9 positions: every emulated engine spun at 100% CPU on it, deaf to SIGTERM
        ({"regex": "((a{999}){999}){999}"}, "regex", "unroll to more than 100,000 positions"),
        ({"json_schema": {"type": "string", "pattern": "^(x{400}){400}$"}}, "json_schema",
         "the pattern at /pattern has counted repetitions that unroll"),
        # sweep 22: 90,000 ways to split a run of a's between two varying counts (under the positions' bound):
        # llama.cpp's grammar followed each at every token and froze, every slot with it, for minutes
        ({"json_schema": {"type": "string", "pattern": "^(a{0,300}){0,300}$"}}, "json_schema",
         "parts of varying length (nested, optional under a count, or side by side)"),
        ({"regex": "([ab]{0,40}){0,40}"}, "regex", "more than 100 ways"),
        ({"regex": "((a{0,10}){0,10}){0,11}"}, "regex", "more than 100 ways"),
        # sweep 23: each froze llama-server too (16 characters, the first): optional items under a count, varying
        # ones side by side, a nest of small counts
        ({"regex": "^([ab]?){0,100}$"}, "regex", "more than 100 ways"),
        ({"regex": "^" + "[ab]{0,30}" * 12 + "$"}, "regex", "more than 100 ways"),
        ({"regex": "^(((([ab]{0,5}){0,5}){0,5}){0,5})$"}, "regex", "more than 100 ways"),
        ({"regex": "^" + "[ab]?" * 150 + "$"}, "regex", "more than 100 ways"),
        # sweep 26: alternatives of several lengths side by side, behind a decoy the search's greedy run takes
        ({"regex": "^The answer follows: (bq*)?cdefg" + ("(" + "|".join("a" * k for k in range(1, 11)) + ")") * 12
          + "~$"}, "regex", "more than 100 ways"),
        ({"choice": []}, "choice", "non-empty array of strings"),
        ({"choice": ["a", 1]}, "choice", "non-empty array of strings"),
        ({"grammar": 'root ::= "unclosed'}, "grammar", "not a valid GBNF grammar"),
        ({"grammar": GBNF, "grammar_syntax": "peg"}, "grammar_syntax", "gbnf, ebnf or lark"),
        ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "unknown structured_outputs field"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, "regex", "only one structured-output"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "only one"),
    ],
)
def test_malformed_constraints_are_the_clients_error(body: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(ConstraintInvalid) as err:
        extract(body)
    assert err.value.param == param and words in str(err.value)


# constraint -> engines that honour it (natively or by a faithful conversion)
MATRIX = {
    "json_object": {"llamacpp", "vllm", "sglang", "tabbyapi", "openai"},
    "json_schema": {"llamacpp", "vllm", "sglang", "tabbyapi", "openai"},
    "regex": {"vllm", "sglang", "tabbyapi"},
    "choice": {"llamacpp", "vllm", "sglang", "tabbyapi"},
    "gbnf": {"llamacpp", "vllm", "sglang", "tabbyapi"},
    "ebnf-as-gbnf": {"llamacpp", "vllm", "sglang", "tabbyapi"},
    "ebnf-only": {"vllm", "sglang"},
    "lark": {"vllm", "tabbyapi"},
    "tool_call": {"llamacpp", "vllm", "sglang", "openai"},
    "strict_tools": {"llamacpp", "vllm", "sglang", "openai"},  # (elsewhere a best effort, checked)
    "choice-beside-tools": {"vllm", "sglang", "tabbyapi"},  # (llama.cpp: "Cannot use custom grammar ... tools")
    "gbnf-beside-tools": {"vllm", "sglang", "tabbyapi"},
    "gbnf-tool-choice-none": {"llamacpp", "vllm", "sglang", "tabbyapi"},
    "json_schema-beside-tools": {"llamacpp", "vllm", "sglang", "tabbyapi", "openai"},
}
TOOLS = [{"type": "function", "function": {"name": "f"}}]
BODIES = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": "[0-9]{3}"},
    "choice": {"choice": ["a", "b"]},
    "gbnf": {"grammar": GBNF},
    "ebnf-as-gbnf": {"ebnf": 'root ::= "a" [0-9]'},
    "ebnf-only": {"ebnf": EBNF_ONLY},
    "lark": {"grammar": 'start: "a" | "b"', "grammar_syntax": "lark"},
    "tool_call": {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
    "strict_tools": {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
    "choice-beside-tools": {"choice": ["a", "b"], "tools": TOOLS},
    "gbnf-beside-tools": {"grammar": GBNF, "tools": TOOLS, "tool_choice": "auto"},
    "gbnf-tool-choice-none": {"grammar": GBNF, "tools": TOOLS, "tool_choice": "none"},
    "json_schema-beside-tools": {"json_schema": SCHEMA, "tools": TOOLS},
}


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_capability_matrix(case: str) -> None:
    constraint = extract(BODIES[case])
    assert constraint is not None
    able = {name for name, spec in ENGINES.items() if can_honour(constraint, spec.structured)}
    assert able == MATRIX[case]


def test_adapters_write_native_fields_and_drop_every_other_spelling() -> None:
    noise = {"guided_json": SCHEMA, "regex": "x", "response_format": {"type": "json_object"}}
    regex = extract({"regex": "[0-9]+"})
    schema = extract({"json_schema": SCHEMA})
    json_object = extract({"response_format": {"type": "json_object"}})
    gbnf = extract({"grammar": GBNF})
    choice = extract({"choice": ["a", "b"]})
    sglang_schema = '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}'
    expect = [
        ("vllm", regex, {"structured_outputs": {"regex": "[0-9]+"}}),
        ("vllm", schema, {"structured_outputs": {"json": SCHEMA}}),
        ("vllm", json_object, {"structured_outputs": {"json_object": True}}),
        ("vllm", choice, {"structured_outputs": {"choice": ["a", "b"]}}),
        ("sglang", regex, {"regex": "[0-9]+"}),
        ("sglang", schema, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "response", "schema": SCHEMA, "strict": True}}}),
        ("sglang", json_object, {"response_format": {"type": "json_object"}}),
        ("llamacpp", schema, {"json_schema": SCHEMA}),
        ("llamacpp", gbnf, {"grammar": GBNF}),
        ("tabbyapi", json_object, {"json_schema": {"type": "object"}}),
        ("tabbyapi", regex, {"regex_pattern": "[0-9]+"}),
        ("tabbyapi", gbnf, {"grammar_string": GBNF}),
        ("openai", schema, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "response", "schema": SCHEMA, "strict": False}}}),
    ]
    for engine, constraint, fields in expect:
        body = create_adapter(engine).prepare_body("chat", {"model": "m", "messages": [], **noise}, constraint)
        assert {k: v for k, v in body.items() if k not in ("model", "messages", "stream_options")} == fields, engine
    # SGLang reads a top-level json_schema on completions only (its ChatCompletionRequest has no such field)
    assert create_adapter("sglang").prepare_body("completions", {}, schema) == {"json_schema": sglang_schema}
    # choices become a GBNF alternation (llama.cpp) or a regex alternation (SGLang, TabbyAPI)
    assert "::=" in create_adapter("llamacpp").prepare_body("chat", {}, choice)["grammar"]
    assert create_adapter("sglang").prepare_body("chat", {}, choice)["regex"].count("|") == 1
    # GBNF reaches vLLM and SGLang rewritten as xgrammar EBNF
    assert "root" in create_adapter("vllm").prepare_body("chat", {}, gbnf)["structured_outputs"]["grammar"]
    assert "ebnf" in create_adapter("sglang").prepare_body("chat", {}, gbnf)


def test_a_pattern_inside_a_schemas_data_is_not_one_of_its_regexes() -> None:
    """``const``, ``enum``, ``default`` and ``examples`` hold values: a "pattern" key in them is data."""
    value = {"pattern": "^(?=a)a+$"}
    schema = {"type": "object", "const": value, "enum": [value], "default": value, "examples": [value]}
    assert extract({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


def test_satisfiable_schemas_with_refs_bounds_and_enums_pass() -> None:
    schema = {"$defs": {"A": {"type": "integer", "minimum": 1, "maximum": 1}},
              "type": "object", "properties": {
                  "a": {"$ref": "#/$defs/A"}, "self": {"$ref": "#"}, "n": {"type": "integer", "enum": [1, 2.0]},
                  "s": {"type": ["string", "null"], "const": None, "minLength": 2, "maxLength": 2},
                  # property names that are keywords elsewhere are schemas here
                  "minimum": {"type": "number"}, "$ref": {"type": "string"}, "enum": {"type": "boolean"}},
              "default": {"$ref": "nowhere", "minLength": 9, "maxLength": 1}}
    assert extract({"json_schema": schema})


def test_long_counted_repetitions_that_real_patterns_use_are_accepted() -> None:
    for pattern in (".{0,5000}", r"(\w{1,100} ){1,500}", r"\d{3}-\d{4}", "(a{300}){300}", r"^(\d{1,3}\.){3}\d{1,3}$",
                    r"([^,]{0,100},){0,100}", r"( [a-z]{1,10}){1,500}", r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$",
                    r"^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2})?)?$", "[A-Z][a-z]{0,20} [A-Z][a-z]{0,20}"):
        assert extract({"regex": pattern}) is not None, pattern
    with pytest.raises(ConstraintInvalid) as err:
        extract({"regex": "((a{999}){999}){999}"})
    assert err.value.code == "constraint_too_large"


# -- structural tags (vLLM, SGLang) and vLLM's structured_outputs options ---------------------------------------
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
    {"type": "tag", "begin": "<f=get>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"}]}}
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=get>", "schema": SCHEMA, "end": "</f>"}]}


@pytest.mark.parametrize(
    ("body", "source"),
    [
        ({"response_format": TAG}, "response_format"),
        ({"response_format": LEGACY_TAG}, "response_format"),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, "structured_outputs.structural_tag"),
        # (vLLM's string form may leave the type out; the gateway adds it)
        ({"structured_outputs": {"structural_tag": json.dumps({k: v for k, v in LEGACY_TAG.items() if k != "type"})}},
         "structured_outputs.structural_tag"),
    ],
)
def test_a_structural_tag_is_one_constraint_that_only_vllm_and_sglang_honour(body: dict[str, object],
                                                                             source: str) -> None:
    constraint = extract(body)
    assert constraint is not None and constraint.kind == "structural_tag" and constraint.source == source
    assert constraint.tag["type"] == "structural_tag"
    assert {name for name, spec in ENGINES.items() if can_honour(constraint, spec.structured)} == {"vllm", "sglang"}


def test_structural_tags_are_written_where_each_engine_reads_them() -> None:
    constraint = extract({"response_format": TAG})
    assert constraint is not None
    vllm = create_adapter("vllm").prepare_body("chat", {"response_format": TAG}, constraint)
    assert vllm == {"structured_outputs": {"structural_tag": json.dumps(TAG, separators=(",", ":"))}}
    sglang = create_adapter("sglang").prepare_body("chat", {"structured_outputs": {"structural_tag": "{}"}},
                                                   constraint)
    assert sglang == {"response_format": TAG}


def test_a_legacy_tags_at_least_one_goes_only_where_it_is_read() -> None:
    """SGLang reads a legacy tag's at_least_one; vLLM's legacy model has no such field and would drop it."""
    constraint = extract({"response_format": {**LEGACY_TAG, "at_least_one": True}})
    assert constraint is not None and constraint.requires == {"at_least_one"}
    assert {name for name, spec in ENGINES.items() if can_honour(constraint, spec.structured)} == {"sglang"}
    assert "with at_least_one" in constraint.describe()


DEEP = {"type": "object"}
for _ in range(70):
    DEEP = {"type": "array", "items": DEEP}
DEEPER = {"type": "sequence", "elements": [DEEP] * 1}
for _ in range(10):
    DEEPER = {"type": "sequence", "elements": [DEEPER]}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "structural_tag"}}, "response_format", "'format' object, or 'structures'"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                                                    "content": {"type": "json_schema"}}}},
         "response_format.format.content.json_schema", "must be a JSON schema"),
        ({"response_format": {**LEGACY_TAG, "triggers": []}}, "response_format.triggers", "non-empty array"),
        ({"response_format": {**LEGACY_TAG, "structures": [{"begin": "<a>", "end": "</a>"}]}},
         "response_format.structures[0].schema", "must be a JSON schema object"),
        ({"response_format": {**LEGACY_TAG, "stop": True}}, "response_format", "unknown field 'stop'"),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag",
         "not valid JSON"),
        # the schemas inside are bounded as tool parameter schemas are: nesting, and their regexes
        ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": DEEP}}},
         "response_format.format.json_schema", "limits.max_nesting = 64"),
        ({"response_format": {**LEGACY_TAG, "structures": [{"begin": "<a>", "end": "</a>", "schema": {
            "type": "string", "pattern": "^(?=a)a$"}}]}},
         "response_format.structures[0].schema", "lookahead and lookbehind assertions"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "regex", "pattern": r"(a)\1"}}},
         "response_format.format.pattern", "backreferences"),
        # and so is the whole tag: its size, and its nesting (vLLM allows 16 levels of wrapping around a schema)
        ({"response_format": {"type": "structural_tag", "format": {
            "type": "const_string", "value": "x" * 200_000}}}, "response_format", "limits.max_constraint_bytes"),
        ({"response_format": {"type": "structural_tag", "format": DEEPER}},
         "response_format", "limits.max_nesting = 80"),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG), "regex": "a"}}, "structured_outputs.regex",
         "only one"),
        # vLLM's options: of a constraint, typed as vLLM types them; no such thing as disable_fallback
        ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace",
         "has none the gateway writes"),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": "yes"}},
         "structured_outputs.disable_any_whitespace", "must be a boolean"),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "(?= )"}},
         "structured_outputs.whitespace_pattern", "lookahead"),
        ({"structured_outputs": {"json": SCHEMA, "disable_fallback": True}}, "structured_outputs.disable_fallback",
         "unknown structured_outputs field"),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace", "has none the gateway writes"),
    ],
)
def test_malformed_or_unbounded_structural_tags_and_options_are_refused(body: dict[str, object], param: str,
                                                                        words: str) -> None:
    with pytest.raises(ConstraintInvalid) as err:
        extract(body)
    assert err.value.param == param and words in str(err.value)


def test_vllm_options_ride_with_the_constraint_to_vllm_alone() -> None:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            "structured_outputs": {"disable_any_whitespace": True, "whitespace_pattern": "[ ]?",
                                   "disable_additional_properties": False}}
    constraint = extract(body)
    assert constraint is not None and constraint.kind == "json_schema"
    assert constraint.requires == {"disable_any_whitespace", "whitespace_pattern"}
    assert {name for name, spec in ENGINES.items() if can_honour(constraint, spec.structured)} == {"vllm"}
    sent = create_adapter("vllm").prepare_body("chat", dict(body), constraint)
    assert sent == {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                                           "whitespace_pattern": "[ ]?"}}
    # at their defaults they ask for nothing: any engine will do
    plain = extract({"structured_outputs": {"regex": "a+", "disable_any_whitespace": False}})
    assert plain is not None and plain.requires == frozenset()
    assert {name for name, spec in ENGINES.items() if can_honour(plain, spec.structured)} == {
        "vllm", "sglang", "tabbyapi"}


def test_strict_tool_arguments_are_checked_against_their_own_schema_after_the_fact() -> None:
    """Strict tools under ``auto`` are a best effort (issue 42: the Agents SDK marks every tool strict): where no
    engine enforces them, the answer's calls of strict tools are checked; other calls and text pass."""
    from gateway.structured.check import output_problem

    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "weather", "strict": True, "parameters": params}},
             {"type": "function", "function": {"name": "loose", "parameters": params}}]
    constraint = extract({"tools": tools})
    assert constraint is not None and constraint.best_effort

    def answer(name: str, arguments: str) -> bytes:
        call = {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}
        return orjson.dumps({"choices": [{"message": {"role": "assistant", "tool_calls": [call]}}]})

    assert output_problem("chat", answer("weather", '{"city": "Oslo"}'), constraint) is None
    assert output_problem("chat", answer("loose", '{"town": 1}'), constraint) is None
    assert output_problem("chat", orjson.dumps({"choices": [{"message": {"content": "hi"}}]}), constraint) is None
    problem = output_problem("chat", answer("weather", '{"town": "Oslo"}'), constraint)
    assert problem is not None and "'weather'" in problem and "city" in problem
    assert "not valid JSON" in (output_problem("chat", answer("weather", '{"ci'), constraint) or "")


def test_a_request_naming_several_constraints_is_refused_before_any_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweep 28: one body stacking every constraint field, each salted and under its inline size, had each checked on
    the event loop (~110 ms a request) before it was refused for naming several."""
    import gateway.structured.constraint as constraint_module

    checked: list[str] = []
    for name in ("_schema", "_regex", "_grammar", "_choices"):
        original = getattr(constraint_module, name)
        monkeypatch.setattr(constraint_module, name,
                            lambda *args, _o=original, **kw: checked.append(args[0]) or _o(*args, **kw))
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
            "guided_regex": "a+", "grammar": 'root ::= "x"', "structured_outputs": {"json": {"type": "string"}}}
    with pytest.raises(ConstraintInvalid) as refused:
        extract(body)
    assert str(refused.value).endswith("only one structured-output constraint per request; got response_format, "
                                       "structured_outputs.json, guided_regex, grammar")
    assert checked == []
