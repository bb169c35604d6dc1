"""Forward one request to one backend and relay the answer to the client.

Contract: :meth:`Forwarder.forward` raises :class:`UpstreamError` only while nothing has been sent to the
client (so the caller may answer with an error or try another backend). Once the first byte is out, every
failure ends the client's stream with a well-formed OpenAI error event instead.

A streamed response's headers are sent to the client with the upstream's first event, not with the
upstream's headers: until then a failure can still become a clean HTTP error.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from gateway.asgi import EVENT_STREAM, FULL, ClientWriter, Headers, Message, Send, send_body
from gateway.config import TimeoutSettings
from gateway.errors import error_body, normalise_upstream_error
from gateway.pool.backend import Backend
from gateway.proxy.cache_figures import FieldPath, without
from gateway.proxy.exchange import Exchange
from gateway.proxy.sse import InvalidStream, SSERelay, text_events_in
from gateway.proxy.stall_guard import Watched
from gateway.proxy.transport import BodySink, Transport, UpstreamResponse
from gateway.proxy.upstream import ResponseTooLarge, Stopped, UpstreamError

# what is read of a backend's error body (the rest is never read, and its connection closed): an error worth
# relaying says what went wrong in far fewer bytes, and one of hundreds of MB held memory and the event loop
ERROR_BODY_BYTES = 64 * 1024

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
         "rerank": "/v1/rerank"}
# other paths clients use for a route (the engines' own aliases): served as the route, sent on its path
ALIASES = {"/rerank": "rerank", "/v2/rerank": "rerank", "/v1/reranking": "rerank"}


class InvalidOutput(Exception):
    """A non-streamed answer failed its structured-output check, and the caller asked to retry elsewhere."""


class RetryableStatus(Exception):
    """The backend answered a status worth trying elsewhere, and the caller may still do so. Nothing was sent
    to the client."""

    def __init__(self, status: int, body: bytes, cut_short: bool = False) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body
        self.cut_short = cut_short  # ``body`` is the beginning of a longer one (ERROR_BODY_BYTES)


@dataclass(frozen=True, slots=True)
class NativeApi:
    """An agent API (Responses, Messages) passed through to an engine that serves it: its path, and how its
    own event stream shows generated output, ends, and carries an error the gateway must report."""

    path: str
    generated: Callable[[bytes], int]  # how many events of a block carry generated output
    end: re.Pattern[bytes]  # the stream's last event (these streams have no [DONE])
    error_event: Callable[[str, str, str | None], bytes]  # (message, type, code) -> a whole SSE event
    # the engine's non-streamed answer in the API's shape, where the engine answers in its own (a token count
    # from an engine that only tokenizes); a ValueError is an answer it should not have given (502)
    answer: Callable[[bytes], bytes] | None = None


@dataclass(slots=True)
class AttemptOptions:
    """How to forward one attempt."""

    keep_usage: bool = False  # the client asked for the usage chunk
    headers: Sequence[tuple[bytes, bytes]] = ()  # extra response headers for the client
    upstream_headers: dict[str, str] | None = None  # extra request headers for the backend (trace context)
    # structured-output check of a non-streamed answer: why it fails (None: it passes), why it was not checked
    check: Callable[[bytes], Awaitable[tuple[str | None, str | None]]] | None = None
    retry_invalid: bool = False  # raise InvalidOutput instead of marking a failing answer
    retry_statuses: frozenset[int] = frozenset()  # raise RetryableStatus for these instead of answering
    writer: ClientWriter | None = None  # the server's direct writer to the client, where it offers one
    native: NativeApi | None = None  # the client's agent API, sent as it came to an engine that serves it
    # the engine's non-streamed answer in the shape the gateway serves (EngineAdapter.rewrite_answer)
    rewrite: Callable[[bytes], bytes] | None = None
    # answer fields the client must not see (the engine's cache figures: gateway.proxy.cache_isolation)
    hidden: Sequence[FieldPath] = ()
    on_status: Callable[[int], None] | None = None  # told the backend's status as soon as it answers
    watched: Watched | None = None  # the stall guard's note of it, given the means to stop it while it is forwarded


UNBOUNDED_TOKENS = 1 << 20  # what a request without max_tokens may generate, where its backend's context is unknown
EXTRA_EVENTS = 256  # an engine's events beside its tokens' (role, finish, usage, an agent API's block events)


def _max_events(exchange: Exchange, backend: Backend) -> int:
    """The most data events a stream may carry: one a token of each generation, up to its max_tokens (else its
    backend's context), and EXTRA_EVENTS."""
    request = exchange.request
    tokens = (request.max_tokens if request is not None and request.max_tokens is not None
              else backend.capacity.context_length or UNBOUNDED_TOKENS)
    generations = request.generations if request is not None else 1
    return tokens * max(1, generations) + EXTRA_EVENTS


class Forwarder:
    """Forwards attempts through ``transport``. A non-streamed answer is read up to ``max_response_bytes`` (past it:
    :class:`~gateway.proxy.upstream.ResponseTooLarge`, found without reading the rest; as well past
    ``max_response_values`` JSON values weighted by their cost to parse, counted before any is: see
    :func:`parse_units`), an error body up to
    ``ERROR_BODY_BYTES`` (the rest cut)."""

    def __init__(self, transport: Transport, timeouts: TimeoutSettings, max_response_bytes: int = 64 << 20,
                 max_response_values: int = 5_000_000) -> None:
        self._transport = transport
        self._timeouts = timeouts
        self._max_response_bytes = max_response_bytes
        self._max_response_values = max_response_values

    def set_timeouts(self, timeouts: TimeoutSettings) -> None:
        """Reloaded timeouts, for the requests that start from now on."""
        self._timeouts = timeouts

    async def forward(
        self, exchange: Exchange, backend: Backend, payload: bytes, send: Send, options: AttemptOptions,
    ) -> None:
        loop = asyncio.get_running_loop()
        t = self._timeouts
        exchange.t_dispatch = time.perf_counter()
        deadline = loop.time() + t.total
        headers = {**backend.request_headers, "X-Request-Id": exchange.request_id,
                   "X-Gateway-Hops": str(exchange.hops + 1)}
        if exchange.stream and not backend.spec.keeps_alive_after_stream:
            headers["Connection"] = "close"  # it closes anyway: never pool the connection
        if options.upstream_headers:
            headers.update(options.upstream_headers)
        native = options.native
        url = backend.url + (native.path if native is not None else
                             PATHS[exchange.request.route if exchange.request is not None else exchange.route])
        client_headers: Headers = [
            (b"x-request-id", exchange.request_id.encode()),
            (b"x-gateway-backend", backend.name.encode()),
            *options.headers,
        ]
        stream: _Stream | None = None
        clock = _Clock(loop, min(loop.time() + t.first_byte, deadline), t.idle, deadline)
        if options.watched is not None:
            options.watched.stop = clock.stop
        try:
            try:
                response = await self._transport.post(url, payload, headers)
                try:
                    exchange.status = response.status
                    if response.status < 500:
                        backend.answered += 1  # it is up, whatever its health check says (Pool.scrape_once)
                    if options.on_status is not None:
                        options.on_status(response.status)
                    if response.status != 200:
                        if not 400 <= response.status <= 599:
                            # (no answer of an inference API: relayed, a 204 or 304 with a body broke the client's
                            # connection, and a status past 599 the gateway's own, sweep 19)
                            raise UpstreamError(f"it answered HTTP {response.status}, neither an answer nor an error")
                        raw, cut_short = await response.read_prefix(ERROR_BODY_BYTES)
                        if response.status in (401, 403):
                            # the backend refused the gateway's own credentials for it: the client's key was
                            # fine, so never show it the engine's 401 as if it were about its key
                            raise UpstreamError(f"the backend refused the gateway's credentials for it (HTTP "
                                                f"{response.status}); check its api_key", auth=True)
                        if response.status in options.retry_statuses:
                            raise RetryableStatus(response.status, raw, cut_short)
                        exchange.outcome = "upstream_error"
                        exchange.responded = True
                        body = normalise_upstream_error(response.status, raw, backend.name, backend.secrets,
                                                        cut_short=cut_short)
                        await send_body(send, response.status, body, client_headers, writer=options.writer)
                        return
                    content_type = response.headers.get("Content-Type", "")
                    if not exchange.stream or not content_type.startswith("text/event-stream"):
                        raw = await response.read(self._max_response_bytes)
                        # every answer is parsed here, on the event loop, and again by an agent API's translation:
                        # what that costs is counted first (in C, ~3 ms a MiB) and bounded
                        limit = self._max_response_values
                        if len(raw) > PARSE_COUNTED_BYTES and parse_units(raw) > limit:
                            raise ResponseTooLarge(limit, values=True)
                        if len(raw) > SCRUB_WALK_BYTES and backend.secrets.echoed(raw):
                            # the scrub walks every string of the answer in Python (60 MB: 9.6 s): an engine echoing
                            # its credentials into an answer this large gets it refused rather than walked
                            raise UpstreamError(f"the backend's answer of {len(raw)} bytes holds its own credentials "
                                                f"(more than {SCRUB_WALK_BYTES} bytes are not scrubbed)")
                        if options.rewrite is not None:
                            try:
                                raw = options.rewrite(raw)
                            except ValueError as exc:
                                raise UpstreamError(f"the backend answered 200 with a body it should not: "
                                                    f"{exc}: {backend.secrets.excerpt(raw, 80)!r}") from None
                        doc = self._account_body(exchange, raw)
                        if doc is None:
                            raise UpstreamError(f"the backend answered 200 with a body that is not a JSON object: "
                                                f"{backend.secrets.excerpt(raw, 80)!r}")
                        if engine_error(doc):
                            # an engine failing with a 200 (an error and no answer) fails like one that says so:
                            # relayed, a huge one was scrubbed whole on the loop (60 MB: other keys stalled 3.7 s)
                            # and never failed over (sweep 22); the message is an excerpt, scrubbed as an error's
                            raise UpstreamError("the backend answered 200 with an error and no answer: "
                                                + backend.secrets.excerpt(_error_text(doc), 300), answered=True)
                        if native is None and exchange.route in ("chat", "completions") and not (
                                isinstance(doc.get("choices"), list) and doc["choices"]):
                            # (no choice is no answer: relayed, an engine answering {"choices": []} at once drew the
                            # traffic of a latency-led policy and was never failed over, sweep 23)
                            raise UpstreamError("the backend answered 200 with no choice: "
                                                + backend.secrets.excerpt(raw.decode(errors="replace"), 120),
                                                answered=True)
                        shown = without(doc, options.hidden) if options.hidden else None
                        # an answer's error member (a failed Responses object) is scrubbed as an error is, its
                        # address too (sweep 21: a path token echoed there reached the client), where it is small;
                        # the answer, for credentials alone (bytes.find: walked only where it matches)
                        failed = doc.get("error")
                        if failed and len(raw) > SCRUB_WALK_BYTES:
                            raise UpstreamError(f"the backend's answer of {len(raw)} bytes holds an error (more than "
                                                f"{SCRUB_WALK_BYTES} bytes are not scrubbed)")
                        if failed or backend.secrets.echoed(raw):
                            target = shown if shown is not None else doc
                            scrubbed = backend.secrets.scrub_json(target, address=False)
                            if isinstance(failed, str):
                                target["error"] = backend.secrets.scrub(failed)
                                scrubbed = scrubbed or target["error"] != failed
                            elif failed and backend.secrets.scrub_json(target["error"], address=True):
                                scrubbed = True
                            if scrubbed:
                                shown = target
                        if shown is not None:
                            raw = orjson.dumps(shown)
                        problem, unchecked = await options.check(raw) if options.check is not None else (None, None)
                        if unchecked is not None:
                            exchange.output_unchecked = unchecked
                            client_headers.append((b"x-gateway-output-unchecked", _header_text(unchecked)))
                        if problem is not None:
                            exchange.invalid_output = problem
                            if options.retry_invalid:
                                raise InvalidOutput(problem)
                            client_headers.append((b"x-gateway-output-invalid", _header_text(problem)))
                        exchange.outcome = "success"
                        exchange.responded = True
                        await send_body(send, 200, raw, client_headers, writer=options.writer)
                        return
                    relay = SSERelay(options.keep_usage, backend.secrets, backend.spec.stream,
                                     native.end if native is not None else None,
                                     None if native is not None else partial(_reshape_error, backend),
                                     options.hidden, _max_events(exchange, backend))
                    stream = _Stream(exchange, relay, clock,
                                     native.generated if native is not None else text_events_in)
                    stream_to = getattr(response, "stream_to", None)
                    if options.writer is not None and stream_to is not None:
                        last = await _relay_direct(stream, response, stream_to, options.writer, send, client_headers)
                    else:
                        last = await _relay_awaiting(stream, response, send, client_headers)
                    try:
                        flushed = relay.flush()
                    except InvalidStream:
                        if last and stream.started:  # (the client has what came before the bad rest, then the
                            # error; not started: nothing reached it, and another backend may serve it)
                            await send({"type": "http.response.body", "body": last, "more_body": True})
                        raise
                    texts = stream.count(flushed)
                    if texts:
                        exchange.saw_text(texts, time.perf_counter())
                    tail = last + flushed
                finally:
                    response.release()
            except asyncio.CancelledError:
                if clock.expired():
                    if clock.stopped is not None:
                        raise Stopped(clock.stopped) from None
                    raise TimeoutError from None
                raise
            finally:
                clock.cancel()
                if options.watched is not None:
                    options.watched.stop = None
        except (InvalidOutput, RetryableStatus):
            raise
        except Exception as exc:  # map_error re-raises what is not an upstream failure
            error = (UpstreamError(f"the backend's stream is malformed: {exc.described(backend.secrets)}")
                     if isinstance(exc, InvalidStream)
                     else self._transport.map_error(exc)).redacted(backend.secrets)
            if stream is None or not stream.started:
                raise error from None
            exchange.outcome = error.code
            await self._end_with_error(send, f"backend {backend.name}: {error}", error, native)
            return
        assert stream is not None
        relay = stream.relay
        exchange.usage = relay.usage
        exchange.timings = relay.timings
        if not relay.done and relay.error is None:
            # the backend closed the stream without finishing it: the answer is cut short
            error = UpstreamError("the backend ended the stream before it was complete")
            if not stream.started:
                raise error
            exchange.outcome = "upstream_failed"
            await send({"type": "http.response.body", "body": tail, "more_body": True})
            await self._end_with_error(send, f"backend {backend.name}: {error}", error, native)
            return
        exchange.outcome = "upstream_error" if relay.error is not None else "success"
        if not relay.done and native is None:  # ended on an error event: clients get their [DONE] all the same
            tail += b"data: [DONE]\n\n"
        if not stream.started:  # the whole answer came before the response started (a short one, a busy loop)
            exchange.responded = True
            if options.writer is not None:  # (its head, its events and its end in one write)
                await options.writer.send_whole(send, _stream_head(client_headers), tail)
                return
            await send(_stream_head(client_headers))
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    @staticmethod
    def _account_body(exchange: Exchange, raw: bytes) -> dict[str, Any] | None:
        """Record usage and timings; the body, or None when it is not a JSON object."""
        try:
            doc: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(doc, dict):
            return None
        usage = doc.get("usage")
        exchange.usage = usage if isinstance(usage, dict) else None
        timings = doc.get("timings")
        exchange.timings = timings if isinstance(timings, dict) else None
        return doc

    @staticmethod
    async def _end_with_error(send: Send, message: str, error: UpstreamError, native: NativeApi | None = None) -> None:
        kind = "timeout_error" if error.timeout else "api_error"
        if native is not None:  # in the API's own shape (its streams have no [DONE])
            event = native.error_event(message, kind, error.code)
        else:
            event = b"data: " + error_body(message, kind, None, error.code) + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": False})



PARSE_COUNTED_BYTES = 64 * 1024  # answers larger than this have their parsing cost counted first
# the members of a 200 answer (chat and completions, embeddings, rerank, Responses, Messages): a body with none of
# them and an error (or FastAPI's detail), or old vLLM's {"object": "error"}, is an engine's error, not an answer
ANSWER_MEMBERS = ("choices", "data", "results", "output", "content")


def engine_error(doc: dict[str, Any]) -> bool:
    if doc.get("object") == "error":
        return True
    # (an empty or null answer member beside the error is no answer: {"error": ..., "choices": []}, sweep 23)
    return bool(doc.get("error") or doc.get("detail")) and not any(doc.get(key) for key in ANSWER_MEMBERS)


def _error_text(doc: dict[str, Any]) -> str:
    """The message of an engine's error body (any of the shapes normalise_upstream_error reads), as a string."""
    inner = doc.get("error")
    for where in (inner if isinstance(inner, dict) else {}, doc):
        for key in ("message", "detail", "msg"):
            if isinstance(where.get(key), str):
                return str(where[key])
    return inner if isinstance(inner, str) else "(no message)"


SCRUB_WALK_BYTES = 1 << 20  # answers larger than this that hold the backend's credentials are refused, not walked


def parse_units(raw: bytes) -> int:
    """What parsing the JSON ``raw`` would cost, in units of about one scalar value's (~0.05 us, measured with
    orjson on this project's machines: 6M ints 0.27 s, 3M short strings 0.19 s, 600k empty arrays 0.19 s): a value
    1 (its comma), a string 1 more (half its quotes, keys included), an object or array 6, an object's key (any
    ``:``) 5 more (700k distinct keys: 0.23 s). Over, not under: quotes, commas and colons inside strings count
    too. Sweep 9: 60 MB of short strings held the event loop 2.6 s, and an objects-and-arrays count let them
    through; sweep 15: one object of 1.5M distinct keys passed as 3M units and held it 0.7-1.4 s."""
    return raw.count(b",") + raw.count(b'"') // 2 + 6 * (raw.count(b"{") + raw.count(b"[")) + 5 * raw.count(b":")


_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def _header_text(text: str) -> bytes:
    """``text`` as a response header's value: printable ASCII (the rest ``?``), at most 200 characters."""
    return _UNPRINTABLE.sub("?", text[:200]).encode()


def _reshape_error(backend: Backend, payload: bytes) -> bytes:
    """A chat stream's upstream error event, in OpenAI's envelope like the gateway's own (see SSERelay)."""
    return normalise_upstream_error(500, payload, backend.name, backend.secrets)


def _stream_head(client_headers: Headers) -> Message:
    return {"type": "http.response.start", "status": 200,
            "headers": [(b"content-type", EVENT_STREAM), (b"cache-control", b"no-cache"), *client_headers]}


async def _start_stream(send: Send, exchange: Exchange, client_headers: Headers) -> None:
    exchange.responded = True
    await send(_stream_head(client_headers))


class _Clock:
    """An attempt's deadlines, kept lazily: until the first data event, the first-byte deadline; after each, the
    idle deadline from it; always the total deadline. One timer per attempt, re-armed only when it fires
    before its deadline (at most every ``idle``; each event only notes its time), where ``asyncio.timeout``
    would move its timer per event or per few. A stall is cut ``idle`` after it began.
    On expiry the task is cancelled; the attempt turns that cancellation into ``TimeoutError``."""

    __slots__ = ("_cancelling", "_expired", "_handle", "_task", "deadline", "first", "idle", "last", "loop",
                 "stopped")

    def __init__(self, loop: asyncio.AbstractEventLoop, first: float, idle: float, deadline: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.loop = loop
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self.first = first
        self.idle = idle
        self.deadline = deadline
        self.last: float | None = None  # loop time of the latest data event
        self.stopped: str | None = None  # why the gateway stopped it (:meth:`stop`)
        # (never later than idle from now: a stall right after the first event is then cut on time)
        self._handle = loop.call_at(min(first, loop.time() + idle), self._check)

    def _check(self) -> None:
        now = self.loop.time()
        due = self.first if self.last is None else min(self.last + self.idle, self.deadline)
        if now >= due:
            self._expired = True
            self._task.cancel()
        else:
            self._handle = self.loop.call_at(min(due, now + self.idle), self._check)

    def stop(self, reason: str) -> bool:
        """End the attempt now, for ``reason`` (the attempt raises :class:`Stopped`); False if it has ended."""
        if self._expired or self._task.done():
            return False
        self.stopped = reason
        self._expired = True
        self._handle.cancel()
        self._task.cancel()
        return True

    def expired(self) -> bool:
        """Whether the cancellation being handled is this clock's (then it is taken back)."""
        return self._expired and self._task.uncancel() <= self._cancelling

    def cancel(self) -> None:
        self._handle.cancel()


class _Stream:
    """One upstream event stream on its way to the client: each piece checked by the relay, the clock told of
    data events, generated text timed. The same for both relays below."""

    __slots__ = ("clock", "count", "exchange", "relay", "started")

    def __init__(self, exchange: Exchange, relay: SSERelay, clock: _Clock,
                 count: Callable[[bytes], int] = text_events_in) -> None:
        self.exchange = exchange
        self.relay = relay
        self.clock = clock
        self.count = count  # how many events of a block carry generated output
        self.started = False  # the client's response has started: failures can no longer fail over

    def feed(self, data: bytes) -> bytes:
        """What to send the client for ``data`` (often everything, unchanged; ``b""`` until an event ends)."""
        relay = self.relay
        seen = relay.events
        out = relay.feed(data)
        if relay.events != seen:
            # Only data events count: until the first one the first-byte deadline holds, and a backend sending
            # nothing but ": ping" comments is cut like a silent one.
            self.clock.last = self.clock.loop.time()
        if out:
            count = self.count
            texts = relay.texts if relay.texts is not None and count is text_events_in else count(out)
            if texts:
                self.exchange.saw_text(texts, time.perf_counter())
        return out

    def sent(self) -> None:
        """After each piece reached the client: once it has its whole answer, [DONE] included, it may hang up
        before the upstream closes, so the request is accounted now, or its usage would be lost with it."""
        relay = self.relay
        if relay.done:
            exchange = self.exchange
            exchange.usage, exchange.timings = relay.usage, relay.timings
            exchange.outcome = "upstream_error" if relay.error is not None else "success"


async def _relay_awaiting(stream: _Stream, response: UpstreamResponse, send: Send, client_headers: Headers) -> bytes:
    """Relay through ASGI ``send``, a coroutine step per upstream piece (any transport, any ASGI server)."""
    async for data in response.chunks():
        out = stream.feed(data)
        if not out:
            continue
        if not stream.started:
            await _start_stream(send, stream.exchange, client_headers)
            stream.started = True
        await send({"type": "http.response.body", "body": out, "more_body": True})
        stream.sent()
    return b""


async def _relay_direct(stream: _Stream, response: UpstreamResponse, stream_to: Callable[[BodySink], None],
                        writer: ClientWriter, send: Send, client_headers: Headers) -> bytes:
    """Relay from the upstream's protocol callbacks straight to the client's transport: no coroutine step
    per piece. The coroutine only starts the response (with the first output, so a failure before it can
    still fail over; the head and that output in one write) and waits for the end; flow control pauses the
    upstream while the client's buffer is full. Returns what is left to send with the response's end (the
    answer's last events, when its end came with them: see ``_DirectSink.data``), or the whole answer, the
    response not started, when the body ended before the coroutine first woke.
    """
    sink = _DirectSink(stream, response, writer)
    stream_to(sink)
    try:
        await sink.wait()
        if sink.held and sink.ended and sink.error is None:
            # the whole body came before the response started: it is sent with the response's start and end
            # (see Forwarder.forward), and a stream found bad at its end can still fail over
            last = b"".join(sink.held)
            sink.held.clear()
            return last
        if sink.held:
            first = b"".join(sink.held)
            sink.held.clear()
            stream.exchange.responded = True
            await writer.start(send, _stream_head(client_headers), first)
            stream.started = True
            stream.sent()
            while sink.held:  # (nothing arrives meanwhile: the upstream is paused while output is held)
                out = b"".join(sink.held)
                sink.held.clear()
                await send({"type": "http.response.body", "body": out, "more_body": True})
                stream.sent()
            sink.go_live()
            while not sink.ended:
                await sink.wait()
        last = sink.last
    finally:
        sink.last = b""  # (cancelled: nothing is written after the response may have ended)
    if sink.error is not None:
        if last:  # (what the client would have had before the error)
            writer.write(last)
        raise sink.error
    return last


class _DirectSink:
    """The upstream body's sink on the direct path. Until the response has started, output is held (and the
    upstream paused) for the coroutine to start it with; then each output is written to the client as it
    comes."""

    __slots__ = ("_live", "_wake", "ended", "error", "held", "last", "response", "stream", "writer")

    def __init__(self, stream: _Stream, response: UpstreamResponse, writer: ClientWriter) -> None:
        self.stream = stream
        self.response = response
        self.writer = writer
        self.held: list[bytes] = []
        self.ended = False
        self.error: BaseException | None = None
        self._live = False
        self._wake: asyncio.Future[None] = stream.clock.loop.create_future()
        self.last = b""  # the answer's last output, kept to go with the response's end

    def data(self, chunk: bytes) -> None:
        out = self.stream.feed(chunk)  # (InvalidStream ends the response with it: see BodySink)
        if not out:
            return
        if not self._live:
            self.held.append(out)
            self.response.pause_reading()
            self._set()
            return
        if self.stream.relay.done:
            # The answer's end ([DONE], or an agent API's last event): when the body's end comes in this same read,
            # as it mostly does, the coroutine sends it with the response's end, in one write where there were two;
            # else it is written at the loop's next turn.
            if not self.last:
                self.stream.clock.loop.call_soon(self._write_last)
            self.last += out
            return
        self._write(out)

    def _write_last(self) -> None:
        if self.ended or not self.last:
            return  # (the coroutine sends it)
        out, self.last = self.last, b""
        self._write(out)

    def _write(self, out: bytes) -> None:
        written = self.writer.write(out)
        if written:  # (GONE: the client is gone; the watcher cancels the request)
            stream = self.stream
            if stream.relay.done:
                stream.sent()
            if written == FULL:
                self.response.pause_reading()
                self.writer.when_writable(self._resume)

    def end(self, error: BaseException | None) -> None:
        self.ended = True
        self.error = error
        self._set()

    def go_live(self) -> None:
        self._live = True
        if not self.ended:
            self.response.resume_reading()

    def _resume(self) -> None:
        if not self.ended:
            self.response.resume_reading()

    def _set(self) -> None:
        if not self._wake.done():
            self._wake.set_result(None)

    async def wait(self) -> None:
        await self._wake
        self._wake = self.stream.clock.loop.create_future()
