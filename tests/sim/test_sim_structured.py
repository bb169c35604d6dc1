"""Structured output through each engine's native fields, validated with jsonschema / re.fullmatch."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from gateway.sim import FleetThread

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
MSG = [{"role": "user", "content": "give me a person"}]


def chat(ft: FleetThread, engine: str, extra: dict[str, object], stream: bool = False) -> httpx.Response:
    body = {"model": "sim-llama-2-7b", "messages": MSG, "max_tokens": 500, "stream": stream, **extra}
    with httpx.Client(timeout=10) as c:
        return c.post(ft.fleet[f"sim-{engine}"].url + "/v1/chat/completions", json=body)


def content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


RF_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}


@pytest.mark.parametrize(("engine", "extra"), [
    ("vllm", {"structured_outputs": {"json": SCHEMA}}), ("vllm", RF_SCHEMA),
    ("sglang", RF_SCHEMA),
    ("llamacpp", {"json_schema": SCHEMA}), ("llamacpp", RF_SCHEMA),
    ("tabbyapi", {"json_schema": SCHEMA}), ("tabbyapi", RF_SCHEMA),
])
def test_json_schema_yields_a_valid_instance(fleet: FleetThread, engine: str, extra: dict[str, object]) -> None:
    jsonschema.validate(json.loads(content(chat(fleet, engine, extra))), SCHEMA)


def test_streamed_constrained_output_is_the_same_text_token_by_token(fleet: FleetThread) -> None:
    r = chat(fleet, "vllm", {"structured_outputs": {"json": SCHEMA}}, stream=True)
    deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
              for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert sum(1 for d in deltas if d) > 3
    jsonschema.validate(json.loads("".join(deltas)), SCHEMA)


@pytest.mark.parametrize(("engine", "extra"), [
    ("vllm", {"structured_outputs": {"regex": r"[A-Z][a-z]{2,5}-\d{3}"}}),
    ("sglang", {"regex": r"[A-Z][a-z]{2,5}-\d{3}"}),
    ("tabbyapi", {"regex_pattern": r"[A-Z][a-z]{2,5}-\d{3}"}),
])
def test_regex(fleet: FleetThread, engine: str, extra: dict[str, object]) -> None:
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", content(chat(fleet, engine, extra)))


def test_choice_and_grammars(fleet: FleetThread) -> None:
    assert content(chat(fleet, "vllm", {"structured_outputs": {"choice": ["red", "green"]}})) in ("red", "green")
    gbnf = 'root ::= "yes" | "no"'
    assert content(chat(fleet, "llamacpp", {"grammar": gbnf})) in ("yes", "no")
    assert content(chat(fleet, "tabbyapi", {"grammar_string": gbnf})) in ("yes", "no")
    assert content(chat(fleet, "sglang", {"ebnf": gbnf})) in ("yes", "no")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_json_object(fleet: FleetThread, engine: str) -> None:
    assert isinstance(json.loads(content(chat(fleet, engine, {"response_format": {"type": "json_object"}}))), dict)


def test_tabbyapi_ignores_json_object(fleet: FleetThread) -> None:
    text = content(chat(fleet, "tabbyapi", {"response_format": {"type": "json_object"}}))
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_sglang_reads_a_top_level_json_schema_on_completions_only(fleet: FleetThread) -> None:
    """SGLang 0.5.23: ``json_schema`` is a CompletionRequest field; ChatCompletionRequest has none, and pydantic
    drops it (200, unconstrained), so a chat schema comes from ``response_format`` alone."""
    text = content(chat(fleet, "sglang", {"json_schema": json.dumps(SCHEMA)}))
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text), SCHEMA)
    body = {"model": "sim-llama-2-7b", "prompt": "a person:", "max_tokens": 500, "json_schema": json.dumps(SCHEMA)}
    r = httpx.post(fleet.fleet["sim-sglang"].url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
    nameless = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    r = chat(fleet, "sglang", nameless)
    assert r.status_code == 400 and "name" in r.text


def test_vllm_ignores_removed_guided_fields(fleet: FleetThread) -> None:
    r = chat(fleet, "vllm", {"guided_json": SCHEMA, "guided_regex": r"\d+"})
    text = content(r)
    assert not re.fullmatch(r"\d+", text)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize(("engine", "extra", "needle"), [
    ("vllm", {"structured_outputs": {"json": SCHEMA, "regex": "a+"}}, "one kind"),
    ("sglang", {**RF_SCHEMA, "regex": "a+"}, "Only one of"),
    ("llamacpp", {"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, "not both"),
])
def test_rejected_combinations(fleet: FleetThread, engine: str, extra: dict[str, object], needle: str) -> None:
    r = chat(fleet, engine, extra)
    assert r.status_code == 400 and needle in r.text


def test_tabbyapi_skips_an_unparseable_constraint(fleet: FleetThread) -> None:
    assert content(chat(fleet, "tabbyapi", {"regex_pattern": "(unclosed"}))


def test_invalid_schema_is_refused_by_vllm(fleet: FleetThread) -> None:
    r = chat(fleet, "vllm", {"structured_outputs": {"regex": "(unclosed"}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<person="], "tags": [
    {"type": "tag", "begin": "<person=json>", "content": {"type": "json_schema", "json_schema": SCHEMA},
     "end": "</person>"}]}}
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<person="],
              "structures": [{"begin": "<person=json>", "schema": SCHEMA, "end": "</person>"}]}
TAGGED = re.compile(r"<person=json>(.*)</person>", re.DOTALL)


@pytest.mark.parametrize(("engine", "extra"), [
    ("vllm", {"response_format": TAG}), ("vllm", {"response_format": LEGACY_TAG}),
    ("vllm", {"structured_outputs": {"structural_tag": json.dumps(TAG)}}),
    ("sglang", {"response_format": TAG}), ("sglang", {"response_format": LEGACY_TAG}),
])
def test_a_structural_tag_yields_its_begin_a_valid_instance_and_its_end(fleet: FleetThread, engine: str,
                                                                         extra: dict[str, object]) -> None:
    match = TAGGED.fullmatch(content(chat(fleet, engine, extra)))
    assert match is not None
    jsonschema.validate(json.loads(match.group(1)), SCHEMA)


def test_sglang_reads_a_structural_tag_from_response_format_alone(fleet: FleetThread) -> None:
    """Its ChatCompletionRequest has no structured_outputs and no top-level structural_tag: both ignored."""
    for extra in ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, {"structural_tag": json.dumps(TAG)}):
        assert TAGGED.fullmatch(content(chat(fleet, "sglang", extra))) is None


def test_vllm_refuses_stream_options_without_stream(fleet: FleetThread) -> None:
    """vLLM (0.34 ChatCompletionRequest.validate_stream_options) refuses them, where TabbyAPI reads them to put
    usage in a non-streamed answer: the gateway asks for usage that way on TabbyAPI alone."""
    r = chat(fleet, "vllm", {"stream_options": {"include_usage": True}})
    assert r.status_code == 400 and "Stream options can only be defined when `stream=True`." in r.text
    assert content(chat(fleet, "tabbyapi", {"stream_options": {"include_usage": True}}))
