"""Structured output through the gateway with the OpenAI SDK: every constraint kind on every emulated engine
that can honour it, what the engine was sent, that the answer satisfies it, and the refusals."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running
from tests.conftest import serve_in_thread
from tests.waiting import wait_until

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person."}]
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<person="], "tags": [
    {"type": "tag", "begin": "<person=json>", "content": {"type": "json_schema", "json_schema": SCHEMA},
     "end": "</person>"}]}}


def _tagged(text: str) -> bool:
    match = re.fullmatch("<person=json>(.*)</person>", text, re.DOTALL)
    return match is not None and jsonschema.validate(json.loads(match.group(1)), SCHEMA) is None

# (case, request fields through the SDK, check of the answer)
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "json_object": ({"response_format": {"type": "json_object"}},
                    lambda text: isinstance(json.loads(text), dict)),
    "json_schema": ({"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
                    lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    "regex": ({"extra_body": {"regex": "[A-Z][a-z]{2,6}-[0-9]{3}"}},
              lambda text: re.fullmatch("[A-Z][a-z]{2,6}-[0-9]{3}", text) is not None),
    "choice": ({"extra_body": {"choice": ["red", "green", "blue"]}}, lambda text: text in ("red", "green", "blue")),
    "gbnf": ({"extra_body": {"grammar": 'root ::= ("yes" | "no") " " [0-9] [0-9]'}},
             lambda text: re.fullmatch("(yes|no) [0-9][0-9]", text) is not None),
    "lark": ({"extra_body": {"grammar": 'start: ("yes" | "no") " " DIGIT\n%import common.DIGIT',
                             "grammar_syntax": "lark"}},
             lambda text: re.fullmatch("(yes|no) [0-9]", text) is not None),
    "structural_tag": ({"response_format": TAG}, _tagged),
}
# what each engine must have received, by case
NATIVE: dict[str, dict[str, Any]] = {
    "llamacpp": {"json_object": "response_format", "json_schema": "json_schema", "choice": "grammar",
                 "gbnf": "grammar"},
    "vllm": {c: "structured_outputs" for c in ("json_object", "json_schema", "regex", "choice", "gbnf", "lark",
                                               "structural_tag")},
    "sglang": {"json_object": "response_format", "json_schema": "response_format", "regex": "regex", "choice": "regex",
               "gbnf": "ebnf", "structural_tag": "response_format"},
    "tabbyapi": {"json_object": "json_schema", "json_schema": "json_schema", "regex": "regex_pattern",
                 "choice": "regex_pattern", "gbnf": "grammar_string", "lark": "grammar_string"},
}
ALL_FIELDS = {"response_format", "json_schema", "grammar", "structured_outputs", "regex", "ebnf", "regex_pattern",
              "grammar_string", "choice", "grammar_syntax", "guided_json"}


def sdk(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)


def last_generation(running: Running, server: str) -> dict[str, Any]:
    received = [r for r in list(running.server(server).received) if r.path == "/v1/chat/completions"]
    body: dict[str, Any] = received[-1].body
    return body


@pytest.mark.parametrize(("engine", "case"), [(e, c) for e, cases in NATIVE.items() for c in cases])
@pytest.mark.parametrize("stream", [False, True])
def test_each_engine_gets_its_native_field_and_the_answer_satisfies_it(engines: Running, engine: str, case: str,
                                                                       stream: bool) -> None:
    fields, check = CASES[case]
    c = sdk(engines)
    if stream:
        chunks = c.chat.completions.create(model=f"m-{engine}", messages=ASK, max_tokens=200, stream=True, **fields)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        reply = c.chat.completions.create(model=f"m-{engine}", messages=ASK, max_tokens=200, **fields)
        text = reply.choices[0].message.content or ""
    assert check(text), text
    sent = last_generation(engines, f"sim-{engine}")
    native = NATIVE[engine][case]
    assert native in sent
    assert not (ALL_FIELDS - {native}) & set(sent), f"{engine} was also sent {(ALL_FIELDS - {native}) & set(sent)}"


def test_json_object_reaches_tabbyapi_as_a_schema_it_honours(engines: Running) -> None:
    sdk(engines).chat.completions.create(model="m-tabbyapi", messages=ASK, max_tokens=50,
                                         response_format={"type": "json_object"})
    assert last_generation(engines, "sim-tabbyapi")["json_schema"] == {"type": "object"}


def test_removed_vllm_guided_fields_are_honoured_not_forwarded(engines: Running) -> None:
    reply = sdk(engines).chat.completions.create(model="m-vllm", messages=ASK, max_tokens=100,
                                                 extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    sent = last_generation(engines, "sim-vllm")
    assert sent["structured_outputs"] == {"json": SCHEMA} and "guided_json" not in sent


@pytest.mark.parametrize(("engine", "fields", "able"), [
    ("llamacpp", {"regex": "[0-9]+"}, "sglang, tabbyapi, vllm"),
    ("llamacpp", {"grammar": 'start: "a"', "grammar_syntax": "lark"}, "tabbyapi, vllm"),
    ("sglang", {"grammar": 'start: "a"', "grammar_syntax": "lark"}, "tabbyapi, vllm"),
    ("tabbyapi", {"ebnf": 'root ::= Regex("[a-z]+")'}, "sglang, vllm"),
    ("llamacpp", {"response_format": TAG}, "sglang, vllm"),
    ("tabbyapi", {"structured_outputs": {"structural_tag": json.dumps(TAG)}}, "sglang, vllm"),
    # vLLM's options: SGLang has none, and would drop them
    ("sglang", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "vllm"),
])
def test_a_constraint_no_backend_of_the_model_can_honour_is_refused(engines: Running, engine: str,
                                                                    fields: dict[str, Any], able: str) -> None:
    def generations() -> list[Any]:
        return [r for r in list(engines.server(f"sim-{engine}").received) if r.path.startswith("/v1/chat")]

    before = generations()[-1:]
    with pytest.raises(openai.BadRequestError) as err:
        sdk(engines).chat.completions.create(model=f"m-{engine}", messages=ASK, extra_body=fields)
    assert err.value.code == "unsupported_constraint"
    assert f"engines that can: {able}" in err.value.message
    after = generations()[-1:]
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before, strict=True)), \
        "nothing was forwarded"


def test_vllms_options_reach_vllm_with_the_constraint_the_gateway_rewrote(engines: Running) -> None:
    reply = sdk(engines).chat.completions.create(
        model="m-vllm", messages=ASK, max_tokens=100, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True, "whitespace_pattern": "[ ]?"}})
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), SCHEMA)
    sent = last_generation(engines, "sim-vllm")
    assert sent["structured_outputs"] == {"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": "[ ]?"}
    assert "response_format" not in sent


def test_malformed_constraints_are_400_before_any_backend(engines: Running) -> None:
    for fields, param in [({"regex": "(unclosed"}, "regex"),
                          ({"response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "objec"}}}}, "response_format.json_schema.schema"),
                          ({"regex": "a", "choice": ["a"]}, "choice"),
                          ({"response_format": {"type": "structural_tag", "format": {"type": "json_schema"}}},
                           "response_format.format.json_schema"),
                          ({"structured_outputs": {"json": SCHEMA, "disable_fallback": True}},
                           "structured_outputs.disable_fallback")]:
        response = httpx.post(engines.url + "/v1/chat/completions",
                              json={"model": "m-vllm", "messages": ASK, **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_mixed_fleet_sends_a_regex_only_where_it_is_honoured() -> None:
    specs = [SimSpec(engine="llamacpp", model="shared", name="llama", time_scale=TIME_SCALE),
             SimSpec(engine="sglang", model="shared", name="sglang", time_scale=TIME_SCALE)]
    with FleetThread(specs) as fleet:
        backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url} for s in fleet.fleet.servers]
        settings = settings_from_mapping({"backends": backends, "routing": {"policy": "round-robin"}})
        with serve_in_thread(create_app(settings)) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            served = set()
            for _ in range(6):
                raw = c.chat.completions.with_raw_response.create(model="shared", messages=ASK, max_tokens=20,
                                                                   extra_body={"regex": "[0-9]{4}"})
                assert re.fullmatch("[0-9]{4}", raw.parse().choices[0].message.content or "")
                served.add(raw.headers["x-gateway-backend"])
            assert served == {"sglang"}


def misconfigured(mode: str, with_good: bool) -> tuple[list[SimSpec], dict[str, Any]]:
    """A TabbyAPI server configured as vLLM: it ignores structured_outputs, so its answers are unconstrained."""
    specs = [SimSpec(engine="tabbyapi", model="shared", name="wrong", time_scale=TIME_SCALE)]
    if with_good:
        specs.append(SimSpec(engine="vllm", model="shared", name="right", time_scale=TIME_SCALE))
    return specs, {"structured_output": {"validate_outputs": mode}}


@pytest.mark.parametrize("mode", ["mark", "retry"])
def test_output_validation_marks_or_retries_an_answer_outside_its_schema(mode: str) -> None:
    specs, extra = misconfigured(mode, with_good=True)
    with FleetThread(specs) as fleet:
        wrong, right = fleet.fleet.servers
        backends = [{"name": "wrong", "engine": "vllm", "url": wrong.url},
                    {"name": "right", "engine": "vllm", "url": right.url}]
        settings = settings_from_mapping({"backends": backends, "routing": {"policy": "round-robin"}, **extra})
        with serve_in_thread(create_app(settings)) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            outcomes = []
            for _ in range(4):
                raw = c.chat.completions.with_raw_response.create(
                    model="shared", messages=ASK, max_tokens=60,
                    response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
                text = raw.parse().choices[0].message.content or ""
                outcomes.append((raw.headers["x-gateway-backend"], raw.headers.get("x-gateway-output-invalid"),
                                 text))
            metrics = httpx.get(gw.url + "/metrics").text
    for backend, invalid, text in outcomes:
        if mode == "retry":
            assert backend == "right" and invalid is None
            jsonschema.validate(json.loads(text), SCHEMA)
        elif backend == "wrong":
            assert invalid
    action = "retried" if mode == "retry" else "marked"
    assert f'gateway_structured_output_invalid_total{{action="{action}",backend="wrong",engine="vllm"}} 2.0' \
        in metrics


def test_tool_constraints_go_only_where_tool_calls_are_enforced(engines: Running) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "strict": True,
                                               "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        sdk(engines).chat.completions.create(model="m-tabbyapi", messages=ASK, tools=tools, tool_choice="required")
    assert "engines that can: llamacpp, openai, sglang, vllm" in err.value.message
    # strict arguments on an optional call: a best effort, never refused (tests/api/test_agent_apis.py)
    sdk(engines).chat.completions.create(model="m-tabbyapi", messages=ASK, tools=tools, max_tokens=5)
    sdk(engines).chat.completions.create(model="m-vllm", messages=ASK, tools=tools, tool_choice="required",
                                         max_tokens=5)
    sent = last_generation(engines, "sim-vllm")
    assert sent["tool_choice"] == "required" and sent["tools"] == tools


def test_a_choice_beside_tools_goes_where_the_engine_takes_both(engines: Running) -> None:
    """llama.cpp answers 400 ("Cannot use custom grammar constraints with tools.") to a grammar beside tools the
    model may call, and a choice reaches it as a grammar: such a request is refused up front, naming the engines
    that take it, where only llama.cpp serves the model, and is served by one of those engines elsewhere."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    body = {"messages": ASK, "max_tokens": 20, "tools": tools, "choice": ["red", "green"]}
    r = httpx.post(engines.url + "/v1/chat/completions", json={"model": "m-llamacpp", **body}, timeout=20)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_constraint" and "beside tools" in error["message"], error
    assert "sglang, tabbyapi, vllm" in error["message"]
    r = httpx.post(engines.url + "/v1/chat/completions", json={"model": "m-vllm", **body}, timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("red", "green")
    # with tool_choice "none" llama.cpp takes the grammar
    r = httpx.post(engines.url + "/v1/chat/completions", json={"model": "m-llamacpp", **body, "tool_choice": "none"},
                   timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("red", "green")
    # and the emulator refuses what llama-server refuses
    r = httpx.post(engines.server("sim-llamacpp").url + "/v1/chat/completions", timeout=20,
                   headers={"authorization": "Bearer key-llamacpp"},
                   json={"model": "m-llamacpp", "messages": ASK, "tools": tools, "grammar": 'root ::= "a"'})
    assert r.status_code == 400 and "Cannot use custom grammar constraints with tools." in r.text


def test_a_structural_tag_or_vllms_options_go_only_to_the_engines_that_honour_them() -> None:
    """Beside SGLang and llama.cpp serving the same model: a structural tag never goes to llama.cpp, a legacy tag's
    at_least_one only to SGLang, vLLM's options only to vLLM."""
    specs = [SimSpec(engine=engine, model="shared", name=engine, time_scale=TIME_SCALE)
             for engine in ("llamacpp", "sglang", "vllm")]
    legacy = {"type": "structural_tag", "triggers": ["<person="], "at_least_one": True,
              "structures": [{"begin": "<person=json>", "schema": SCHEMA, "end": "</person>"}]}
    asked: list[tuple[dict[str, Any], set[str]]] = [
        ({"response_format": TAG}, {"sglang", "vllm"}),
        ({"response_format": legacy}, {"sglang"}),
        ({"structured_outputs": {"structural_tag": json.dumps(TAG), "disable_any_whitespace": True}}, {"vllm"}),
    ]
    with FleetThread(specs) as fleet:
        backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url} for s in fleet.fleet.servers]
        settings = settings_from_mapping({"backends": backends, "routing": {"policy": "round-robin"}})
        with serve_in_thread(create_app(settings)) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            for fields, where in asked:
                served = set()
                for _ in range(6):
                    raw = c.chat.completions.with_raw_response.create(model="shared", messages=ASK, max_tokens=200,
                                                                       extra_body=fields)
                    assert _tagged(raw.parse().choices[0].message.content or "")
                    served.add(raw.headers["x-gateway-backend"])
                assert served == where, fields


def test_a_llamacpp_model_whose_template_has_no_tools_is_not_sent_tools_and_cannot_be_forced() -> None:
    """Issue 42: llama-server ignores tools when the model's chat template has no tool support
    (``/props`` ``chat_template_caps.supports_tools: false``), so tool_choice required came back 200 as text. The
    gateway reads the caps: tools go to a backend that can call them, and a forced call with none is a 400."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    specs = [SimSpec(engine="llamacpp", model="shared", name="plain", time_scale=TIME_SCALE, tool_template=False,
                     tool_call_rate=1.0),
             SimSpec(engine="llamacpp", model="shared", name="tooled", time_scale=TIME_SCALE, tool_call_rate=1.0)]
    with FleetThread(specs) as fleet:
        plain, tooled = fleet.fleet.servers
        settings = settings_from_mapping({"backends": [
            {"name": s.spec.name, "engine": "llamacpp", "url": s.url} for s in (plain, tooled)],
            "routing": {"policy": "round-robin"}, "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(settings)) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            for choice in ("required", "auto"):
                served = set()
                for _ in range(4):
                    raw = c.chat.completions.with_raw_response.create(model="shared", messages=ASK, tools=tools,
                                                                       tool_choice=choice, max_tokens=20)
                    served.add(raw.headers["x-gateway-backend"])
                    assert raw.parse().choices[0].message.tool_calls, choice
                assert served == {"tooled"}
        only = settings_from_mapping({"backends": [{"name": "plain", "engine": "llamacpp", "url": plain.url}],
                                      "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(only)) as gw:  # (the model served only where it cannot call tools)
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            wait_until(lambda: c.models.list().data, "models discovered")
            with pytest.raises(openai.BadRequestError) as refused:
                c.chat.completions.create(model="shared", messages=ASK, tools=tools, tool_choice="required")
            assert "cannot call tools" in refused.value.message and "plain" in refused.value.message
            # an optional call is a best effort: served in text where nothing else can
            answered = c.chat.completions.create(model="shared", messages=ASK, tools=tools, max_tokens=5)
            assert not answered.choices[0].message.tool_calls


def test_retry_asks_again_once_and_the_key_pays_for_every_answer_generated() -> None:
    """Sweep 8: with validate_outputs retry, an answer failing its schema was asked again on every backend but the
    last (three generations with three backends), and only the last answer was charged to the key: three times
    the engine work its tokens_per_minute allows, sustained."""
    import hashlib

    specs = [SimSpec(engine="tabbyapi", model="shared", name=f"wrong-{i}", time_scale=TIME_SCALE) for i in range(3)]
    with FleetThread(specs) as fleet:
        backends = [{"name": s.spec.name, "engine": "vllm", "url": s.url} for s in fleet.fleet.servers]
        key = {"name": "k", "key_sha256": hashlib.sha256(b"sk-k").hexdigest(), "tokens_per_minute": 600}
        settings = settings_from_mapping({"backends": backends, "routing": {"policy": "round-robin"},
                                          "structured_output": {"validate_outputs": "retry"},
                                          "auth": {"keys": [key]}, "scrape": {"interval": 0.1, "timeout": 1.0}})
        app = create_app(settings)
        with serve_in_thread(app) as gw:
            c = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-k", max_retries=0)
            raw = c.chat.completions.with_raw_response.create(
                model="shared", messages=ASK, max_tokens=30,
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
            assert raw.headers.get("x-gateway-output-invalid")  # (marked: retried once, then served as it came)
            generated = [s.stats for s in fleet.fleet.servers]
            asked = [r for s in fleet.fleet.servers for r in list(s.received) if r.path == "/v1/chat/completions"]
            assert len(asked) == 2
            used = sum(st.prompt_tokens + st.tokens_generated for st in generated)
            tokens = next(c for _, c in app.gateway.keys._clients if c.name == "k").tokens
            assert tokens is not None
            # charged both answers (the bucket refills 10 a second meanwhile: a little slack)
            assert 600 - tokens.level >= used - 10, (600 - tokens.level, used)
