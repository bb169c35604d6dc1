"""What translating an engine's answer to an agent API costs the event loop is bounded: the translation works item
by item in Python, ~7x parsing the answer (sweep 10: 714,000 empty tool calls in a 2.1 MB answer held the loop
2.8 s on /v1/responses; one 1 MB stream chunk of 333,000 logprob entries 0.67 s, and a loop of them took every
backend's health check past its timeout). So are the engine answers other code reads item by item: SGLang's
rerank answer, and a health or load answer only Python's JSON reader takes."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest

from gateway.engines.base import BackendError, json_of
from gateway.engines.sglang import MAX_RERANK_RESULTS, rerank_answer
from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

pytestmark = pytest.mark.unit


def _chat(message: dict[str, object]) -> bytes:
    return orjson.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _chunk(delta: dict[str, object], **choice: object) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                      "choices": [{"index": 0, "delta": delta, "finish_reason": None, **choice}]})


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_too_costly_to_translate_is_refused_and_the_stream_ends_failed(stream: bool) -> None:
    calls = [{}] * 150_000  # (within server.max_response_values: only the translation would cost too much)
    big = _chat({"content": None, "tool_calls": calls})
    entries = [{"token": "a", "logprob": 0.0}] * 30_000
    events = [_chunk({"content": "a"}, logprobs={"content": entries}), _chunk({"content": "b"}),
              b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}',
              b"data: [DONE]"]
    with ScriptedUpstream(mode="script") as upstream:
        upstream.script = (lambda headers: (200, "text/event-stream", [b"\n\n".join(events) + b"\n\n"])) if stream \
            else (lambda headers: (200, "application/json", [big]))
        _, server = gateway_over(upstream, backend={"engine": "llamacpp"})
        with server as gw:
            r = httpx.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "stream": stream},
                           timeout=30)
    if stream:
        assert r.status_code == 200 and b"response.failed" in r.content and b"too large to translate" in r.content
        assert b'"logprob"' not in r.content  # (not asked for: never translated)
    else:
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_response_too_large", r.text


def test_sglangs_rerank_answer_and_health_answers_are_bounded_before_their_items_are_read() -> None:
    one = {"index": 0, "score": 0.5, "document": "a"}
    assert orjson.loads(rerank_answer(orjson.dumps([one]), "m"))["results"][0]["relevance_score"] == 0.5
    with pytest.raises(ValueError, match="more than any request asks for"):
        rerank_answer(orjson.dumps([one] * (MAX_RERANK_RESULTS + 1)), "m")
    nan = httpx.Response(200, content=b'{"running": NaN}')
    assert json_of(nan, "/load") == {"running": None}  # (Python's reader for what a Python engine writes)
    huge = httpx.Response(200, content=b'{"x": [' + b"[]," * 200_000 + b'NaN]}')
    with pytest.raises(BackendError, match="too large"):
        json_of(huge, "/load")


def test_a_stream_cut_before_its_usage_is_charged_its_bodys_estimate_where_the_rendering_says_less() -> None:
    """Sweep 10: a stream cut before its usage chunk was charged the rendered prompt (messages and tools) plus the
    text relayed; 8 KB of ``documents`` (which vLLM hands chat templates) per request was charged nothing, and one
    key passed ~20x its tokens per minute that way."""
    from gateway.api.proxy_endpoint import _tokens_used  # (the charge, as the front door settles it)
    from gateway.proxy.exchange import Exchange
    from gateway.routing.request import RouteRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "documents": [{"text": "x" * 8000}]}
    request = RouteRequest(model="m", route="chat", stream=True, max_tokens=None, body=body)
    exchange = Exchange(request_id="r", route="chat", t_start=0.0, stream=True, request=request)
    exchange.backend = object()  # type: ignore[assignment]  # (a backend was reached)
    exchange.reserve, exchange.body_tokens, exchange.text_events = 1500, 2010, 1
    assert _tokens_used(exchange) == 2010 + 4  # (an event may carry four tokens: below)
    # sweep 24: llama.cpp sends a 4-byte character's 4 byte tokens as one event: a key asking for emoji with
    # max_tokens 1,800 and hanging up before the usage was charged 450 for 1,800 (2.8x its tokens per minute,
    # sustained). A stream cut before its usage pays at least what its key reserved, as a whole answer does.
    exchange.reserve, exchange.text_events = 2010 + 1800, 450
    assert _tokens_used(exchange) == 2010 + 1800
    # sweep 25: without max_tokens the reservation is auth.reserve_tokens while llama.cpp generates to the context's
    # end: 1,000 such events cut before the usage paid ~1,139 tokens for 4,000. Each pays four.
    exchange.reserve, exchange.text_events = 10 + 1024, 1000
    assert _tokens_used(exchange) == 2010 + 4000


@pytest.mark.parametrize(("text", "escaped", "engine_tokens"), [
    ("\U0001d400" * 1000, False, 4000), ("\U0001d400" * 1000, True, 4000), ("1234567890" * 400, False, 4000)],
    ids=["rare-characters-utf-8", "rare-characters-json-escaped", "digits"])
def test_a_stream_cut_before_its_usage_is_charged_the_most_its_prompt_can_cost(text: str, escaped: bool,
                                                                              engine_tokens: int) -> None:
    """Sweeps 16 and 17: a stream cut after its first event was charged a quarter token per byte of its body, but
    an engine whose vocabulary falls back to bytes counts each of a rare character's four bytes, and Llama 2's
    and Mistral's tokenizers split digits one to a token: one key had 3.8 to 3.9 times its tokens per minute
    generated for it. A request the engine did not count pays the most its prompt can cost: a token a byte of
    its body, whatever the client sent (UTF-8 or JSON escapes)."""
    from gateway.api.proxy_endpoint import _tokens_used
    from gateway.proxy.exchange import Exchange, estimate_tokens
    from gateway.routing.request import RouteRequest

    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    raw = json.dumps(body, ensure_ascii=escaped).encode()
    request = RouteRequest(model="m", route="chat", stream=True, max_tokens=None, body=body)
    exchange = Exchange(request_id="r", route="chat", t_start=0.0, stream=True, request=request)
    exchange.backend = object()  # type: ignore[assignment]  # (a backend was reached)
    exchange.body_tokens, exchange.body_bytes, exchange.text_events = estimate_tokens(raw), len(raw), 1
    assert _tokens_used(exchange) >= engine_tokens + 1
    assert estimate_tokens("abcd" * 100) == estimate_tokens(b"abcd" * 100) == 100, "ASCII estimates as before"


def test_a_native_messages_stream_completes_its_first_message_start_once_whatever_follows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweep 11: each message_start lacking type or role re-read the whole block: 2,000 of them in one block held
    the event loop 6 s. Each event is read once; only the stream's first message_start is completed."""
    from gateway.api import native_apis
    from gateway.api.native_apis import StreamTap

    parsed = 0
    loads = native_apis.orjson.loads

    def counted(data: bytes) -> object:
        nonlocal parsed
        parsed += 1
        return loads(data)

    monkeypatch.setattr(native_apis.orjson, "loads", counted)
    start = b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":3}}}'
    block = b"\n\n".join([start] * 4000) + b"\n\n"
    tap = StreamTap("messages")
    out = tap.feed(block)
    first, rest = out.split(b"\n\n", 1)
    assert b'"role":"assistant"' in first and b'"role"' not in rest and tap.usage == {"input_tokens": 3}
    assert parsed == 4000  # (once each: it was once per message_start for each of them, 16 million)


@pytest.mark.integration
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_translated_stream_that_fails_ends_at_once_and_lets_the_engine_go(path: str) -> None:
    """Sweep 14: after a translated stream failed (an engine's error event, a bound passed), the client's
    connection stayed open and silent, and the request held its backend slot, until the engine stopped (25 s
    there; timeouts.total, 900 s, at worst). The response now ends with the failure, and the upstream is let go."""
    from tests.waiting import wait_until

    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    pieces = [_chunk({"content": "a"}) + b"\n\n", error] + [_chunk({"content": "b"}) + b"\n\n"] * 100
    with ScriptedUpstream(mode="script", every=0.05) as upstream:  # (the rest: 5 s, a piece every 50 ms)
        upstream.script = lambda headers: (200, "text/event-stream", pieces)
        app, server = gateway_over(upstream)  # (an OpenAI-compatible server: both APIs translated)
        with server as gw:
            body = {"model": "m", "stream": True,
                    **({"input": "hi"} if path == "/v1/responses" else {"max_tokens": 16, "messages": [
                        {"role": "user", "content": "hi"}]})}
            r = httpx.post(gw.url + path, json=body, timeout=30)
            assert r.status_code == 200 and b"boom" in r.content, r.text[:300]
            assert (b"response.failed" if path == "/v1/responses" else b"event: error") in r.content
            assert upstream.written < len(pieces)  # (the client's answer ended before the engine's: ~5 s)
            wait_until(lambda: app.gateway.pool.get("scripted").in_flight == 0, "the request let go of its backend")
            assert upstream.written < len(pieces), upstream.written  # (and the engine's answer was let go)


def test_a_whole_answer_without_max_tokens_that_ends_without_usage_is_charged_its_backends_context() -> None:
    """Sweep 28: a json_schema of long strings made llama-server write ~6,000 tokens and answer 500; without
    max_tokens the request was charged its reservation (~1,100-1,600), and failing over charged each engine its
    prompt: a key had 5.7x (chat) and 6.2x (Responses, through two llama-servers) its tokens per minute generated,
    sustained. Such an answer, ended without the engine's count, is charged what it may have generated."""
    from types import SimpleNamespace

    from gateway.api.proxy_endpoint import _tokens_used
    from gateway.proxy.exchange import Exchange
    from gateway.routing.request import RouteRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request = RouteRequest(model="m", route="chat", stream=False, max_tokens=None, body=body)
    exchange = Exchange(request_id="r", route="chat", t_start=0.0, stream=False, request=request)
    exchange.backend = SimpleNamespace(capacity=SimpleNamespace(context_length=8192))  # type: ignore[assignment]
    exchange.reserve, exchange.body_tokens, exchange.outcome = 1100, 60, "upstream_error"
    assert _tokens_used(exchange) == 8192
    exchange.failed_over = 1
    assert _tokens_used(exchange) == 2 * 8192
    exchange.outcome, exchange.failed_over = "success", 0  # (a whole answer without usage: its estimate, as before)
    assert _tokens_used(exchange) == 1100
    bounded = RouteRequest(model="m", route="chat", stream=False, max_tokens=50, body=body)
    exchange.request, exchange.outcome = bounded, "upstream_error"  # (bounded: its reservation is the most)
    assert _tokens_used(exchange) == 1100
