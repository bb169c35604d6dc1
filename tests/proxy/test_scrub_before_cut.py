"""A backend's text is scrubbed of its credentials before it is cut, everywhere it reaches a client. The security
sweep saw the beginning of a credential an engine echoed get through wherever the gateway cut the text first:
26 of the API key's 37 characters after a mid-stream line that is not SSE, the key's first half after a 200 body
that is not JSON, and ``Basic YWxpY2U6UGE1NS13MH`` (the user and five characters of the password) from a
plain-text 400 cut at 500 characters."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.errors import Redactor, normalise_upstream_error
from gateway.proxy.transport import MockRequest, MockResponse, MockTransport
from tests.proxy.test_forward import SSE, chunk, control_plane

pytestmark = pytest.mark.unit

KEY = "sk-BACKEND-apikey-0123456789abcdefXYZ"
BASIC = "alice:Pa55-w0rd-basic-LONGER"
TOKEN = base64.b64encode(BASIC.encode()).decode()
ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def leaked(secret: str, text: str, at_least: int = 4) -> str | None:
    """The longest beginning of ``secret`` (``at_least`` characters or more) found in ``text``."""
    for size in range(len(secret), at_least - 1, -1):
        if secret[:size] in text:
            return secret[:size]
    return None


def through_gateway(answer: Callable[[MockRequest], MockResponse], backend: dict[str, Any],
                    body: dict[str, Any]) -> httpx.Response:
    """One request through a whole gateway (in process) whose backend answers with ``answer``."""
    settings = settings_from_mapping({
        "backends": [{"name": "b", "engine": "openai", "url": "http://engine-b.internal:8000", **backend}],
        "retries": {"max_attempts": 1}})
    app = create_app(settings, client_factory=control_plane, transport=MockTransport(answer))

    async def scenario() -> httpx.Response:
        await app.gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
                return await client.post("/v1/chat/completions", json=body)
        finally:
            await app.gateway.stop()

    return asyncio.run(scenario())


def test_a_line_that_is_not_sse_mid_stream_shows_no_part_of_the_key_it_echoed() -> None:
    def badsse(request: MockRequest) -> MockResponse:
        # the 80-character cut falls 26 characters into the key
        line = ("DEBUG " + "y" * 40 + " " + request.headers["Authorization"] + "\n\n").encode()
        return MockResponse(headers=SSE, pieces=[chunk("hello"), line, b"data: [DONE]\n\n"])

    r = through_gateway(badsse, {"api_key": KEY}, {**ASK, "stream": True})
    assert r.status_code == 200 and r.text.startswith(chunk("hello").decode())
    assert "not an SSE" in r.text and "[redacted]" in r.text, r.text
    assert leaked(KEY, r.text) is None, r.text


def test_a_200_body_that_is_not_json_shows_no_part_of_the_key_it_echoed() -> None:
    def bad200(request: MockRequest) -> MockResponse:
        return MockResponse(headers={"Content-Type": "text/html"},
                            body=("<html>" + "z" * 50 + request.headers["Authorization"] + "</html>").encode())

    r = through_gateway(bad200, {"api_key": KEY}, ASK)
    assert r.status_code == 502 and "not a JSON object" in r.json()["error"]["message"]
    assert leaked(KEY, r.text) is None, r.text


def test_a_plain_text_error_cut_at_500_characters_shows_no_part_of_the_basic_credentials() -> None:
    def echo400text(request: MockRequest) -> MockResponse:
        text = "x" * 470 + " auth=" + request.headers["Authorization"]  # the cut at 500 falls inside the token
        return MockResponse(400, headers={"Content-Type": "text/plain"}, body=text.encode())

    r = through_gateway(echo400text, {"basic_auth": BASIC}, ASK)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("x" * 470) and "[redacted]" in message, message
    assert leaked(TOKEN, message) is None and leaked(BASIC, message) is None, message
    shown = message.split("auth=", 1)[1]
    assert "alice" not in base64.b64decode(shown.removeprefix("Basic ").split("[")[0] + "==").decode("latin-1")


@pytest.mark.parametrize(("written", "secret"), [(KEY, KEY), (f"Basic {TOKEN}", TOKEN), (TOKEN, TOKEN),
                                               (BASIC, BASIC), (BASIC.split(":")[1], BASIC.split(":")[1])])
def test_wherever_the_cut_falls_no_beginning_of_a_credential_survives(written: str, secret: str) -> None:
    redactor = Redactor("b", "http://engine-b.internal:8000", [KEY, BASIC, f"Basic {TOKEN}", TOKEN, TOKEN.rstrip("="),
                                            BASIC.split(":")[1]])
    for before in range(0, 80 + len(written) + 2):
        text = "q" * before + written + " and more text after it " * 3
        for shown in (redactor.excerpt(text, 80), redactor.excerpt(text.encode(), 80),
                      redactor.excerpt(text[:90], 80, cut_short=True), redactor.scrub(text[:90], cut_short=True)):
            assert leaked(secret, shown, at_least=2) is None, (before, shown)


def test_an_error_body_cut_at_a_bound_before_the_gateway_saw_it_whole_shows_no_credential_beginning() -> None:
    redactor = Redactor("b", "http://engine-b.internal:8000", [KEY])
    body = b"boom " + KEY.encode()[:20]  # the rest of the body (and of the key) was never read
    shown = orjson.loads(normalise_upstream_error(500, body, "b", redactor, cut_short=True))["error"]["message"]
    assert shown == "boom [redacted] (backend b)", shown
