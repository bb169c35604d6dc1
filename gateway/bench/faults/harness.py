"""What every fault scenario uses: the gateway on a thread in front of emulated engines, one client request
and the judgement of what it got, and the scenario report."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.config import Settings, settings_from_mapping
from gateway.sim import FleetThread, SimServer, SimSpec

ASK = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


# -- the gateway on a thread ---------------------------------------------------------------------------------
class GatewayThread:
    """``create_app(settings)`` served by uvicorn on a daemon thread, configured as ``gateway serve`` does it."""

    def __init__(self, settings: Settings) -> None:
        import uvicorn

        from gateway.app import create_app
        from gateway.server_limits import uvicorn_config

        self.app = create_app(settings)
        self.gateway = self.app.gateway
        sock = _bound_socket()
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, settings.server, log_level="error", graceful_shutdown=2)
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


def never_failed(o: Outcome) -> bool:
    return o.kind != "complete"


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def generations(server: SimServer) -> int:
    return sum(1 for q in server.received if q.path.startswith("/v1/") and q.method == "POST")
