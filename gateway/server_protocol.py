"""uvicorn's httptools protocol, stamping each request's arrival and bounding what a connection may cost.

A request's clock (time to first token, queue wait, duration) must start when its bytes are parsed, not when
the event loop gets round to running the ASGI app: under a burst the app task of the last request of
twelve starts ~10 ms after it arrived on our 2-core machines, and that wait is latency the client sees.
The stamp travels in ``scope["state"]["gateway.arrival"]`` (``time.perf_counter()``).

The streamed body's fast path: ``scope["state"]["gateway.body_writer"]`` is a :class:`BodyWriter`, which
writes chunks of a response already started through ASGI ``send`` straight to the connection's transport
(the same chunked framing ``send`` writes), from any callback and without a coroutine step per chunk, with
uvicorn's flow control exposed (``paused``, ``when_writable``). The end of the response still goes through
``send``. An app that never uses it is served exactly as before.

The limits (:class:`ServerLimits`) exist because httptools and uvicorn set none of their own:

* httptools accepts a request head of any size, at a cost that grows with the square of its length (one
  64 MiB header held the event loop 7.5 s), so the head is fed to it only up to ``max_header_bytes``;
* uvicorn never times out a connection that is opening, sending its head or its body slowly, so idle and
  slow sockets piled up until the process ran out of descriptors and could no longer reach its backends;
* nothing caps the number of client connections, which share the descriptor limit with upstream ones.

Where a client is owed an answer (400, 408, 431, 501, 503), it is an OpenAI-shaped JSON error, and the
connection is closed after it.

Framing: httptools reads a body as chunked whenever the last transfer coding is ``chunked``, whatever comes
before it (``Transfer-Encoding: gzip, chunked`` was served as if plain chunked, the gzip ignored; a proxy in
front that honours the coding sees another request than the gateway does). The gateway understands no coding
but ``chunked`` alone, so any other is refused with 501 (RFC 9112, 6.1) before the body is read.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from asyncio import TimerHandle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.asgi import BODY_WRITER, FULL, GONE, WRITTEN, Message, Send
from gateway.errors import error_body, error_type_for

ARRIVAL = "gateway.arrival"
LINGER_SECONDS = 10.0  # a request answered before its body came whole: the rest must come within this long


class _Refused(Exception):
    """Raised from a parser callback after the request was answered and its connection closed: it stops
    httptools from reading on (its body, a pipelined request) into a request no app will run for."""


class BodyWriter:
    """Writes body chunks of one started, chunked response directly to the client's transport."""

    __slots__ = ("_cycle", "_protocol")

    def __init__(self, protocol: StampedHttpToolsProtocol, cycle: Any) -> None:
        self._protocol = protocol
        # Weakly: the cycle holds the scope, whose state holds this writer. A strong reference made every
        # request's cycle (its scope, headers, events) garbage that only the cyclic collector frees, and those
        # collections stall the event loop. The request's task keeps the cycle alive while it can write.
        self._cycle = weakref.ref(cycle)

    def write(self, body: bytes) -> int:
        """Send ``body`` as one chunk: GONE (nothing written) when the client is gone, FULL when written and the
        client reads slower than we write (stop producing until ``when_writable``), else WRITTEN. The response
        must have been started by ``send`` without a content-length, and not ended."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected:
            return GONE
        if not cycle.response_started or cycle.response_complete or not cycle.chunked_encoding:
            raise RuntimeError("BodyWriter.write needs a started, unfinished, chunked response")
        protocol = self._protocol
        if body:
            protocol.transport.write(b"%x\r\n%s\r\n" % (len(body), body))  # (may pause writing at once)
        return FULL if protocol.flow.write_paused else WRITTEN

    async def start(self, send: Send, message: Message, first: bytes) -> None:
        """Start the response with ``send`` (``message``: its ``http.response.start``; uvicorn's own checks,
        default headers and framing) and write its head and the first chunk ``first`` together: one write where
        there were two, so one system call less per streamed response, and the client reads its first event
        with the head. Nothing is written when the client is gone."""
        cycle = self._cycle()
        if cycle is None or cycle.response_started or not first:
            await send(message)
            self.write(first)
            return
        head = await _framed(cycle, send, message)
        transport = cycle.transport
        if cycle.disconnected or not head.parts:
            return
        if not cycle.chunked_encoding:  # (a content-length: not a stream this writer can frame)
            transport.write(b"".join(head.parts))
            raise RuntimeError("BodyWriter.start needs a chunked response")
        head.parts.append(b"%x\r\n%s\r\n" % (len(first), first))
        transport.write(b"".join(head.parts))

    async def send_whole(self, send: Send, start: Message, body: bytes) -> None:
        """Send a whole response with ``send``: ``start`` (its ``http.response.start``) and then ``body`` as its one
        and last body message, with uvicorn's own checks and framing, and write what they frame to the connection
        in one write where uvicorn makes two (the head, then the body and the chunked end). A response that has
        already started is ended with ``body`` as ``send`` ends it."""
        last: Message = {"type": "http.response.body", "body": body, "more_body": False}
        cycle = self._cycle()
        if cycle is None or cycle.response_started:
            if cycle is None:
                await send(start)
            await send(last)
            return
        framed = await _framed(cycle, send, start, last)
        if framed.parts and not cycle.disconnected:
            cycle.transport.write(b"".join(framed.parts))

    def when_writable(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the transport drains (or the connection is lost)."""
        self._protocol.on_writable = callback

    def when_disconnected(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the client's connection is lost (at once if it is already); None: no longer."""
        self._protocol.on_lost = callback
        cycle = self._cycle()
        if callback is not None and (cycle is None or cycle.disconnected):
            self._protocol.loop.call_soon(self._protocol._lost)


class _Collect:
    """Stands in for a connection's transport while uvicorn frames a response (a head, or a whole response):
    keeps what it writes. Closing it writes that to ``transport`` and closes it, as uvicorn closes a connection
    that is not kept alive at once, before it completes the response (which then sees the transport closing)."""

    __slots__ = ("parts", "transport")

    def __init__(self, transport: Any) -> None:
        self.parts: list[bytes] = []
        self.transport = transport

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        if self.parts:
            self.transport.write(b"".join(self.parts))
            self.parts.clear()
        self.transport.close()


async def _framed(cycle: Any, send: Send, *messages: Message) -> _Collect:
    """What uvicorn's ``send`` writes for ``messages`` (its checks and framing), kept instead of written: it writes
    to, and may close, the cycle's transport and only that, so a :class:`_Collect` stands in for it meanwhile."""
    transport = cycle.transport
    collected = _Collect(transport)
    cycle.transport = collected
    try:
        for message in messages:
            await send(message)
    finally:
        cycle.transport = transport
    return collected


@dataclass(frozen=True)
class ServerLimits:
    """What one client connection may cost. ``max_connections`` counts this server's open client
    connections; None means no cap (the production default is computed, see :mod:`gateway.server_limits`)."""

    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int | None = None
    # told the error code of every connection refused or cut here (the gateway counts them in a metric)
    on_refusal: Callable[[str], None] | None = None


class StampedHttpToolsProtocol(HttpToolsProtocol):
    """Reads its :class:`ServerLimits` from ``config.limits`` (see ``server_limits.LimitedConfig``); a plain
    ``uvicorn.Config`` gets the defaults.

    Clocks: the head clock runs from the connection's opening, or from the first byte of a later request, to
    the end of the request's head (408 if some of it came, else a silent close); the body clock runs between
    two pieces of a request body while the app is reading it (408). Between requests the keep-alive clock
    (uvicorn's) runs alone: a kept-alive connection lives for ``keepalive_timeout``, which must outlast the
    clients' own idle expiry (httpx's and so the OpenAI SDK's: 5 s), or a client reuses a connection at the
    moment the gateway closes it and its request fails with a read error.
    """

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = getattr(config, "limits", None)
        self.limits = limits if isinstance(limits, ServerLimits) else ServerLimits()
        self._in_head = True  # between requests or inside a request's head
        self._head_bytes = 0  # of the pending head, as far as counted (see data_received)
        self._head_timer: TimerHandle | None = None
        self._body_pending = False  # head complete, body not yet
        self._body_seen = 0.0  # loop time of the last body piece
        self._body_timer: TimerHandle | None = None
        self._lingering: TimerHandle | None = None  # answered before its body came whole: closes at the latest then
        self.on_writable: Callable[[], None] | None = None  # a BodyWriter's waiter (see when_writable)
        self.on_lost: Callable[[], None] | None = None  # a BodyWriter's watcher (see when_disconnected)

    # -- connection ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) >= cap:
            # refused before anything is parsed: what it costs is the accept and this write
            self.transport = transport
            self._answer_and_close(503, "The gateway has too many open connections; retry shortly",
                                   "too_many_connections")
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)
        self._writable()
        self._lost()

    def _lost(self) -> None:
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._writable()

    def _writable(self) -> None:
        callback, self.on_writable = self.on_writable, None
        if callback is not None:
            callback()

    def data_received(self, data: bytes) -> None:
        if not self._in_head:
            super().data_received(data)
            if self._body_pending and self._body_timer is None and not self.transport.is_closing():
                self._arm_body_timer()
            return
        if self._head_timer is None and data:
            self._arm_head_timer()  # the first byte of a request after a kept-alive wait
        while True:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                super().data_received(data)
                break
            # Feed httptools no more than the limit allows, then see whether the head ended inside it (the
            # rest is body, or a pipelined request, and is fed on).
            view = memoryview(data)
            self._head_bytes += room
            super().data_received(view[:room])  # type: ignore[arg-type]  # httptools takes any buffer
            if self.transport.is_closing():
                return
            if self._in_head and self._head_bytes:  # no head ended inside it: this one is past the limit
                self._refuse_head()
                return
            data = view[room:]  # type: ignore[assignment]
            if not self._in_head:
                self.data_received(data)  # its body, and what follows it
                return
            # Pipelined requests: a head ended inside the piece and the next began there; that one is counted
            # from here on (what of it the piece held is not, so a head is refused by twice the limit at the
            # latest). Counting the whole read refused, with no answer, pipelined heads each under the limit.
        if self._body_pending and self._body_timer is None and not self.transport.is_closing():
            self._arm_body_timer()

    # -- parser callbacks ---------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["state"][ARRIVAL] = time.perf_counter()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.parser.should_upgrade() and not self._should_upgrade():
            # Upgrade: h2c (curl --http2 on http://), websocket (no route speaks it: ws="none") or anything else.
            # httptools stops at the head and takes the body for the new protocol's bytes, so the app got an
            # empty body (a misleading 400 about a zero-length document). Said plainly instead, before any app
            # runs.
            self._answer_and_close(400, f"The gateway does not switch protocols (Upgrade: "
                                        f"{self._upgrade_asked()}): send the request "
                                        "over HTTP/1.1 without an Upgrade header (curl: --http1.1)",
                                   "upgrade_not_supported")
            return
        codings = self._transfer_codings()
        if codings is not None and codings != "chunked":
            self._answer_and_close(501, f"The gateway reads no transfer coding but chunked (Transfer-Encoding: "
                                        f"{codings[:60]}): send the body as it is, with a Content-Length or "
                                        "chunked", "unsupported_transfer_encoding", type="invalid_request_error")
            raise _Refused
        self._body_pending = True
        self._body_seen = self.loop.time()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # (not after an upgrade)
            self.scope["state"][BODY_WRITER] = BodyWriter(self, cycle)

    def on_body(self, body: bytes) -> None:
        self._body_seen = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self.cycle is None or (self.transport.is_closing() and self.cycle.scope is not self.scope):
            return  # (its head was refused: no app runs for it)
        self._body_pending = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._lingering is not None:  # (the body of a request answered already came whole in time)
            self._lingering.cancel()
            self._lingering = None
        # A pipelined head that follows in the same read is not counted; it is bounded by the read size.
        self._in_head = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._body_pending and not self.transport.is_closing() and self._lingering is None:
            # Answered before its body was read whole (a refusal: no key, no budget, too large): the rest of the
            # body is read and dropped as it comes (a client still sending it then reads its answer, and keeps
            # its connection), but it must come within LINGER_SECONDS, or the connection closes: a client
            # trickling a body nobody reads (a byte per body_timeout) held its connection for good.
            self._lingering = self.loop.call_later(LINGER_SECONDS, self.transport.close)
        super().on_response_complete()
        # uvicorn armed its keep-alive clock: the connection waits for its next request, on that clock alone
        # unless part of the next head came while this response was written
        if self.timeout_keep_alive_task is not None and self._head_bytes and self._head_timer is None:
            self._arm_head_timer()

    def _transfer_codings(self) -> str | None:
        """The request's transfer codings, every Transfer-Encoding line joined, lowercased and without blanks
        (``gzip,chunked``); None when it has none."""
        lines = [v for k, v in self.headers if k == b"transfer-encoding"]
        if not lines:
            return None
        return ",".join(c.strip() for c in b",".join(lines).decode("latin-1").lower().split(","))

    def _upgrade_asked(self) -> str:
        value = next((v for k, v in self.headers if k == b"upgrade"), b"?")
        return value.decode("latin-1")[:40]

    def _unsupported_upgrade_warning(self) -> None:
        pass  # (answered in on_headers_complete)

    def send_400_response(self, msg: str) -> None:
        if self.transport.is_closing():
            return  # (answered already: a refusal of ours stopped the parser with _Refused)
        self._answer_and_close(400, msg, "invalid_http_request")

    # -- refusals -----------------------------------------------------------------------------------------
    def _count(self, code: str) -> None:
        if self.limits.on_refusal is not None:
            self.limits.on_refusal(code)

    def _answer_and_close(self, status: int, message: str, code: str, *, type: str | None = None) -> None:
        self._count(code)
        body = error_body(message, type or error_type_for(status), None, code)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                        b"\r\nconnection: close\r\n\r\n", body])
        self.transport.write(b"".join(content))
        self.transport.close()

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse_head(self) -> None:
        if self._responding():
            # a pipelined head behind a response still being written: no room for a 431 in that stream
            self.transport.close()
            return
        self._answer_and_close(431, f"The request line and headers exceed the gateway's limit of "
                                    f"{self.limits.max_header_bytes} bytes", "request_headers_too_large")

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._in_head or self._responding():
            return
        if self._head_bytes == 0:
            self._count("idle_timeout")
            self.transport.close()  # nothing was asked: nobody to answer
            return
        self._answer_and_close(408, f"The request's headers did not arrive within "
                                    f"{self.limits.header_timeout:g} s", "header_timeout")

    def _arm_body_timer(self) -> None:
        self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)

    def _body_timed_out(self) -> None:
        # One timer per wait, not per piece: it re-arms itself for what is left since the last piece.
        self._body_timer = None
        if self.transport.is_closing() or not self._body_pending:
            return
        now = self.loop.time()
        cycle = self.cycle
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # the app is not reading (yet): the client is not the one keeping us waiting
            self._body_seen = now
        left = self._body_seen + self.limits.body_timeout - now
        if left > 0:
            self._body_timer = self.loop.call_later(left, self._body_timed_out)
            return
        self._body_pending = False
        if cycle.response_started:
            self._count("body_timeout")
            self.transport.close()
        else:
            self._answer_and_close(408, f"The request body stalled for more than {self.limits.body_timeout:g} s",
                                   "body_timeout")
        # the app waiting in receive() sees the client gone, and whatever it sends next is dropped
        cycle.disconnected = True
        cycle.message_event.set()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer, self._lingering):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
