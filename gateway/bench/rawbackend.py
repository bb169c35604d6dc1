"""A streaming OpenAI-compatible backend that costs almost nothing per token, for overhead benchmarks.

Raw asyncio protocol (uvloop when installed), HTTP/1.1 keep-alive, chunked transfer encoding, every event
pre-encoded once. It answers:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: ``max_tokens`` (default ``--tokens``) events,
  the first at once and then one every ``--gap-ms`` (a request may set ``bench_gap_ms``), a final
  ``finish_reason`` event, a usage event when ``stream_options.include_usage`` is true, then ``[DONE]``.
  Non-streaming requests get one JSON body with usage.
* ``GET /health``, ``/v1/models``, ``/get_model_info``, ``/get_server_info`` (what routers probe);
  ``GET /stats``: streams open now, the most open at once, and requests served.

``python -m gateway.bench.rawbackend --port 18500 [--tokens 16] [--gap-ms 5] [--model bench-model]``.
It never inspects prompts; ``prompt_tokens`` is the body's byte length / 4, only so that usage is present.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

MAX_TOKENS = 100_000


@dataclass
class RawBackendConfig:
    model: str = "bench-model"
    tokens: int = 16
    gap_ms: float = 5.0


@dataclass
class RawStats:
    open_streams: int = 0
    peak_streams: int = 0
    requests: int = 0
    chunks: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _chunk(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


class _Events:
    """The pre-encoded SSE events for one route."""

    def __init__(self, model: str, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.chat = chat
        base: dict[str, Any] = {"id": "bench-0", "object": obj, "created": 0, "model": model}

        def event(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
            doc = {**base, "choices": [choice] if choice else []}
            if usage is not None:
                doc["usage"] = usage
            return _chunk(b"data: " + orjson.dumps(doc) + b"\n\n")

        if chat:
            self.token = event({"index": 0, "delta": {"content": " tok"}, "finish_reason": None})
            self.first = event({"index": 0, "delta": {"role": "assistant", "content": " tok"},
                                "finish_reason": None})
            self.final = event({"index": 0, "delta": {}, "finish_reason": "length"})
        else:
            self.token = event({"index": 0, "text": " tok", "finish_reason": None})
            self.first = self.token
            self.final = event({"index": 0, "text": "", "finish_reason": "length"})
        self._event = event
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def usage(self, prompt: int, completion: int) -> bytes:
        return self._event(None, {"prompt_tokens": prompt, "completion_tokens": completion,
                                  "total_tokens": prompt + completion})


_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n")


def _response(status: int, body: bytes, reason: bytes = b"OK") -> bytes:
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, len(body), body))


class _Stream:
    __slots__ = ("handle", "left", "loop", "proto", "tail")

    def __init__(self, proto: _Protocol, left: int, tail: bytes) -> None:
        self.proto = proto
        self.left = left
        self.tail = tail
        self.loop = asyncio.get_running_loop()
        self.handle: asyncio.TimerHandle | None = None


class _Protocol(asyncio.Protocol):
    def __init__(self, server: RawBackend) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.stream: _Stream | None = None
        self.pending: list[bytes] = []  # requests that arrived while a stream was running (pipelining)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            if self.stream.handle is not None:
                self.stream.handle.cancel()
            self.stream = None
            self.server.stats.open_streams -= 1
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.stream is None:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            body = self.buf[head_end + 4 : end]
            self.buf = self.buf[end:]
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            self._handle(method, path, body)

    def _handle(self, method: bytes, path: bytes, body: bytes) -> None:
        server = self.server
        transport = self.transport
        if transport is None:
            return
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            server.stats.requests += 1
            self._generate(path == b"/v1/chat/completions", body)
        elif method == b"GET" and path in server.static:
            transport.write(server.static[path])
        elif method == b"GET" and path == b"/stats":
            s = server.stats
            transport.write(_response(200, orjson.dumps({"open_streams": s.open_streams,
                                                         "peak_streams": s.peak_streams,
                                                         "requests": s.requests, "chunks": s.chunks})))
        elif method == b"POST" and path == b"/stats/reset":
            server.stats.peak_streams = server.stats.open_streams
            transport.write(_response(200, b"{}"))
        else:
            transport.write(_response(404, b'{"error":{"message":"not found","type":"invalid_request_error"}}',
                                      b"Not Found"))

    def _generate(self, chat: bool, raw: bytes) -> None:
        server = self.server
        transport = self.transport
        assert transport is not None
        try:
            req = orjson.loads(raw)
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            transport.write(_response(400, b'{"error":{"message":"bad JSON","type":"invalid_request_error"}}',
                                      b"Bad Request"))
            return
        tokens = req.get("max_tokens") or req.get("max_completion_tokens") or server.config.tokens
        tokens = max(1, min(int(tokens), MAX_TOKENS))
        prompt = max(1, len(raw) // 4)
        events = server.chat_events if chat else server.text_events
        if not req.get("stream"):
            text = " tok" * tokens
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "length"} if chat
                                      else {"index": 0, "text": text, "finish_reason": "length"})
            doc = {"id": "bench-0", "object": "chat.completion" if chat else "text_completion", "created": 0,
                   "model": server.config.model, "choices": [choice],
                   "usage": {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}}
            transport.write(_response(200, orjson.dumps(doc)))
            return
        options = req.get("stream_options")
        tail = events.final
        if isinstance(options, dict) and options.get("include_usage"):
            tail += events.usage(prompt, tokens)
        tail += events.done
        gap = req.get("bench_gap_ms")
        gap_s = (float(gap) if isinstance(gap, int | float) else server.config.gap_ms) / 1000
        stream = _Stream(self, tokens, tail)
        self.stream = stream
        server.stats.open_streams += 1
        server.stats.peak_streams = max(server.stats.peak_streams, server.stats.open_streams)
        transport.write(_STREAM_HEAD + events.first)
        server.stats.chunks += 1
        stream.left -= 1
        self._next(stream, events.token, gap_s)

    def _next(self, stream: _Stream, token: bytes, gap_s: float) -> None:
        if stream.left <= 0:
            self._finish(stream)
            return

        def tick() -> None:
            if self.stream is not stream or self.transport is None:
                return
            self.transport.write(token)
            self.server.stats.chunks += 1
            stream.left -= 1
            self._next(stream, token, gap_s)

        stream.handle = stream.loop.call_later(gap_s, tick)

    def _finish(self, stream: _Stream) -> None:
        if self.transport is not None:
            self.transport.write(stream.tail)
        self.stream = None
        self.server.stats.open_streams -= 1
        if self.buf:
            self.data_received(b"")


class RawBackend:
    """The server; ``await start()`` then ``url``; ``await stop()``."""

    def __init__(self, config: RawBackendConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config or RawBackendConfig()
        self.host = host
        self.port = port
        self.stats = RawStats()
        self.chat_events = _Events(self.config.model, chat=True)
        self.text_events = _Events(self.config.model, chat=False)
        models = orjson.dumps({"object": "list", "data": [{"id": self.config.model, "object": "model",
                                                           "created": 0, "owned_by": "bench"}]})
        info = orjson.dumps({"model_path": self.config.model, "tokenizer_path": None, "is_generation": True})
        self.static = {
            b"/health": _response(200, b"{}"),
            b"/health_generate": _response(200, b"{}"),
            b"/v1/models": _response(200, models),
            b"/get_model_info": _response(200, info),
            b"/model_info": _response(200, info),
            b"/get_server_info": _response(200, b'{"max_total_num_tokens": 1000000}'),
            b"/server_info": _response(200, b'{"max_total_num_tokens": 1000000}'),
        }
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Protocol(self), self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None


async def _serve(args: argparse.Namespace) -> None:
    backend = RawBackend(RawBackendConfig(model=args.model, tokens=args.tokens, gap_ms=args.gap_ms),
                         args.host, args.port)
    await backend.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"raw backend on {backend.url} ({args.tokens} tokens, {args.gap_ms} ms apart)", flush=True)
    await stop.wait()
    await backend.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.rawbackend", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18500)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--model", default="bench-model")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
