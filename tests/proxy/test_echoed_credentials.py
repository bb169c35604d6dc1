"""An engine that echoes the gateway's credentials for it, in an error of any shape, streamed or not, on chat and
on the agent APIs passed through natively, raw or written with JSON escapes: the client sees none of them.

The final security sweep found the backend's key at the client in every error shape the relay did not know: a 200
JSON body ``{"error": ...}``, a stream event carrying both ``"choices": []`` and ``"error"``, the old vLLM shape
``{"object": "error", "message": ...}`` mid-stream; and on ``/v1/responses`` and ``/v1/messages`` an error event
whose key was written ``\\u0073\\u006b...``, which the client's JSON decoder turns back into the key.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from tests.conftest import serve_in_thread
from tests.proxy.scripted_upstream import ScriptedUpstream

KEY = "sk-BACKEND-0123456789abcdefSECRET"
BASIC = "proxyuser:Pr0xy/Passw0rd+XYZ"  # ('/' and '+': a JSON encoder may write '/' as '\/')
TOKEN = base64.b64encode(BASIC.encode()).decode()
PASSWORD = BASIC.partition(":")[2]
# what must not reach the client, in any part of 8 characters or more
SECRETS = {"bearer": [KEY], "basic": [TOKEN.rstrip("="), PASSWORD]}

# the error shapes, as an engine writes them; ECHO is where it puts the credentials it got
SHAPES = {
    "error": {"error": {"message": "engine failed; Authorization: ECHO", "type": "server_error"}},
    "error_beside_choices": {"id": "c1", "object": "chat.completion.chunk", "choices": [],
                             "error": {"message": "engine failed; Authorization: ECHO"}},
    "object_error": {"object": "error", "message": "bad request; Authorization: ECHO", "type": "BadRequestError",
                     "code": 400},
    "type_error": {"type": "error", "error": {"type": "api_error", "message": "overloaded; Authorization: ECHO"}},
}
# a route's request, the first event of its stream (the error comes after it, so the response has started) and the
# fields its error event has beside its data (an agent API's client reads the error from ``event: error``)
ROUTES: dict[str, tuple[str, dict[str, Any], bytes, bytes]] = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}'
             b"\n\n", b""),
    "responses": ("/v1/responses", {"input": "hi"},
                  b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                  b'"sequence_number":1,"item_id":"m1","output_index":0,"content_index":0,"delta":"hi"}\n\n',
                  b"event: error\n"),
    "messages": ("/v1/messages", {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
                 b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                 b'"delta":{"type":"text_delta","text":"hi"}}\n\n', b"event: error\n"),
}


def escaped(text: str) -> str:
    """``text`` with every character a JSON ``\\u`` escape (as Go's or PHP's encoders write some)."""
    return "".join(f"\\u{ord(c):04x}" for c in text)


def echo(authorization: str, spelling: str) -> bytes:
    """What an echoing engine writes of the credentials it got: the header's value (and, for Basic, the decoded
    ``user:password``), as they are or every character escaped."""
    said = [authorization]
    if authorization.startswith("Basic "):
        said.append(base64.b64decode(authorization[6:]).decode())
    return " ".join(escaped(s) if spelling == "escaped" else s for s in said).encode()


def seen(response: httpx.Response) -> str:
    """What a client reads of an answer: its headers and bytes, and every JSON document in it as its decoder
    reads it (escapes turned back into characters)."""
    text = response.text
    seen = [text, orjson.dumps(dict(response.headers)).decode()]
    for data in [line[5:] for line in text.split("\n") if line.startswith("data:")] or [text]:
        with contextlib.suppress(orjson.JSONDecodeError):
            seen.append(orjson.dumps(orjson.loads(data)).decode())
    return "\n".join(seen)


def leaked(credentials: str, text: str) -> list[str]:
    return [s[i:i + 8] for s in SECRETS[credentials] for i in range(len(s) - 7) if s[i:i + 8] in text]


class EchoingEngine(ScriptedUpstream):
    """A vLLM-like engine answering every request with one of the error shapes, echoing the credentials it got:
    a 200 JSON body, or a stream of one ordinary event then the error event, the error written in two pieces cut
    inside the credentials (each its own read)."""

    def __init__(self, model: str) -> None:
        super().__init__(mode="script", model=model, every=0.005)
        self.shape, self.spelling, self.stream, self.route = "error", "raw", False, "chat"
        self.script = self._answer_script

    def _answer_script(self, headers: dict[str, str]) -> tuple[int, str, list[bytes]]:
        said = echo(headers["authorization"], self.spelling)
        event = orjson.dumps(SHAPES[self.shape]).replace(b"ECHO", said)
        if not self.stream:
            return 200, "application/json", [event]
        cut = event.index(said) + len(said) // 2
        _, _, first, fields = ROUTES[self.route]
        return 200, "text/event-stream", [first, fields + b"data: " + event[:cut], event[cut:] + b"\n\n"]


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, dict[str, EchoingEngine]]]:
    engines = {"bearer": EchoingEngine("mk"), "basic": EchoingEngine("mb")}
    with engines["bearer"], engines["basic"]:
        settings = settings_from_mapping({
            "backends": [
                {"name": "k", "engine": "vllm", "url": engines["bearer"].url, "api_key": KEY, "models": ["mk"]},
                {"name": "b", "engine": "vllm", "url": engines["basic"].url, "basic_auth": BASIC, "models": ["mb"]}],
            "retries": {"max_attempts": 1}, "scrape": {"interval": 0.1, "timeout": 1.0},
            # (the engines fail every request, which ejects them: kept, to see what each error shows the client)
            "breaker": {"consecutive_failures": 100_000, "min_requests": 100_000}})
        with serve_in_thread(create_app(settings)) as server:
            yield server.url, engines


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("route", list(ROUTES))
def test_an_error_echoing_the_backends_credentials_shows_the_client_none_of_them(
        gateway: tuple[str, dict[str, EchoingEngine]], route: str, shape: str, stream: bool) -> None:
    url, engines = gateway
    path, body, _, _ = ROUTES[route]
    found = {}
    for credentials, engine in engines.items():
        for spelling in ("raw", "escaped"):
            engine.shape, engine.spelling, engine.stream, engine.route = shape, spelling, stream, route
            r = httpx.post(url + path, json={"model": engine.model, "stream": stream, **body}, timeout=20)
            # (a whole 200 body that is an error and no answer, empty choices beside it too, fails as the engine's
            # error does: sweeps 22 and 23)
            assert r.status_code == (502 if not stream else 200), r.text
            text = seen(r)
            assert "[redacted]" in text, (credentials, spelling, text)  # (the echo was there, and taken out)
            found[f"{credentials}, {spelling}"] = leaked(credentials, text) and text
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_old_vllm_error_shape_mid_stream_reaches_a_chat_client_as_an_error(
        gateway: tuple[str, dict[str, EchoingEngine]]) -> None:
    """``{"object": "error", "message": ...}`` mid-stream reaches a chat client as OpenAI's error envelope, which
    its SDK raises, scrubbed of the credentials it spelled in escapes."""
    url, engines = gateway
    engine = engines["basic"]
    engine.shape, engine.spelling, engine.stream, engine.route = "object_error", "escaped", True, "chat"
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = sdk.chat.completions.create(model="mb", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            pass
    assert raised.value.message.startswith("bad request; Authorization: [redacted]"), raised.value.message
    assert not leaked("basic", raised.value.message)


def test_an_error_event_on_the_messages_api_reaches_the_anthropic_sdk_as_an_error(
        gateway: tuple[str, dict[str, EchoingEngine]]) -> None:
    """The scrubbed error event keeps its ``event: error`` line: without it the Anthropic SDK skips the event and
    the client sees an answer cut short, with no error."""
    url, engines = gateway
    engine = engines["bearer"]
    engine.shape, engine.spelling, engine.stream, engine.route = "type_error", "escaped", True, "messages"
    sdk = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    stream = sdk.messages.create(model="mk", max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                                 stream=True)
    with pytest.raises(anthropic.APIStatusError) as raised:
        for _ in stream:
            pass
    assert "overloaded; Authorization: Bearer [redacted]" in str(raised.value), str(raised.value)
    assert not leaked("bearer", str(raised.value))
