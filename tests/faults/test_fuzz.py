"""Fuzzing the gateway's API: schemathesis against its OpenAPI document, then hypothesis over raw request
bodies. Behind the gateway, healthy emulators only: any 5xx is a defect of the gateway's own code (or of what
it let through), and every error must be OpenAI-shaped. Bounded by ``max_examples``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.bench.faults import is_error_envelope, settings_for
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.conftest import ServerThread, serve_in_thread

MODEL = "m"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

# the schema, from the app itself (no server needed to collect the tests)
SCHEMA = schemathesis.openapi.from_dict(
    create_app(settings_from_mapping({"backends": [{"name": "x", "engine": "vllm", "url": "http://127.0.0.1:9"}]}))
    .fastapi.openapi())


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerThread]:
    logger = logging.getLogger("gateway")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # (given back after: later tests read the gateway's warnings)
    # vLLM's emulator serves all three routes; fast, so that large max_tokens finish quickly
    specs = [SimSpec(engine="vllm", model=MODEL, name="v", time_scale=500.0)]
    try:
        with FleetThread(specs) as fleet, serve_in_thread(create_app(settings_for(fleet.fleet.servers))) as server:
            yield server
    finally:
        logger.setLevel(level)


def check(status: int, content_type: str, body: bytes, what: str) -> None:
    assert status < 500, f"{what}: HTTP {status} from the gateway: {body[:300]!r}"
    if status >= 400:
        doc: Any = None
        if content_type.startswith("application/json"):
            doc = orjson.loads(body)
        assert is_error_envelope(doc), f"{what}: HTTP {status} not OpenAI-shaped: {body[:300]!r}"


@pytest.fixture(scope="module")
def http(gateway: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


def test_the_openapi_document_describes_the_generation_routes(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    for path in ROUTES:
        post = doc["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in doc["components"]["schemas"]
        assert {"200", "4XX", "5XX"} <= set(post["responses"])
    assert doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]["required"] == [
        "message", "type", "param", "code"]


@SCHEMA.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis(case: Any, gateway: ServerThread) -> None:
    if isinstance(case.body, dict) and case.operation.path in ROUTES and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # reach the backend too, not only the model check
    response = case.call(base_url=gateway.url, timeout=30)
    content_type = response.headers.get("content-type") or [""]
    check(response.status_code, content_type if isinstance(content_type, str) else content_type[0], response.content,
          f"{case.operation.method.upper()} {case.operation.path} {case.body!r:.300}")


# -- hypothesis over raw bodies ------------------------------------------------------------------------------
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=False), st.text(max_size=20),
                    st.sampled_from([MODEL, "", "user", "system", 0, -1, 1, 2**63, 1e308, "\u0000",
                                     "\ud7ff\U0010ffff"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "input", "stream", "stream_options", "n", "max_tokens",
          "max_completion_tokens", "response_format", "tools", "tool_choice", "user", "temperature", "stop",
          "logit_bias", "guided_json", "guided_regex", "json_schema", "grammar", "regex"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus"])},
                                optional={"content": json_values})
bodies = st.one_of(
    json_values,  # anything at all
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),  # the right names, any values
    st.fixed_dictionaries(  # nearly valid, one step from a real request
        {"model": st.just(MODEL)},
        optional={"messages": st.lists(message, max_size=3), "prompt": json_values, "input": json_values,
                  "stream": json_values, "max_tokens": st.one_of(st.integers(min_value=-5, max_value=2**64),
                                                                 json_values),
                  "n": st.one_of(st.integers(min_value=-2, max_value=4), json_values),
                  "stream_options": json_values, "response_format": json_values}),
)
raw_bodies = st.one_of(bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64),
                       st.sampled_from([b"", b"{", b"[]", b"null", b'{"model": "m", "messages": [' * 50,
                                        b'{"model":"m","messages":[{"role":"user","content":"x"}],"n":1e999}',
                                        ("[" * 2000 + "]" * 2000).encode()]))


@pytest.mark.parametrize("route", ROUTES)
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=raw_bodies)
def test_fuzzed_bodies_never_give_a_5xx_and_errors_are_openai_shaped(http: httpx.Client, route: str,
                                                                      raw: bytes) -> None:
    response = http.post(route, content=raw, headers={"content-type": "application/json"})
    check(response.status_code, response.headers.get("content-type", ""), response.content, f"{route} {raw[:300]!r}")


def test_fuzzed_bodies_concurrently_leave_nothing_in_flight(gateway: ServerThread) -> None:
    """A burst of broken and valid requests at once: every answer is an answer, none is a 5xx."""
    samples = [b"{", b"[]", orjson.dumps({"model": MODEL, "messages": []}),
               orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                             "stream": True})] * 16

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            return list(await asyncio.gather(*(client.post(ROUTES[0], content=s) for s in samples)))

    for response in asyncio.run(burst()):
        check(response.status_code, response.headers.get("content-type", ""), response.content, "burst")
