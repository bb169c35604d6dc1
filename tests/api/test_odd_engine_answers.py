"""An engine's answer with values of another type than chat completions puts there (a finish reason that is a
list, usage figures that are strings, details that are not objects) is the engine's fault: a translated answer
is a 502 in the client's API's error shape, a translated stream ends with its API's failure event; never a 500
from the gateway or a stream cut without its end (sweep 16)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.proxy.transport import MockRequest, MockResponse
from tests.inprocess import in_process

pytestmark = [pytest.mark.anyio, pytest.mark.unit]

WHOLE = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "finish_reason": ["stop"], "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": "5", "completion_tokens": [1], "prompt_tokens_details": "x"}}
CHUNKS = [
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
     "choices": [{"index": 0, "delta": {}, "finish_reason": {"why": "stop"}}],
     "usage": {"prompt_tokens": "5", "completion_tokens": 1, "completion_tokens_details": 7}},
]


def engine(request: MockRequest) -> MockResponse:
    if orjson.loads(request.body).get("stream"):
        return MockResponse(headers={"Content-Type": "text/event-stream"},
                            pieces=[b"data: " + orjson.dumps(c) + b"\n\n" for c in CHUNKS] + [b"data: [DONE]\n\n"])
    return MockResponse(body=orjson.dumps(WHOLE))


@contextlib.asynccontextmanager
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    async with in_process({"backends": [{"name": "e", "engine": "openai", "url": "http://e:8000"}]},
                          engine) as (_app, client):
        yield client


BODIES: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "input": "hi", "store": False},
}


@pytest.mark.parametrize("path", list(BODIES))
async def test_an_answer_of_odd_types_is_the_engines_502_in_the_apis_shape(path: str) -> None:
    async with gateway() as client:
        response = await client.post(path, json=BODIES[path])
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert "not a chat completion this API can be translated from" in error["message"]


@pytest.mark.parametrize(("path", "last"), [("/v1/messages", b"event: error"), ("/v1/responses", b"response.failed")])
async def test_a_stream_of_odd_types_ends_with_its_apis_failure_event(path: str, last: bytes) -> None:
    async with gateway() as client:
        response = await client.post(path, json={**BODIES[path], "stream": True})
    assert response.status_code == 200
    events = [e for e in response.content.split(b"\n\n") if e.strip()]
    assert last in events[-1] and b"translated from" in events[-1], events[-3:]
