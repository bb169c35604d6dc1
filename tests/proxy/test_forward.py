"""Forwarding and failover through the transport seam: no sockets, a MockTransport answers for the backends
(and httpx's MockTransport for their control plane)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import looptime
import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.asgi import Message
from gateway.config import BackendSettings, TimeoutSettings, settings_from_mapping
from gateway.engines.base import EngineAdapter
from gateway.engines.registry import ENGINES
from gateway.pool.backend import Backend
from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import AttemptOptions, Forwarder
from gateway.proxy.transport import MockRequest, MockResponse, MockTransport
from gateway.proxy.upstream import UpstreamError

pytestmark = pytest.mark.unit

SSE = {"Content-Type": "text/event-stream"}


def chunk(content: str | None = None, **extra: Any) -> bytes:
    delta = {"content": content} if content is not None else {}
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": delta, **extra}]}) + b"\n\n"


USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


class Sink:
    """An ASGI ``send`` that keeps what the client would receive."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


def forward(engine: str, response: MockResponse, *, stream: bool = True, keep_usage: bool = False
            ) -> tuple[Exchange, Sink, MockTransport]:
    transport = MockTransport(lambda request: response)
    backend = Backend("b", engine, "http://b:8000", spec=ENGINES[engine])
    exchange = Exchange(request_id="r1", route="chat", t_start=0.0, stream=stream)
    sink = Sink()
    forwarder = Forwarder(transport, TimeoutSettings())
    asyncio.run(forwarder.forward(exchange, backend, b'{"model":"m"}', sink, AttemptOptions(keep_usage=keep_usage)))
    return exchange, sink, transport


def test_a_stream_is_relayed_and_accounted_and_the_backend_gets_the_request() -> None:
    pieces = [chunk("Hel"), chunk("lo"), chunk(finish_reason="stop"),
              b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n", b"data: [DONE]\n\n"]
    exchange, sink, transport = forward("vllm", MockResponse(headers=SSE, pieces=pieces))
    assert sink.status == 200 and sink.body == b"".join(pieces[:3]) + b"data: [DONE]\n\n", "usage not asked for"
    assert exchange.outcome == "success" and exchange.usage == USAGE and exchange.text_events == 2
    sent = transport.requests[0]
    assert sent.url == "http://b:8000/v1/chat/completions" and sent.headers["X-Request-Id"] == "r1"


def test_stream_quirks_are_honoured_only_for_the_engine_that_has_them() -> None:
    # TabbyAPI: "\r\n" line ends and a usage chunk that also carries the last choice
    last = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "!"}}], "usage": USAGE})
    pieces = [chunk("Hi").replace(b"\n", b"\r\n"), last + b"\r\n\r\n", b"data: [DONE]\r\n\r\n"]
    exchange, sink, _ = forward("tabbyapi", MockResponse(headers=SSE, pieces=pieces), keep_usage=True)
    events = [e for e in sink.body.split(b"\n\n") if e]
    assert b"\r" not in sink.body and len(events) == 4, events
    assert orjson.loads(events[1][6:])["choices"][0]["delta"] == {"content": "!"}
    assert orjson.loads(events[2][6:]) == {"choices": [], "usage": USAGE}
    # vLLM has neither habit: the same combined chunk passes as it came (its usage still counted)
    exchange, sink, _ = forward("vllm", MockResponse(headers=SSE, pieces=[last + b"\n\n", b"data: [DONE]\n\n"]),
                                keep_usage=True)
    assert sink.body == last + b"\n\ndata: [DONE]\n\n" and exchange.usage == USAGE


def test_engine_reported_timings_are_read_where_the_spec_says() -> None:
    body = orjson.dumps({"choices": [{"message": {"content": "x"}}], "usage": {**USAGE, "prompt_time": 0.5},
                         "timings": {"prompt_ms": 20.0, "predicted_ms": 30.0}})
    from gateway.proxy.accounting import _engine_times

    for engine, expected in (("llamacpp", (0.02, 0.03)), ("vllm", None)):
        exchange, _, _ = forward(engine, MockResponse(body=body), stream=False)
        exchange.backend = Backend("b", engine, "http://b", spec=ENGINES[engine])
        assert _engine_times(exchange) == expected


def test_a_connection_cut_mid_stream_ends_the_stream_with_an_error_event() -> None:
    pieces: list[bytes | BaseException] = [chunk("Hel"), ConnectionResetError("reset by peer")]
    exchange, sink, _ = forward("vllm", MockResponse(headers=SSE, pieces=pieces))
    assert sink.status == 200 and exchange.outcome == "upstream_failed"
    assert sink.body.startswith(chunk("Hel")) and sink.body.endswith(b"data: [DONE]\n\n")
    assert b'"code":"upstream_failed"' in sink.body


def test_a_failure_before_the_first_byte_raises_so_another_backend_can_be_tried() -> None:
    with pytest.raises(UpstreamError) as caught:
        forward("vllm", MockResponse(headers=SSE, pieces=[ConnectionResetError("reset")]))
    assert caught.value.code == "upstream_failed"


# --- the whole gateway, in process --------------------------------------------------------------------------
def control_plane(settings: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(200, json={}) if request.url.path == "/health" else httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=settings.url or "")


def test_failover_to_the_next_backend_through_the_transport() -> None:
    def data_plane(request: MockRequest) -> MockResponse:
        if request.url.startswith("http://a:1/"):
            return MockResponse(503, body=b'{"error": {"message": "overloaded"}}')
        body = orjson.loads(request.body)
        assert body["stream_options"] == {"include_usage": True}, "the gateway always asks for usage"
        return MockResponse(headers=SSE, pieces=[chunk("ok"), chunk(finish_reason="stop"), b"data: [DONE]\n\n"])

    settings = settings_from_mapping({
        "backends": [{"name": "a", "engine": "vllm", "url": "http://a:1"},
                     {"name": "b", "engine": "vllm", "url": "http://b:1"}],
        "routing": {"policy": "round-robin"},
    })
    transport = MockTransport(data_plane)
    registry = CollectorRegistry()
    app = create_app(settings, client_factory=control_plane, registry=registry, transport=transport)

    async def scenario() -> list[httpx.Response]:
        await app.gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
                return [await client.post("/v1/chat/completions", json={
                    "model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
                    for _ in range(2)]
        finally:
            await app.gateway.stop()

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200, 200]
    assert all(r.headers["x-gateway-backend"] == "b" for r in responses)
    assert b'"content":"ok"' in responses[0].content
    assert [r.url.split("/")[2] for r in transport.requests].count("a:1") == 1, "a was tried once, then b"
    assert registry.get_sample_value("gateway_retries_total", {"backend": "a", "reason": "status_503"}) == 1


def test_a_client_that_hangs_up_right_after_done_is_still_accounted() -> None:
    """The upstream keeps its connection open a moment after [DONE]; the client has its answer and hangs up,
    which cancels the forwarding task (the dispatcher's disconnect watcher does that): usage and the outcome
    must already be recorded."""
    pieces: list[bytes | BaseException] = [
        chunk("Hi"), b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\ndata: [DONE]\n\n", b": bye\n\n"]
    response = MockResponse(headers=SSE, pieces=pieces, delay=0.05)
    backend = Backend("b", "vllm", "http://b:8000", spec=ENGINES["vllm"])
    exchange = Exchange(request_id="r1", route="chat", t_start=0.0, stream=True)

    async def scenario() -> None:
        task = asyncio.current_task()
        assert task is not None

        async def send(message: Message) -> None:
            if b"[DONE]" in message.get("body", b""):
                asyncio.get_running_loop().call_soon(task.cancel)  # the client leaves at once

        with pytest.raises(asyncio.CancelledError):
            await Forwarder(MockTransport(lambda r: response), TimeoutSettings()).forward(
                exchange, backend, b"{}", send, AttemptOptions())

    asyncio.run(scenario())
    assert exchange.usage == USAGE and exchange.outcome == "success"


class _ReadResponse(MockResponse):
    """A response that hands its body to a sink as a real connection's reads do: ``reads``, each a list of pieces
    given in one callback, ``END`` among them for the body's end, a loop turn (and ``delay``) between reads: run it
    on a fake-time loop (looptime), where the delay orders the reads and no time passes."""

    END = b"<end>"

    def __init__(self, reads: list[list[bytes]], delay: float = 0.0) -> None:
        super().__init__(headers=SSE)
        self.reads = reads
        self.delay = delay

    def stream_to(self, sink: Any) -> None:
        async def feed() -> None:
            for read in self.reads:
                await asyncio.sleep(self.delay)  # fake time: the gap between two reads
                for piece in read:
                    if piece == self.END:
                        sink.end(None)
                    else:
                        sink.data(piece)

        asyncio.get_running_loop().create_task(feed())


class _Writer:
    """The server's direct writer, recording each write to the client."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, body: bytes) -> int:
        self.writes.append(body)
        return 1  # WRITTEN

    async def start(self, send: Any, message: Message, first: bytes) -> None:
        await send(message)
        self.writes.append(first)

    async def send_whole(self, send: Any, start: Message, body: bytes) -> None:
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def when_writable(self, callback: Any) -> None:
        raise AssertionError("never full here")

    def when_disconnected(self, callback: Any) -> None:
        pass


@pytest.mark.parametrize("end_with_done", [True, False])
def test_the_answers_last_events_go_with_the_responses_end_when_it_comes_in_the_same_read(end_with_done: bool) -> None:
    """[DONE] and the body's end in one upstream read: the client gets them in the response's last message (one
    write: uvicorn frames the last chunk and the end together); the end a read later: [DONE] is written at the
    loop's next turn, not held for it. Either way the client's bytes are the same, and the request accounted."""
    done = chunk(None, finish_reason="stop") + b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + \
        b"\n\ndata: [DONE]\n\n"
    end = [_ReadResponse.END]
    reads = [[chunk("Hi")], [chunk(" there")], [done, *end] if end_with_done else [done]]
    if not end_with_done:
        reads.append(end)
    response = _ReadResponse(reads, delay=0.01)
    backend = Backend("b", "vllm", "http://b:8000", spec=ENGINES["vllm"])
    exchange = Exchange(request_id="r1", route="chat", t_start=0.0, stream=True)
    sink, writer = Sink(), _Writer()
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        runner.run(Forwarder(MockTransport(lambda r: response), TimeoutSettings()).forward(
            exchange, backend, b"{}", sink, AttemptOptions(writer=writer)))
    last = sink.messages[-1]
    assert last["type"] == "http.response.body" and last["more_body"] is False
    finish = chunk(None, finish_reason="stop") + b"data: [DONE]\n\n"  # (the usage chunk removed: not asked for)
    if end_with_done:
        assert writer.writes == [chunk("Hi"), chunk(" there")] and last["body"] == finish
    else:
        assert writer.writes == [chunk("Hi"), chunk(" there"), finish] and last["body"] == b""
    assert exchange.usage == USAGE and exchange.outcome == "success" and exchange.text_events == 2
