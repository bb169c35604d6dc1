"""The gateway's front door under hostile or careless clients: a huge request head, thousands of idle
sockets, heads and bodies that trickle in, keep-alive connections left open.

The gateway runs in front of an emulated vLLM server with short timeouts (so that the tests take seconds) and
a connection cap of 1000. A prober on its own keep-alive connection keeps asking ``/health`` (and the OpenAI
SDK a chat completion) throughout: its latency during each attack is compared with its latency before, in
the same run. The timeouts run on the real clock and are checked not to fire early; otherwise what each
connection got, and in what order, tells refused from timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import yaml

from gateway.app import GatewayApp, create_app
from gateway.bench.faults import is_error_envelope, send_huge_header, settings_for
from gateway.config import ServerSettings
from gateway.pool.state import Health
from gateway.server_limits import default_max_connections, raise_nofile_limit
from gateway.sim import FleetThread, SimSpec
from tests.conftest import ServerThread, free_port_block, serve_in_thread
from tests.files import write_config
from tests.waiting import until_true, wait_until

HEADER_LIMIT = 64 * 1024
# long enough that a refusal delayed by one TCP retransmission (1 s: a client's handshake completes while the
# gateway's accept queue overflows under a 3,000-connection flood on a busy machine; seen in CI) is still told
# apart from a connection held for the whole timeout
HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 1.0
KEEPALIVE = 1.0
CAP = 1000


@dataclass
class Front:
    gateway: ServerThread
    app: GatewayApp

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def port(self) -> int:
        return self.gateway.port

    def open_connections(self) -> int:
        return len(self.gateway.server.server_state.connections)

    def in_flight(self) -> float:
        families = self.app.gateway.metrics.registry.collect()
        return next(float(f.samples[0].value) for f in families if f.name == "gateway_requests_in_flight")

    def backends_ready(self) -> bool:
        return all(b.health is Health.READY and b.marked_down == 0 for b in self.app.gateway.pool.backends)


@pytest.fixture(scope="module")
def front() -> Iterator[Front]:
    raise_nofile_limit()  # the test holds thousands of sockets at both ends
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=20.0)]) as fleet:
        settings = settings_for(fleet.fleet.servers, server={
            "max_header_bytes": HEADER_LIMIT, "header_timeout": HEADER_TIMEOUT, "body_timeout": BODY_TIMEOUT,
            "keepalive_timeout": KEEPALIVE, "max_connections": CAP})
        app = create_app(settings)
        with serve_in_thread(app) as gateway:
            front = Front(gateway, app)
            wait_until(front.backends_ready, "the emulated backend ready")
            yield front


# -- a client on its own keep-alive connection, timing every request -----------------------------------------
@dataclass
class Prober:
    """GET /health, and every fifth time a chat completion through the OpenAI SDK, back to back on one
    keep-alive connection; records (start, seconds) of each /health and whether the backend stayed ready."""

    front: Front
    health: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    chats: int = 0
    backends_ready: bool = True
    most_connections: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.front.url, timeout=10) as http:
            sdk = openai.OpenAI(base_url=self.front.url + "/v1", api_key="unused", max_retries=0, http_client=http)
            i = 0
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = http.get("/health").status_code
                    self.health.append((t0, time.perf_counter() - t0))
                    if status != 200:
                        self.failures.append(f"/health {status}")
                    if i % 5 == 0:
                        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
                        self.chats += 1
                except Exception as exc:  # every failure is a finding
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.backends_ready &= self.front.backends_ready()
                self.most_connections = max(self.most_connections, self.front.open_connections())
                i += 1
                # real time: the prober's pace, a client every few ms (not a loop that starves the gateway's thread)
                time.sleep(0.005)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def between(self, start: float, end: float) -> list[float]:
        return [s for t, s in self.health if start <= t <= end]


def wait_for_samples(prober: Prober, count: int) -> None:
    try:
        wait_until(lambda: len(prober.health) >= count, f"{count} answers to the prober")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: it got {len(prober.health)}, {prober.failures[:5]}") from None


def p90(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=10)[-1]


# -- a huge request head -------------------------------------------------------------------------------------
def test_a_64_mib_header_gets_431_at_once_and_holds_no_one_back(front: Front) -> None:
    with Prober(front) as prober:
        wait_for_samples(prober, 100)
        start = time.perf_counter()
        attacks = []
        while len(attacks) < 5 or time.perf_counter() - start < 1.0:  # long enough to see the prober's pace
            attacks.append(send_huge_header(front.port, HEADER_LIMIT))
        end = time.perf_counter()
        wait_for_samples(prober, len(prober.health) + 20)
    for attack in attacks:
        assert attack.status == 431, attack
        assert is_error_envelope(orjson.loads(attack.body)), attack.body
        # the gateway stopped reading at the limit: what the client got in is what the kernel buffers held
        assert attack.bytes_sent < 32 << 20, attack.bytes_sent
    # (answered at the limit, not when the header timeout fired: that one answers 408; and not after the head
    # was read whole: what was sent stopped at the kernel's buffers)
    before, during = prober.between(0, start), prober.between(start, end)
    assert not prober.failures, prober.failures[:5]
    assert len(during) >= 10, "the prober kept being answered while the heads came in"
    # before the limit, each 64 MiB head held the event loop for seconds (5.9 s here): a ratio in the thousands
    assert statistics.median(during) < 3 * statistics.median(before), (statistics.median(before), during)
    assert p90(during) < 5 * p90(before), (p90(before), p90(during))


def raw_request(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(65536)
        head, _, body = raw.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
            b"content-length:"))
        while len(body) < length:
            body += sock.recv(65536)
        return int(head.split(b" ", 2)[1]), body


def test_the_limit_counts_the_head_only_however_it_arrives(front: Front) -> None:
    under = b"GET /health HTTP/1.1\r\nHost: g\r\nX-Pad: " + b"p" * (HEADER_LIMIT - 100) + b"\r\n\r\n"
    assert raw_request(front.port, under)[0] == 200
    # just over the limit, in many small writes: refused all the same
    over = b"GET /health HTTP/1.1\r\nHost: g\r\n" + b"X-Pad: pppppppppppppppppppppppppppppppp\r\n" * 2000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as sock:
        with contextlib.suppress(OSError):
            for i in range(0, len(over), 1000):
                sock.sendall(over[i:i + 1000])
        assert sock.recv(64).startswith(b"HTTP/1.1 431 ")
    # a body is not head: a request whose first read holds its head and 1 MiB of body is served (the padding
    # is JSON whitespace, so the prompt stays within the emulator's context)
    body = b'{"model": "m",' + b" " * (1 << 20) + b'"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    post = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    status, answer = raw_request(front.port, post)
    assert status == 200, answer[:300]
    assert refused(front, "request_headers_too_large") >= 1  # operators see refusals on the dashboard


def refused(front: Front, code: str) -> float:
    return refusals_counted(httpx.get(front.url + "/metrics").text, code)


def test_a_request_httptools_cannot_parse_gets_an_openai_error_and_is_counted(front: Front) -> None:
    before = refused(front, "invalid_http_request")
    status, body = raw_request(front.port, b"GET /health HTTP/1.1\r\nHost: g\r\nBad Header\r\n\r\n")
    assert status == 400
    assert is_error_envelope(orjson.loads(body)), body
    assert refused(front, "invalid_http_request") == before + 1


# -- thousands of idle connections ---------------------------------------------------------------------------
def test_idle_connections_past_the_cap_are_refused_at_once_and_the_rest_time_out(front: Front) -> None:
    flood = 3000
    with Prober(front) as prober:
        wait_for_samples(prober, 100)
        start = time.perf_counter()
        socks: list[socket.socket] = []
        opened: list[float] = []  # when each of socks opened
        # (each socket is watched from its opening, so that the order of the closes read below is the order
        # they came in, however long the flood takes to open)
        sel = selectors.DefaultSelector()
        try:
            for _ in range(flood):
                socks.append(socket.create_connection(("127.0.0.1", front.port)))
                opened.append(time.perf_counter())
                socks[-1].setblocking(False)
                sel.register(socks[-1], selectors.EVENT_READ, len(socks) - 1)
            # read every socket to its end: a refusal is a 503 and a close, an idle connection a close alone
            got: list[bytes] = [b""] * flood
            closes: list[tuple[int, float]] = []  # (socket, when), in the order they closed
            bound = time.perf_counter() + HEADER_TIMEOUT + 10
            while len(closes) < flood and time.perf_counter() < bound:
                for key, _ in sel.select(timeout=0.5):
                    try:
                        data = socks[key.data].recv(4096)
                    except ConnectionResetError:
                        data = b""
                    if data:
                        got[key.data] += data
                    else:
                        closes.append((key.data, time.perf_counter()))
                        sel.unregister(key.fileobj)
            end = time.perf_counter()
            wait_for_samples(prober, len(prober.health) + 20)
        finally:
            sel.close()
            for sock in socks:
                sock.close()
    order = [i for i, _ in closes]
    refused = [i for i in order if got[i].startswith(b"HTTP/1.1 503 ")]
    timed_out = [i for i in order if got[i] == b""]
    assert len(closes) == flood, f"{flood - len(closes)} connections were never closed"
    assert len(refused) + len(timed_out) == flood
    assert len(refused) >= flood - CAP, len(refused)
    assert prober.most_connections <= CAP
    body = got[refused[0]].partition(b"\r\n\r\n")[2]
    assert is_error_envelope(orjson.loads(body)), body
    # a refusal comes at once, an idle connection lives for the header timeout: every refusal came before the
    # first idle connection timed out (a refusal that waited for the timeout would come after it; one the
    # gateway could not accept in time is retransmitted a second later, still well within the timeout)
    assert order[:len(refused)] == refused, [bool(got[i]) for i in order[:len(refused) + 20]]
    idle_lives = [when - opened[i] for i, when in closes if got[i] == b""]
    assert min(idle_lives) > HEADER_TIMEOUT * 0.9, idle_lives  # real time: the header timeout fires not early
    # the others were served throughout, and the backend never looked down
    assert not prober.failures, prober.failures[:5]
    assert prober.backends_ready
    assert prober.chats > 0
    before, during = prober.between(0, start), prober.between(start, end)
    assert len(during) >= 10
    assert statistics.median(during) < 3 * statistics.median(before), (statistics.median(before), during)


# -- heads and bodies that trickle in, keep-alive connections left open --------------------------------------
@dataclass
class Slow:
    status: int | None = None
    body: bytes = b""
    seconds: float = 0.0  # from the last byte the client sent to the end of the connection
    closed_silently: bool = False
    ended: int = 0  # the connection's place among those that ended (see _judge)
    trickling: bool = False  # (slowloris) answered while its head was still coming


_ENDS = itertools.count()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    with contextlib.suppress(ConnectionError):
        return await reader.read()
    return b""


def _judge(out: Slow, raw: bytes, last_sent: float) -> Slow:
    out.seconds = time.perf_counter() - last_sent
    if raw.startswith(b"HTTP/1.1 "):
        out.status = int(raw.split(b" ", 2)[1])
        out.body = raw.partition(b"\r\n\r\n")[2]
    out.closed_silently = raw == b""
    out.ended = next(_ENDS)
    return out


async def slowloris(port: int, every: float, until: float) -> Slow:
    """A head trickling in one header line every ``every`` seconds, never finished."""
    # (timed from before the connection opens: the server's clock starts when it accepts, which on a loaded
    # loop can be well before open_connection returns here; once 100 lorises measured 2.28 s of a 3 s timeout)
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: g\r\n")
    raw = b""
    trickling = False
    while time.perf_counter() - t0 < until:
        try:
            raw = await asyncio.wait_for(reader.read(65536), timeout=every)
            trickling = True
            break
        except TimeoutError:
            writer.write(b"X-Slow: yes\r\n")
    out = _judge(Slow(), raw + await _read_all(reader), t0)
    out.trickling = trickling
    writer.close()
    return out


async def stalled_body(port: int) -> Slow:
    """A chat request that sends part of its declared body, then nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 500\r\n\r\n" + b'{"model": "m", "messages": [')
    await writer.drain()
    last = time.perf_counter()
    out = _judge(Slow(), await _read_all(reader), last)
    writer.close()
    return out


async def slow_steady_body(port: int, pieces: int, every: float) -> Slow:
    """A chat request whose body comes in ``pieces`` pieces, ``every`` seconds apart (under the timeout)."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    step = -(-len(body) // pieces)
    for i in range(0, len(body), step):
        await asyncio.sleep(every)  # real time: a body piece every `every` seconds, within the body timeout
        writer.write(body[i:i + step])
        await writer.drain()
    last = time.perf_counter()
    out = _judge(Slow(), await _read_all(reader), last)
    writer.close()
    return out


async def idle_after_response(port: int) -> Slow:
    """One /health on a keep-alive connection, then silence."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: g\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    answered = time.perf_counter()
    out = _judge(Slow(), await _read_all(reader), answered)
    out.status = int(head.split(b" ", 2)[1])
    writer.close()
    return out


async def silent(port: int) -> Slow:
    opened = time.perf_counter()  # (before the connection opens, as in slowloris)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = _judge(Slow(), await _read_all(reader), opened)
    writer.close()
    return out


def test_slow_heads_and_stalled_bodies_get_408_and_idle_connections_close(front: Front) -> None:
    async def drive() -> tuple[list[Slow], list[Slow], Slow, Slow, Slow]:
        async with asyncio.timeout(30):
            lorises = [asyncio.create_task(slowloris(front.port, 0.25, 10.0)) for _ in range(100)]
            stalled = [asyncio.create_task(stalled_body(front.port)) for _ in range(50)]
            # (0.4 of the timeout apart: at 0.6, a piece this loop sent 0.4 s late, beside 150 other sockets on a
            # loaded 2-core machine, found the connection timed out)
            steady = asyncio.create_task(slow_steady_body(front.port, pieces=8, every=BODY_TIMEOUT * 0.4))
            keepalive = asyncio.create_task(idle_after_response(front.port))
            quiet = asyncio.create_task(silent(front.port))
            return (await asyncio.gather(*lorises), await asyncio.gather(*stalled), await steady, await keepalive,
                    await quiet)

    with Prober(front) as prober:
        lorises, stalled, steady, keepalive, quiet = asyncio.run(drive())
    # a head still trickling in when the header timeout ends (its clock runs from the first byte, whatever
    # comes after): 408 while it trickles, then the connection closes
    assert {(s.status, s.trickling) for s in lorises} == {(408, True)}, sorted(
        {(s.status, s.trickling, s.body[:80]) for s in lorises})
    assert all(is_error_envelope(orjson.loads(s.body)) for s in lorises)
    # real time: the header timeout fires not early
    assert min(s.seconds for s in lorises) > HEADER_TIMEOUT * 0.9, sorted(s.seconds for s in lorises)
    # a body that stops: 408 once the body timeout has passed since its last piece
    assert {s.status for s in stalled} == {408}, sorted({(s.status, s.body[:80]) for s in stalled})
    assert all(orjson.loads(s.body)["error"]["code"] == "body_timeout" for s in stalled)
    # real time: the body timeout fires not early
    assert min(s.seconds for s in stalled) > BODY_TIMEOUT * 0.9, sorted(s.seconds for s in stalled)
    # a body that keeps coming, each piece within the timeout, is served although it takes 3.2 timeouts
    assert steady.status == 200, steady
    # a keep-alive connection is closed once idle for the keep-alive timeout (before the silent one opened with
    # it, which the longer header timeout closes without a word)
    assert keepalive.status == 200 and keepalive.ended < quiet.ended, (keepalive, quiet)
    assert keepalive.seconds > KEEPALIVE * 0.9, keepalive  # real time: the keep-alive timeout fires not early
    assert quiet.closed_silently, quiet
    assert quiet.seconds > HEADER_TIMEOUT * 0.9, quiet  # real time: the header timeout fires not early
    assert not prober.failures, prober.failures[:5]
    assert prober.backends_ready
    # the stalled requests reached the app (the chat route) and left nothing behind in flight
    wait_until(lambda: front.in_flight() == 0, "no request in flight")


def test_the_default_connection_cap_keeps_a_reserve_of_descriptors_for_the_backends() -> None:
    assert default_max_connections(1_048_576) == 786_432
    assert default_max_connections(20_000) == 15_000  # issue 13's limit: 5,000 left for upstream
    assert default_max_connections(4096) == 3072
    assert default_max_connections(1024) == 512


# -- the descriptor limit, as `gateway serve` meets it ------------------------------------------------------
def _small_descriptor_limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, 2048))


@pytest.mark.system
def test_an_idle_flood_leaves_gateway_serve_the_descriptors_its_backends_need(tmp_path: Path) -> None:
    """Issue 13: idle sockets took every descriptor, and the gateway could no longer reach its backends. Here
    ``gateway serve`` runs with 2,048 descriptors (so its default cap is 1,024) and 3,000 idle sockets arrive;
    16 clients connected before them then ask for 16 completions at once, which takes new upstream
    connections."""
    base = free_port_block(2)
    sim = subprocess.Popen([sys.executable, "-m", "gateway.sim", "serve", "--engine", "vllm", "--model", "m",
                            "--port", str(base), "--time-scale", "20"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = tmp_path / "gateway.yaml"
    # a long keep-alive, so that the 16 clients' connections outlast however long the flood takes to open
    write_config(config, yaml.safe_dump({"server": {"port": base + 1, "keepalive_timeout": 60},
                                      "backends": [{"name": "v", "engine": "vllm", "url": f"http://127.0.0.1:{base}"}],
                                      "scrape": {"interval": 0.2}}))
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=_small_descriptor_limit)
    url = f"http://127.0.0.1:{base + 1}"
    socks: list[socket.socket] = []
    try:
        def ready() -> bool:
            assert gateway.poll() is None and sim.poll() is None, "gateway serve or the emulator exited"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            return False

        wait_until(ready, "gateway serve ready", within=30)

        async def clients() -> tuple[list[int], dict[str, object], int]:
            limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
            async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as http:
                await asyncio.gather(*(http.get("/health") for _ in range(16)))  # 16 open connections
                await asyncio.to_thread(flood, base + 1, 3000, socks)

                # the gateway accepts the backlog at its own pace: wait until it has refused what its cap (1,024
                # for 2,048 descriptors, 16 of them taken) leaves of the flood, by its own count (read on one of
                # the 16 connections: a new one would be refused)
                async def all_refused() -> bool:
                    count = refusals_counted((await http.get("/metrics")).text, "too_many_connections")
                    return count >= 3000 - (default_max_connections(2048) - 16)

                await until_true(all_refused, "the flood past the cap refused")
                refused = answered_503(socks)
                sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
                answers = await asyncio.gather(*(
                    sdk.chat.completions.with_raw_response.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
                    for _ in range(16)), return_exceptions=True)
                ready = (await http.get("/ready")).json()
            statuses = [a.status_code if not isinstance(a, BaseException) else -1 for a in answers]
            return statuses, ready, refused

        statuses, ready, refused = asyncio.run(clients())
    finally:
        for s in socks:
            s.close()
        for proc in (gateway, sim):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert statuses == [200] * 16, statuses
    assert ready["backends"]["v"]["health"] == "ready", ready  # type: ignore[index]
    assert refused >= 3000 - 1024, refused


def flood(port: int, count: int, socks: list[socket.socket]) -> None:
    """Open ``count`` idle connections (kept in ``socks``)."""
    for _ in range(count):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))


def answered_503(socks: list[socket.socket]) -> int:
    """How many of ``socks`` were answered 503 without sending a byte (as far as has come in)."""
    refused = 0
    for sock in socks:
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError, ConnectionError):
            refused += sock.recv(64).startswith(b"HTTP/1.1 503 ")
    return refused


def refusals_counted(metrics: str, code: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'gateway_connections_refused_total{{code="{code}"}}'):
            return float(line.split()[-1])
    return 0.0


# -- keep-alive outlasts the clients' own expiry ---------------------------------------------------------------
async def _plain_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET / HTTP/1.1\r\nHost: g\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    await reader.readexactly(2)
    return head


def test_a_kept_alive_connection_waits_on_the_keep_alive_clock_and_a_later_head_on_the_header_clock() -> None:
    """The CI failure that found it: a 2,000-request run with httpx (5 s idle expiry, as the OpenAI SDK) met
    a ReadError when a connection idle for 5 s was reused as the gateway's 5 s keep-alive closed it. The idle
    wait between requests is now the keep-alive clock's alone (75 s by default), and the header clock starts
    with the next request's first byte. Here: header timeout 1 s, keep-alive 4 s."""
    async def drive(port: int) -> tuple[bytes, bytes, float]:
        async with asyncio.timeout(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            first = await _get(reader, writer)
            await asyncio.sleep(2.0)  # real time: past the header timeout, within the keep-alive one
            second = await _get(reader, writer)
            # (a head clock started at the last answer would fire early)
            await asyncio.sleep(0.5)  # real time: half a header timeout passes before the next head begins
            writer.write(b"GET / HTTP/1.1\r\nHost: g\r\n")  # a head begun, never finished
            begun = time.perf_counter()
            raw = await _read_all(reader)
            writer.close()
            return first + second, raw, time.perf_counter() - begun

    with serve_in_thread(_plain_app, server=ServerSettings(header_timeout=1.0, keepalive_timeout=4.0)) as server:
        heads, raw, seconds = asyncio.run(drive(server.port))
    assert heads.count(b"HTTP/1.1 200 ") == 2, heads
    # the unfinished head: 408 on the header clock (the keep-alive's would close without a word), from its first
    # byte
    assert raw.startswith(b"HTTP/1.1 408 "), (raw[:60], seconds)
    assert seconds > 0.9, seconds  # real time: the header timeout fires not early


def test_pipelined_heads_each_under_the_limit_are_all_answered(front: Front) -> None:
    """QA: requests written back to back in one send, whose heads together passed max_header_bytes (3 of
    30 KB each, or 357 small ones), got no answer at all: the whole read was counted as one head."""
    pad = b"x" * 30_000
    one = (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + pad + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(one * 3)
        raw = b""
        while raw.count(b"HTTP/1.1 ") < 3 or not raw.endswith(b"}"):
            piece = sock.recv(65536)
            assert piece, f"closed after {raw.count(b'HTTP/1.1 ')} answers: {raw[:200]!r}"
            raw += piece
    assert raw.count(b"HTTP/1.1 200 ") == 3, raw[:300]
    # a single head past the limit is still refused
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"x" * (HEADER_LIMIT * 2) + b"\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 431 ")


def test_an_upgrade_to_another_protocol_is_refused_plainly_not_run_with_an_empty_body(front: Front) -> None:
    """curl --http2 on http:// sends Upgrade: h2c with its POST: httptools stops at the head and the app got an
    empty body (a 400 about a zero-length document). The gateway speaks HTTP/1.1 only, and says so."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    status, answer = raw_request(front.port, head + body)
    assert status == 400, answer
    error = orjson.loads(answer)["error"]
    assert error["code"] == "upgrade_not_supported" and "h2c" in error["message"], error
    # a WebSocket upgrade alike (no route speaks it; uvicorn answered a bare text/plain 403)
    ws = (b"GET /v1/models HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
          b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    status, answer = raw_request(front.port, ws)
    assert status == 400 and orjson.loads(answer)["error"]["code"] == "upgrade_not_supported", answer
    # the same request without the upgrade is served
    plain = head.replace(b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n", b"")
    assert raw_request(front.port, plain + body)[0] == 200


@pytest.mark.parametrize("codings", [b"Transfer-Encoding: gzip, chunked\r\n",
                                     b"Transfer-Encoding: identity, chunked\r\n",
                                     b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n"])
def test_a_transfer_coding_other_than_chunked_is_refused_not_read_as_chunked(front: Front, codings: bytes) -> None:
    """Security sweep, item 3: Transfer-Encoding: gzip, chunked was served as plain chunked (httptools frames by
    the last coding), so a gzip-aware proxy in front and the gateway read two different requests. The gateway
    understands chunked alone: any other coding is a 501 (RFC 9112, 6.1), in the OpenAI shape, and the
    connection is closed, its body unread."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    after = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"  # pipelined behind it: never read
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(head + codings + b"\r\n" + chunked + after)
        raw = b""
        while piece := sock.recv(65536):
            raw += piece
    status, _, rest = raw.partition(b"\r\n")
    assert status == b"HTTP/1.1 501 Not Implemented", raw[:200]
    error = orjson.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "unsupported_transfer_encoding" and error["type"] == "invalid_request_error", error
    assert raw.count(b"HTTP/1.1 ") == 1, "closed after the refusal: the pipelined request is not served"
    # plain chunked (any case) is served
    assert raw_request(front.port, head + b"Transfer-Encoding: Chunked\r\n\r\n" + chunked)[0] == 200
