"""``gateway bench faults``: the gateway under backend and client faults, on loopback, bounded in time.

Scenarios (each one a fresh emulated fleet and a fresh gateway):

* ``kill``: a backend killed while 200 streams run (two emulated vLLM servers, arrivals spread so that
  some streams are mid-flight on the victim and others have not started): those not yet streaming must fail
  over and complete; those streaming from the victim must end with a well-formed OpenAI error event.
* ``hang``: a backend that never sends a byte: a request costs at most the first-byte timeout, then fails
  over (and is a 504 when the hanging backend is alone).
* ``garbage``: a backend answering ``200 text/event-stream`` with bytes that are not SSE, not JSON, or JSON cut
  off: the client must get a well-formed stream or a well-formed error, never a hang or a broken event.
* ``flap``: a backend stopped and started again and again under load: no request fails while another
  backend is healthy.
* ``loading``: a llama.cpp backend stuck loading is never sent a generation request.

For every scenario the report gives requests, requests lost (failed without being owed an error event,
hung, or malformed), error events (well-formed / total) and the longest stall a client saw (largest gap
between two reads, or before the first one). Writes ``faults.json`` under ``--out`` (``reports/faults``).

The tests in ``tests/faults`` run the same scenarios (imported from here) and assert on them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.config import Settings, settings_from_mapping
from gateway.sim import FleetThread, SimServer, SimSpec

ASK = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


# -- the gateway on a thread ---------------------------------------------------------------------------------
class GatewayThread:
    """``create_app(settings)`` served by uvicorn (uvloop + httptools, as in production) on a daemon thread."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from gateway.app import create_app
        from gateway.server_protocol import StampedHttpToolsProtocol

        self.app = create_app(settings)
        self.gateway = self.app.gateway
        sock = _bound_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, loop="uvloop", http=StampedHttpToolsProtocol, lifespan="on",
                                log_level="error", access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self._sock = sock
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)

    def _run(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self.server.serve(sockets=[self._sock]))

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)
        self._sock.close()

    def in_flight(self) -> float:
        """The ``gateway_requests_in_flight`` gauge, as /metrics shows it."""
        for family in self.gateway.metrics.registry.collect():
            if family.name == "gateway_requests_in_flight":
                return float(family.samples[0].value)
        raise LookupError("gateway_requests_in_flight not found")


def _bound_socket() -> Any:
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def settings_for(servers: Sequence[SimServer], extra_backends: Sequence[dict[str, Any]] = (),
                 **extra: Any) -> Settings:
    backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url} for s in servers]
    mapping: dict[str, Any] = {"backends": [*backends, *extra_backends], "scrape": {"interval": 0.1, "timeout": 1.0},
                               "access_log": {"enabled": False}}
    for key, value in extra.items():
        mapping[key] = {**mapping[key], **value} if isinstance(mapping.get(key), dict) else value
    return settings_from_mapping(mapping)


@contextlib.contextmanager
def fleet_and_gateway(specs: Sequence[SimSpec], before: Callable[[FleetThread], None] | None = None,
                      extra_backends: Sequence[dict[str, Any]] = (),
                      **extra: Any) -> Iterator[tuple[FleetThread, GatewayThread]]:
    with FleetThread(specs) as fleet:
        if before is not None:
            before(fleet)
        with GatewayThread(settings_for(fleet.fleet.servers, extra_backends, **extra)) as gw:
            yield fleet, gw


# -- one client request, and what it got ---------------------------------------------------------------------
@dataclass
class Outcome:
    """What one client request got, judged: ``kind`` is ``complete`` (a stream of JSON events ending with
    ``[DONE]``, or a 200 JSON body), ``error_event`` (events, then a well-formed ``{"error": ...}`` event, then
    ``[DONE]``), ``http_error`` (a non-200 with the OpenAI error envelope), ``malformed``, ``hung`` or
    ``client_error`` (the connection failed under the client)."""

    index: int
    status: int | None = None
    backend: str | None = None
    kind: str = "pending"
    detail: str = ""
    events: int = 0  # data events before the end (error event and [DONE] excluded)
    error_event: bool = False  # an error event was seen
    error_event_well_formed: bool = False
    started: float = 0.0
    first_byte: float | None = None
    ended: float = 0.0
    max_stall: float = 0.0
    body_bytes: int = 0

    @property
    def streamed(self) -> bool:
        """The client had received at least one event before the end."""
        return self.events > 0

    @property
    def duration(self) -> float:
        return self.ended - self.started


def is_error_envelope(doc: Any) -> bool:
    """``{"error": {"message": str, "type": str, "param": str|null, "code": str|int|null}}``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
        return False
    err = doc["error"]
    return (isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "param" in err and (err["param"] is None or isinstance(err["param"], str))
            and "code" in err and (err["code"] is None or isinstance(err["code"], str | int)))


def judge_stream(body: bytes, outcome: Outcome) -> None:
    """Judge a 200 ``text/event-stream`` body (see :class:`Outcome`)."""
    text = body.replace(b"\r\n", b"\n")
    if not text.endswith(b"\n\n"):
        outcome.kind, outcome.detail = "malformed", f"the stream ends mid-event: {text[-80:]!r}"
        return
    payloads: list[bytes] = []
    for event in text[:-2].split(b"\n\n"):
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        other = [line for line in event.split(b"\n") if line and not line.startswith((b"data:", b":"))]
        if other:
            outcome.kind, outcome.detail = "malformed", f"not an SSE field: {other[0][:80]!r}"
            return
        if data:
            payloads.append(b"\n".join(data))
    if not payloads or payloads[-1] != b"[DONE]":
        outcome.kind, outcome.detail = "malformed", "the stream does not end with data: [DONE]"
        return
    docs: list[Any] = []
    for payload in payloads[:-1]:
        try:
            docs.append(orjson.loads(payload))
        except orjson.JSONDecodeError:
            outcome.kind, outcome.detail = "malformed", f"an event is not JSON: {payload[:80]!r}"
            return
    errors = [i for i, d in enumerate(docs) if isinstance(d, dict) and "error" in d and "choices" not in d]
    if payloads.count(b"[DONE]") != 1:
        outcome.kind, outcome.detail = "malformed", "[DONE] is not the last event only"
        return
    if errors:
        outcome.error_event = True
        outcome.error_event_well_formed = errors == [len(docs) - 1] and is_error_envelope(docs[-1])
        outcome.events = len(docs) - 1
        outcome.kind = "error_event" if outcome.error_event_well_formed else "malformed"
        if not outcome.error_event_well_formed:
            outcome.detail = f"error event not well-formed or not last: {payloads[errors[0]][:120]!r}"
        else:
            outcome.detail = str(docs[-1]["error"].get("message"))[:200]
        return
    outcome.events = len(docs)
    outcome.kind = "complete"


async def request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], index: int = 0,
                  limit_s: float = 30.0, headers: dict[str, str] | None = None) -> Outcome:
    """POST ``body`` and read the answer to its end, timing every read; never longer than ``limit_s``."""
    out = Outcome(index=index, started=time.monotonic())
    chunks: list[bytes] = []
    last = out.started
    try:
        async with asyncio.timeout(limit_s):
            async with session.post(url, json=body, headers=headers) as resp:
                out.status = resp.status
                out.backend = resp.headers.get("x-gateway-backend")
                async for data in resp.content.iter_any():
                    now = time.monotonic()
                    if out.first_byte is None:
                        out.first_byte = now
                    out.max_stall = max(out.max_stall, now - last)
                    last = now
                    chunks.append(data)
                content_type = resp.headers.get("content-type", "")
    except TimeoutError:
        out.kind, out.detail = "hung", f"no end within {limit_s:g} s"
    except aiohttp.ClientError as exc:
        out.kind, out.detail = "client_error", f"{type(exc).__name__}: {exc}"
    out.ended = time.monotonic()
    out.max_stall = max(out.max_stall, out.ended - last)
    body_bytes = b"".join(chunks)
    out.body_bytes = len(body_bytes)
    if out.kind != "pending":
        # count what had arrived, so that "had it started streaming?" can still be answered
        out.events = body_bytes.count(b"\n\ndata: ") + (1 if body_bytes.startswith(b"data: ") else 0)
        return out
    if out.status == 200 and content_type.startswith("text/event-stream"):
        judge_stream(body_bytes, out)
    elif out.status == 200:
        try:
            doc = orjson.loads(body_bytes)
            out.kind = "complete" if isinstance(doc, dict) and "error" not in doc else "malformed"
        except orjson.JSONDecodeError:
            out.kind, out.detail = "malformed", f"a 200 body that is not JSON: {body_bytes[:80]!r}"
    else:
        try:
            doc = orjson.loads(body_bytes)
        except orjson.JSONDecodeError:
            doc = None
        out.kind = "http_error" if is_error_envelope(doc) else "malformed"
        out.detail = (str(doc["error"]["message"])[:200] if out.kind == "http_error"
                      else f"HTTP {out.status}, not an OpenAI error: {body_bytes[:120]!r}")
    return out


def client_session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None))


def chat_body(max_tokens: int, stream: bool = True, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": ASK, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            **extra}


# -- scenario reports ----------------------------------------------------------------------------------------
@dataclass
class ScenarioReport:
    scenario: str
    requests: int = 0
    complete: int = 0
    lost: int = 0  # failed without being owed an error event, hung, or malformed
    error_events_well_formed: int = 0
    error_events: int = 0
    http_errors: int = 0
    max_stall_s: float = 0.0
    seconds: float = 0.0
    checks: dict[str, Any] = field(default_factory=dict)  # scenario-specific figures
    samples: list[str] = field(default_factory=list)  # a few details of what went wrong

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.error_events_well_formed == self.error_events and all(
            v is not False for v in self.checks.values())

    def add(self, outcomes: Sequence[Outcome], lost: Callable[[Outcome], bool]) -> None:
        for o in outcomes:
            self.requests += 1
            self.complete += o.kind == "complete"
            self.http_errors += o.kind == "http_error"
            if o.error_event:
                self.error_events += 1
                self.error_events_well_formed += o.error_event_well_formed
            self.max_stall_s = max(self.max_stall_s, o.max_stall)
            if lost(o):
                self.lost += 1
                if len(self.samples) < 5:
                    self.samples.append(f"#{o.index} {o.kind} HTTP {o.status} via {o.backend}: {o.detail}")

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["max_stall_s"] = round(self.max_stall_s, 3)
        doc["seconds"] = round(self.seconds, 2)
        doc["error_events_well_formed"] = f"{self.error_events_well_formed}/{self.error_events}"
        doc["ok"] = self.ok
        return doc


def _never_failed(o: Outcome) -> bool:
    return o.kind != "complete"


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def generations(server: SimServer) -> int:
    return sum(1 for q in server.received if q.path.startswith("/v1/") and q.method == "POST")


# -- kill a backend while streams run ------------------------------------------------------------------------
@dataclass
class KillResult:
    report: ScenarioReport
    outcomes: list[Outcome]
    killed_at: float
    victim: str


def kill_while_streaming(streams: int = 200, max_tokens: int = 120, time_scale: float = 1.0,
                         spread_s: float = 1.0, kill_after_s: float = 0.6, timeout: float = 30.0) -> KillResult:
    """``streams`` streams arriving evenly over ``spread_s`` onto two emulated vLLM servers; ``v0`` is killed
    ``kill_after_s`` after the first arrival. Lost: anything but a complete stream, except a stream that
    was mid-flight on the killed backend and ended with a well-formed error event."""
    specs = [SimSpec(engine="vllm", model="m", name=f"v{i}", time_scale=time_scale) for i in range(2)]
    report = ScenarioReport("kill_while_streaming")
    t0 = time.monotonic()
    # an idle limit well under the client's patience: a stream whose backend went silent ends with an error
    # event within it (the gateway's guarantee), whatever the dead backend's sockets do
    with fleet_and_gateway(specs, routing={"policy": "round-robin"}, timeouts={"idle": 5.0}) as (fleet, gw):
        victim = fleet.fleet["v0"]
        url = gw.url + "/v1/chat/completions"
        killed: dict[str, float] = {}

        async def drive() -> list[Outcome]:
            async with client_session() as session:
                async def one(i: int) -> Outcome:
                    await asyncio.sleep(spread_s * i / streams)
                    return await request(session, url, chat_body(max_tokens), i, timeout)

                async def kill() -> None:
                    await asyncio.sleep(kill_after_s)
                    await asyncio.to_thread(fleet.call, victim.stop())
                    killed["at"] = time.monotonic()

                killer = asyncio.create_task(kill())
                results = await asyncio.gather(*(one(i) for i in range(streams)))
                await killer
                return list(results)

        outcomes = asyncio.run(drive())
        killed_at = killed["at"]

        def lost(o: Outcome) -> bool:
            if o.kind == "complete":
                return False
            # owed only to streams that were already streaming from the victim
            return not (o.kind == "error_event" and o.backend == victim.spec.name and o.streamed)

        report.add(outcomes, lost)
        drained = _wait(lambda: gw.in_flight() == 0, 10.0)
        report.checks["in_flight_back_to_zero"] = drained
        report.checks["interrupted_mid_stream"] = sum(o.kind == "error_event" for o in outcomes)
        report.checks["served_after_failover_or_by_survivor"] = sum(
            o.kind == "complete" and o.backend == "v1" for o in outcomes)
        report.checks["started_after_kill"] = sum(o.started >= killed_at for o in outcomes)
        report.checks["hung"] = sum(o.kind == "hung" for o in outcomes)
        report.checks["longest_stream_s"] = round(max(o.duration for o in outcomes), 3)
    report.seconds = time.monotonic() - t0
    return KillResult(report, outcomes, killed_at, "v0")


# -- a backend that hangs before its first byte --------------------------------------------------------------
def hanging_backend(requests: int = 6, first_byte: float = 0.5, timeout: float = 20.0) -> ScenarioReport:
    """Round-robin over a hanging and a healthy vLLM emulator: each request costs at most the first-byte
    timeout (plus slack) and then completes on the healthy one; alone, the hanging one gives a 504."""
    report = ScenarioReport("hanging_backend")
    t0 = time.monotonic()
    specs = [SimSpec(engine="vllm", model="m", name=n, time_scale=50.0) for n in ("hangs", "ok")]
    # no health checks after discovery (they would hang too, and take it out of rotation before any request)
    with fleet_and_gateway(specs, routing={"policy": "round-robin"}, scrape={"interval": 60},
                           timeouts={"first_byte": first_byte},
                           breaker={"consecutive_failures": 1000, "failure_ratio": 1.0}) as (fleet, gw):
        fleet.fleet["hangs"].faults.update({"hang_before_first_byte": True})

        async def drive(url: str, n: int) -> list[Outcome]:
            async with client_session() as session:
                return [await request(session, url, chat_body(8), i, timeout) for i in range(n)]

        outcomes = asyncio.run(drive(gw.url + "/v1/chat/completions", requests))
        report.add(outcomes, _never_failed)
        report.checks["slowest_request_s"] = round(max(o.duration for o in outcomes), 3)
        report.checks["hit_the_hanging_backend"] = generations(fleet.fleet["hangs"])
        report.checks["within_first_byte_timeout_plus_1s"] = all(o.duration < first_byte + 1.0 for o in outcomes)
    specs = [SimSpec(engine="vllm", model="m", name="hangs", time_scale=50.0)]
    with fleet_and_gateway(specs, scrape={"interval": 60}, timeouts={"first_byte": first_byte}) as (fleet, gw):
        fleet.fleet["hangs"].faults.update({"hang_before_first_byte": True})
        alone = asyncio.run(drive(gw.url + "/v1/chat/completions", 2))
        report.add(alone, lambda o: o.kind != "http_error" or o.status != 504)
        report.checks["alone_504_within_s"] = round(max(o.duration for o in alone), 3)
        report.checks["alone_within_first_byte_timeout_plus_1s"] = all(o.duration < first_byte + 1.0 for o in alone)
    report.seconds = time.monotonic() - t0
    return report


# -- a backend answering garbage -----------------------------------------------------------------------------
_EVENT = b'data: {"id":"g","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,' \
         b'"delta":{"content":"hi"},"finish_reason":null}]}\n\n'

# mode -> (framing, body, ending): framing "close" (body until EOF), "chunked"; ending "eof" (clean close
# after a complete body), "abort" (connection dropped: a chunked body never terminated)
GARBAGE: dict[str, tuple[str, bytes, str]] = {
    "binary_noise": ("close", b"\x00\xff\xfe not SSE {{{ \x01" * 64, "eof"),
    "noise_blocks": ("close", b"hello there\n\nretry-not-a-field\n\n", "eof"),
    "not_json_events": ("close", b"data: this is not json\n\ndata: [DONE]\n\n", "eof"),
    "json_cut_at_eof": ("close", _EVENT + b'data: {"id":"g","choices":[{"delta":{"content":"hel', "eof"),
    "json_cut_chunked_abort": ("chunked", _EVENT + b'data: {"id":"g","choices":[{"delta":{"cont', "abort"),
    "events_without_done": ("chunked", _EVENT * 3, "eof"),
    "empty_200": ("chunked", b"", "eof"),
    "html_200": ("close", b"<html><body>502 Bad Gateway</body></html>", "eof"),
}


class GarbageBackend:
    """A raw asyncio HTTP/1.1 server: ``GET`` answers the model list (so discovery and health pass); ``POST``
    answers ``200 text/event-stream`` with the body of ``mode`` (see :data:`GARBAGE`), framed and ended as
    that mode says. ``mode`` may change at any time; ``requests`` counts the POSTs."""

    def __init__(self, mode: str = "binary_noise", model: str = "m") -> None:
        self.mode = mode
        self.model = model
        self.requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                if head.startswith(b"GET"):
                    models = orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(models), models))
                    await writer.drain()
                    continue
                self.requests += 1
                framing, body, ending = GARBAGE[self.mode]
                if framing == "close":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                                 + body)
                    await writer.drain()
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                if body:
                    writer.write(b"%x\r\n%s\r\n" % (len(body), body))
                if ending == "abort":
                    await writer.drain()
                    writer.transport.abort()
                    return
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class AsyncThread:
    """An event loop on a daemon thread, for servers the client's loop must not host."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fakes", daemon=True)

    def call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        async def run() -> Any:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def __enter__(self) -> AsyncThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def garbage_backend(modes: Sequence[str] = tuple(GARBAGE), per_mode: int = 2,
                    timeout: float = 10.0) -> tuple[ScenarioReport, dict[str, list[Outcome]]]:
    """Each garbage mode, streamed and not: the gateway must answer a well-formed stream or error."""
    report = ScenarioReport("garbage_sse")
    t0 = time.monotonic()
    by_mode: dict[str, list[Outcome]] = {}
    with AsyncThread() as thread:
        fake = GarbageBackend()
        thread.call(fake.start())
        backend = {"name": "garbage", "engine": "openai", "url": fake.url, "models": ["m"]}
        settings = settings_for([], [backend], timeouts={"first_byte": 5, "idle": 5})
        with GatewayThread(settings) as gw:
            async def drive(n: int) -> list[Outcome]:
                async with client_session() as session:
                    out = []
                    for i in range(n):
                        out.append(await request(session, gw.url + "/v1/chat/completions",
                                                 chat_body(8, stream=i % 2 == 0), i, timeout))
                    return out

            for mode in modes:
                fake.mode = mode
                by_mode[mode] = asyncio.run(drive(per_mode))
                report.add(by_mode[mode], lambda o: o.kind not in ("complete", "error_event", "http_error"))
            report.checks["modes"] = {m: sorted({o.kind for o in outs}) for m, outs in by_mode.items()}
            report.checks["in_flight_back_to_zero"] = _wait(lambda: gw.in_flight() == 0, 5.0)
        thread.call(fake.stop())
    report.seconds = time.monotonic() - t0
    return report, by_mode


# -- a flapping backend --------------------------------------------------------------------------------------
def flapping_backend(seconds: float = 3.0, concurrency: int = 8, period_s: float = 0.25,
                     timeout: float = 20.0) -> ScenarioReport:
    """Two vLLM emulators; ``v0`` is stopped and started every ``period_s`` while ``concurrency`` clients send
    short non-streamed requests for ``seconds``: every one must succeed (failover before any byte)."""
    report = ScenarioReport("flapping_backend")
    t0 = time.monotonic()
    specs = [SimSpec(engine="vllm", model="m", name=f"v{i}", time_scale=20.0) for i in range(2)]
    with fleet_and_gateway(specs, routing={"policy": "round-robin"},
                           breaker={"cooldown_seconds": 0.2}) as (fleet, gw):
        flapper = fleet.fleet["v0"]
        flips = 0

        async def drive() -> list[Outcome]:
            nonlocal flips
            end = time.monotonic() + seconds
            async with client_session() as session:
                async def worker(w: int) -> list[Outcome]:
                    out = []
                    i = 0
                    while time.monotonic() < end:
                        out.append(await request(session, gw.url + "/v1/chat/completions",
                                                 chat_body(6, stream=False), w * 100_000 + i, timeout))
                        i += 1
                    return out

                async def flap() -> None:
                    nonlocal flips
                    while time.monotonic() < end:
                        await asyncio.sleep(period_s)
                        await asyncio.to_thread(fleet.call, flapper.stop() if flapper.running else flapper.start())
                        flips += 1

                tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
                await flap()
                return [o for t in tasks for o in await t]

        outcomes = asyncio.run(drive())
        if not flapper.running:
            fleet.call(flapper.start())
        report.add(outcomes, _never_failed)
        report.checks["flips"] = flips
        report.checks["served_by_flapper"] = sum(o.backend == "v0" for o in outcomes)
        report.checks["in_flight_back_to_zero"] = _wait(lambda: gw.in_flight() == 0, 5.0)
    report.seconds = time.monotonic() - t0
    return report


# -- a backend stuck loading ---------------------------------------------------------------------------------
def loading_backend(requests: int = 24, concurrency: int = 8, timeout: float = 20.0) -> ScenarioReport:
    report = ScenarioReport("loading_backend")
    t0 = time.monotonic()
    specs = [SimSpec(engine="llamacpp", model="m", name=n, time_scale=20.0) for n in ("loading", "ready")]

    def stuck(fleet: FleetThread) -> None:
        fleet.fleet["loading"].faults.update({"loading": True})

    with fleet_and_gateway(specs, before=stuck, routing={"policy": "round-robin"}) as (fleet, gw):
        async def drive() -> list[Outcome]:
            sem = asyncio.Semaphore(concurrency)
            async with client_session() as session:
                async def one(i: int) -> Outcome:
                    async with sem:
                        return await request(session, gw.url + "/v1/chat/completions",
                                             chat_body(6, stream=i % 2 == 0), i, timeout)

                return list(await asyncio.gather(*(one(i) for i in range(requests))))

        outcomes = asyncio.run(drive())
        report.add(outcomes, _never_failed)
        report.checks["generation_requests_to_loading_backend"] = generations(fleet.fleet["loading"])
        report.checks["never_routed_to_loading"] = generations(fleet.fleet["loading"]) == 0
        report.checks["health_of_loading_backend"] = gw.gateway.pool.get("loading").health.value
    report.seconds = time.monotonic() - t0
    return report


# -- a slow client ------------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")


class SlowReader:
    """A client that asks for a long stream and reads ``chunk`` bytes every ``every`` seconds, through a
    socket with a small receive buffer (so the kernel does not soak the stream up on its behalf)."""

    def __init__(self, host: str, port: int, body: dict[str, Any], chunk: int = 256, every: float = 0.1) -> None:
        self.host, self.port, self.body = host, port, body
        self.chunk, self.every = chunk, every
        self.read = 0
        self.status_line = b""

    async def run(self, seconds: float) -> None:
        import socket

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=self.chunk)
        payload = orjson.dumps(self.body)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(payload), payload))
        await writer.drain()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                data = await asyncio.wait_for(reader.read(self.chunk), timeout=max(0.01, end - time.monotonic()))
                if not data:
                    break
                if not self.status_line:
                    self.status_line = data.split(b"\r\n", 1)[0]
                self.read += len(data)
                await asyncio.sleep(self.every)
        except TimeoutError:
            pass
        finally:
            writer.transport.abort()


def slow_client(slow_readers: int = 4, normal: int = 16, normal_tokens: int = 40, normal_gap_ms: float = 10.0,
                rounds: int = 3, slow_seconds: float = 8.0, slow_gap_ms: float = 0.5,
                out: Path | None = None, timeout: float = 30.0) -> ScenarioReport:
    """The gateway as its own process (``python -m gateway serve``) in front of the raw backend (its own
    process). Normal streams run ``rounds`` times alone, then ``rounds`` times while ``slow_readers`` clients
    read long fast streams at ~2.5 KB/s. Checks: the normal streams' median duration with the slow readers
    over without (one run), and the gateway's RSS while the slow readers hold their streams."""
    import statistics
    import sys
    import tempfile

    from gateway.bench.overhead import MODEL, gateway_yaml
    from gateway.bench.procs import ChildProcess, get_json

    report = ScenarioReport("slow_client")
    t0 = time.monotonic()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        logs = out or Path(tmp)
        bport, gport = _free_ports(2)
        backend_url, gateway_url = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{gport}"
        config = Path(tmp) / "gateway.yaml"
        config.write_text(gateway_yaml(backend_url, gport))
        backend = ChildProcess("raw backend", [py, "-m", "gateway.bench.rawbackend", "--port", str(bport),
                                               "--model", MODEL], logs / "slow-backend.log")
        gateway = ChildProcess("gateway", [py, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                           "error"], logs / "slow-gateway.log")
        probe = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' % MODEL.encode()
        with backend, gateway:
            backend.wait_http(backend_url + "/health")
            gateway.wait_http(gateway_url + "/v1/chat/completions", method="POST", body=probe)
            body = chat_body(normal_tokens, model=MODEL, bench_gap_ms=normal_gap_ms)
            slow_body = chat_body(100_000, model=MODEL, bench_gap_ms=slow_gap_ms)
            rss: list[tuple[float, int]] = []

            async def normal_round(session: aiohttp.ClientSession, r: int) -> list[Outcome]:
                return list(await asyncio.gather(*(
                    request(session, gateway_url + "/v1/chat/completions", body, r * 1000 + i, timeout)
                    for i in range(normal))))

            async def drive() -> tuple[list[Outcome], list[Outcome], list[SlowReader]]:
                async with client_session() as session:
                    await normal_round(session, 99)  # warm-up
                    alone = [o for r in range(rounds) for o in await normal_round(session, r)]
                    rss.append((time.monotonic(), rss_bytes(gateway.pid)))
                    readers = [SlowReader("127.0.0.1", gport, slow_body) for _ in range(slow_readers)]
                    tasks = [asyncio.create_task(s.run(slow_seconds)) for s in readers]
                    await asyncio.sleep(1.0)
                    rss.append((time.monotonic(), rss_bytes(gateway.pid)))
                    beside: list[Outcome] = []
                    r = rounds
                    while not all(t.done() for t in tasks):
                        if r < 2 * rounds:
                            beside += await normal_round(session, r)
                            r += 1
                        else:
                            await asyncio.sleep(0.5)
                        rss.append((time.monotonic(), rss_bytes(gateway.pid)))
                    await asyncio.gather(*tasks)
                    return alone, beside, readers

            chunks_before = get_json(backend_url + "/stats")
            alone, beside, readers = asyncio.run(drive())
            chunks_after = get_json(backend_url + "/stats")
            report.add([*alone, *beside], _never_failed)
            assert isinstance(chunks_before, dict) and isinstance(chunks_after, dict)
            a = statistics.median(o.duration for o in alone)
            b = statistics.median(o.duration for o in beside) if beside else float("nan")
            report.checks["normal_median_alone_s"] = round(a, 3)
            report.checks["normal_median_beside_slow_s"] = round(b, 3)
            report.checks["slowdown_ratio"] = round(b / a, 3)
            report.checks["normal_streams_beside_slow"] = len(beside)
            report.checks["slow_reader_bytes_read"] = [s.read for s in readers]
            report.checks["slow_reader_status"] = sorted({s.status_line.decode("latin-1") for s in readers})
            report.checks["backend_chunks_written_meanwhile"] = chunks_after["chunks"] - chunks_before["chunks"]
            base = rss[1][1]
            report.checks["gateway_rss_mb_before_slow"] = round(rss[0][1] / 2**20, 1)
            report.checks["gateway_rss_mb_slow_start"] = round(base / 2**20, 1)
            report.checks["gateway_rss_mb_max"] = round(max(v for _, v in rss) / 2**20, 1)
            report.checks["gateway_rss_mb_end"] = round(rss[-1][1] / 2**20, 1)
            report.checks["gateway_rss_growth_mb"] = round((max(v for _, v in rss) - base) / 2**20, 1)
            report.checks["rss_samples"] = len(rss)
    report.seconds = time.monotonic() - t0
    return report


def _free_ports(n: int) -> list[int]:
    socks = [_bound_socket() for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# -- the command ---------------------------------------------------------------------------------------------
SCENARIOS: dict[str, Callable[[], ScenarioReport]] = {
    "kill": lambda: kill_while_streaming().report,
    "hang": hanging_backend,
    "garbage": lambda: garbage_backend()[0],
    "flap": flapping_backend,
    "loading": loading_backend,
    "slow": slow_client,
}


def run_faults(names: Sequence[str], out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    import logging

    logging.getLogger("gateway").setLevel(logging.CRITICAL)  # expected failures: keep the console readable
    doc: dict[str, Any] = {"schema": "gateway-bench-faults/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "scenarios": {}}
    for name in names:
        log(f"{name} ...")
        report = SCENARIOS[name]()
        doc["scenarios"][name] = report.as_dict()
        log(f"  {report.requests} requests, lost {report.lost}, error events well-formed "
            f"{report.error_events_well_formed}/{report.error_events}, max stall {report.max_stall_s:.2f} s, "
            f"{'ok' if report.ok else 'FAILED'} ({report.seconds:.1f} s)")
    doc["requests_lost"] = sum(s["lost"] for s in doc["scenarios"].values())
    doc["ok"] = all(s["ok"] for s in doc["scenarios"].values())
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return doc


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                   help="run only these (repeatable; default: all)")
    p.add_argument("--out", type=Path, default=Path("reports/faults"))
    a = p.parse_args(argv)
    doc = run_faults(a.scenario or list(SCENARIOS), a.out)
    print(f"requests lost: {doc['requests_lost']}; wrote {a.out / 'faults.json'}")
    return 0 if doc["ok"] else 1
