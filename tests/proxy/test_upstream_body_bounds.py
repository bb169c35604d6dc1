"""What the gateway reads of a backend's answer is bounded: an error body up to 64 KiB (the rest never read), a
non-streamed answer up to ``server.max_response_bytes`` (past it a 502 naming the setting, found without reading
the rest). The security sweep saw two 400s of 200 MB relayed whole take 1.15 GB and stall a healthy backend's
request for 3.5 s, and four 200 answers of 200 MB take 1.7 GB."""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway.proxy.forward import ERROR_BODY_BYTES
from gateway.proxy.transport import MockResponse
from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over
from tests.proxy.test_forward import forward

ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SIZE = 64 << 20  # far past what socket buffers hold: what the gateway did not take, the backend could not send


@pytest.mark.parametrize("chunked", [False, True])
def test_a_huge_error_body_is_relayed_cut_short_and_never_read_whole(chunked: bool) -> None:
    with ScriptedUpstream(mode="huge_error", size=SIZE, chunked=chunked) as upstream:
        _app, server = gateway_over(upstream)
        with server as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json=ASK, timeout=30)
    assert r.status_code == 400 and r.headers["x-gateway-backend"] == "scripted"
    assert len(r.content) < 1024, "the client gets what an error says, not 64 MB of it"
    assert r.json()["error"]["message"].startswith('{"error": {"message": "EEEE')
    assert upstream.sent < SIZE // 2, f"the gateway took {upstream.sent} bytes of the error body"


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_past_max_response_bytes_is_a_502_naming_the_setting_and_is_not_read_whole(chunked: bool) -> None:
    with ScriptedUpstream(mode="huge_answer", size=SIZE, chunked=chunked) as upstream:
        app, server = gateway_over(upstream, server={"max_response_bytes": 4 << 20})
        with server as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json=ASK, timeout=30)
            metrics = httpx.get(gw.url + "/metrics").text
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_response_too_large" and "server.max_response_bytes" in error["message"]
    assert upstream.sent < SIZE // 2, f"the gateway took {upstream.sent} bytes of the answer"
    assert upstream.posts == 1, "not retried: any backend would answer as much"
    assert app.gateway.pool.get("scripted").breaker.state.value == "closed"
    assert 'outcome="upstream_response_too_large"' in metrics


def test_an_answer_within_max_response_bytes_is_served_whole() -> None:
    with ScriptedUpstream(mode="huge_answer", size=3 << 20) as upstream:
        _app, server = gateway_over(upstream, server={"max_response_bytes": 4 << 20})
        with server as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json=ASK, timeout=30)
    assert r.status_code == 200 and len(r.content) == 3 << 20


def test_an_error_body_past_the_bound_is_cut_before_it_is_parsed() -> None:
    body = b'{"error": {"message": "' + b"E" * (2 * ERROR_BODY_BYTES) + b'"}}'
    exchange, sink, _ = forward("vllm", MockResponse(400, body=body), stream=False)
    assert sink.status == 400 and exchange.outcome == "upstream_error"
    assert len(sink.body) < 1024, "a cut JSON body is shown as text: its first 500 characters"


def _chat_answer(extra: dict[str, object]) -> bytes:
    return orjson.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop", **extra}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2_000, "total_tokens": 2_001}})


@pytest.mark.parametrize("shape", ["logprobs", "strings", "numbers", "keys"])
def test_an_answer_costing_more_than_max_response_values_to_parse_is_a_502_before_it_is_parsed(shape: str) -> None:
    """Sweep 8: a valid 50 MB answer of 1.2M logprob objects held the event loop 2.2 s (parsed, then again by the
    credential scrub); sweep 9: 60 MB of short strings, counted as no objects, 2.6 s. The gateway parses every
    answer: what that costs is counted first, and past the bound it is refused as too large an answer is: the
    request's doing, not retried, no failure of the backend's. Sweep 15: one object of 1.5M distinct keys was
    counted 3M units (each key 2) and held the loop 0.7-1.4 s, translated answers parsed before they were counted."""
    token = {"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": [{"token": "t", "logprob": -1.0}] * 4}
    extra: dict[str, object] = {"logprobs": {"content": [token] * 2_000}} if shape == "logprobs" else {
        "x_payload": ["a"] * 70_000 if shape == "strings" else list(range(140_000)) if shape == "numbers" else
        {f"k{i}": 1 for i in range(20_000)}}  # (sweep 15: distinct keys cost ~6 units each; counted as 2 before)
    answer = _chat_answer(extra)
    with ScriptedUpstream(mode="script") as upstream:
        upstream.script = lambda headers: (200, "application/json", [answer])
        app, server = gateway_over(upstream, server={"max_response_values": 100_000})
        with server as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json=ASK, timeout=30)
        with gateway_over(upstream, server={"max_response_values": 300_000})[1] as roomier:
            whole = httpx.post(roomier.url + "/v1/chat/completions", json=ASK, timeout=30)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "upstream_response_too_large" and "server.max_response_values" in error["message"]
    assert upstream.posts == 2, "not retried: any backend would answer as much"
    assert app.gateway.pool.get("scripted").breaker.state.value == "closed"
    assert whole.status_code == 200 and whole.content == answer


def test_a_large_answer_echoing_the_backends_credentials_is_refused_not_walked() -> None:
    """Sweep 9: the scrub walks every string of an answer that holds the backend's credentials (60 MB: 9.6 s of
    the event loop). Over 1 MiB such an answer is refused; a small one is scrubbed as before."""
    key = "sk-BACKENDSECRETaaaa1111"
    big = _chat_answer({"x_payload": ["abcdefghij" * 10] * 12_000 + [key]})
    small = _chat_answer({"x_payload": [key]})
    with ScriptedUpstream(mode="script") as upstream:
        answers = [big, small]
        upstream.script = lambda headers: (200, "application/json", [answers.pop(0)])
        _, server = gateway_over(upstream, backend={"api_key": key}, retries={"max_attempts": 1})
        with server as gw:
            refused = httpx.post(gw.url + "/v1/chat/completions", json=ASK, timeout=30)
            scrubbed = httpx.post(gw.url + "/v1/chat/completions", json=ASK, timeout=30)
    assert refused.status_code == 502 and key not in refused.text and "holds its own credentials" in refused.text
    assert scrubbed.status_code == 200 and key not in scrubbed.text and "[redacted]" in scrubbed.text
