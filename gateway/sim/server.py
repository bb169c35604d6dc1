"""SimServer: one emulated engine process: a listener, an engine's routes, a scheduler, faults and records."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import orjson

from gateway.sim.engines import make_engine
from gateway.sim.engines.base import Engine, EngineError
from gateway.sim.faults import Faults
from gateway.sim.http import Connection, Request, Responder
from gateway.sim.scheduler import Scheduler
from gateway.sim.spec import SimSpec
from gateway.sim.stats import Latencies, RecordedRequest, Stats, recorder
from gateway.sim.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported when a spec asks for them (tokenizers, jinja2, zmq)
    from gateway.sim.hf_tokenizer import HFTokenizer
    from gateway.sim.kv_events import KvEventPublisher

KV_DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"


class SimServer:
    """An emulated engine server.

    ``start()`` binds (``port=0`` picks a free port, kept for later restarts); ``stop()`` is abrupt, like a
    killed process: the listener and every connection close, and the next ``start()`` is a fresh process
    (empty caches, queues and counters) on the same port. ``faults`` is live; ``received`` holds recent
    requests (method, path, headers, parsed JSON body); ``stats`` counts what happened.

    With ``spec.kv_events`` each start creates ``kv_events`` (a :class:`~gateway.sim.kv_events.KvEventPublisher`,
    numbering from 0) on the addresses the first start bound (``kv_events_endpoint``, ``kv_replay_endpoint``);
    ``kv_events.drop_next`` (or ``kv_events_drop_next`` in ``POST /sim/faults``) withholds coming batches.
    """

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.profile = spec.resolved_profile()
        self.port = spec.port
        self.tokenizer = Tokenizer()
        # a real tokenizer and chat template, when the spec names one (prompt token ids as vLLM/SGLang make them)
        self.hf: HFTokenizer | None = None
        if spec.tokenizer:
            from gateway.sim.hf_tokenizer import HFTokenizer

            self.hf = HFTokenizer.from_dir(spec.tokenizer, "sglang" if spec.engine == "sglang" else "vllm")
        self.kv_events: KvEventPublisher | None = None  # this process's publisher (a new one per start)
        self._kv_addresses: tuple[str, str | None] | None = None  # bound on first start, kept across restarts
        self.faults = Faults(_crash=self.crash)
        self.stats = Stats()
        self.lat = Latencies()
        self.received: Any = recorder()
        self.engine: Engine = make_engine(self)
        self._scheduler: Scheduler | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[Connection] = set()
        self._listen_task: asyncio.Task[None] | None = None
        self._ready_at = 0.0
        self._started_at = 0.0
        self.running = False

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "server not started"
        return self._scheduler

    @property
    def loading(self) -> bool:
        return self.faults.loading or asyncio.get_running_loop().time() < self._ready_at

    # -- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.running:
            return
        loop = asyncio.get_running_loop()
        for f in fields(Stats):
            setattr(self.stats, f.name, f.default)
        self.lat = Latencies()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.spec.host, self.port))
            self._start_kv_events()
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self.engine = make_engine(self)
        self._scheduler = Scheduler(self.profile, self.engine.make_cache(self.profile), self.spec.time_scale,
                                    self.stats, self.lat)
        self._scheduler.start()
        load = self.spec.load_seconds / self.spec.time_scale
        self._started_at = loop.time()
        self._ready_at = self._started_at + load
        listen_after = load * self.engine.listen_after_load_fraction
        self.running = True
        if listen_after <= 0:
            await self._listen(sock)
        else:
            self._listen_task = asyncio.create_task(self._listen_later(sock, listen_after))

    def _start_kv_events(self) -> None:
        """A fresh publisher per process start (sequence numbers from 0), on the addresses first bound."""
        kv = self.spec.kv_events
        if kv is None:
            return
        if self._kv_addresses is None:
            endpoint = kv.get("endpoint", KV_DEFAULT_ENDPOINT)
            replay = kv.get("replay_endpoint", KV_DEFAULT_ENDPOINT)
        else:
            endpoint, replay = self._kv_addresses
        from gateway.sim.kv_events import DEFAULT_BUFFER_STEPS, KvEventPublisher

        assert self.spec.engine in ("vllm", "sglang")
        self.kv_events = KvEventPublisher(self.spec.engine, endpoint, replay, kv.get("topic", ""),
                                          kv.get("buffer_steps", DEFAULT_BUFFER_STEPS))
        self._kv_addresses = (self.kv_events.endpoint, self.kv_events.replay_endpoint)
        self.kv_events.start()

    @property
    def kv_events_endpoint(self) -> str | None:
        """The PUB address bound (``tcp://127.0.0.1:PORT``), once started with ``kv_events``; kept across
        restarts."""
        return self._kv_addresses[0] if self._kv_addresses else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        """The ROUTER replay address bound (None when ``kv_events`` sets ``replay_endpoint: null``)."""
        return self._kv_addresses[1] if self._kv_addresses else None

    def kv_advertised(self) -> tuple[str, str | None] | None:
        """The publisher's addresses as the engines show them (vLLM ``/kv_event_sources``, SGLang
        ``/server_info``): the host it was told to bind (a wildcard ``*`` stays ``*``) with the port it bound."""
        kv = self.spec.kv_events
        if kv is None or self._kv_addresses is None:
            return None
        bound, bound_replay = self._kv_addresses
        told = kv.get("endpoint", KV_DEFAULT_ENDPOINT)
        told_replay = kv.get("replay_endpoint", KV_DEFAULT_ENDPOINT)
        return _as_told(told, bound), (_as_told(told_replay, bound_replay) if bound_replay else None)

    async def _listen_later(self, sock: socket.socket, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            sock.close()
            raise
        await self._listen(sock)

    async def _listen(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self._app, self._conns), sock=sock,
                                                backlog=2048)

    async def stop(self) -> None:
        if not self.running:
            return
        self.running = False
        if self._listen_task is not None:
            self._listen_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listen_task
            self._listen_task = None
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.cancel_tasks()
            conn.abort()
        if self._scheduler is not None:
            await self._scheduler.stop()
        if self.kv_events is not None:
            await self.kv_events.close()
            self.kv_events = None
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        await asyncio.sleep(0)
        # Connections the listener had accepted before it closed can reach connection_made during the awaits
        # above: a killed process would have closed them too.
        for conn in list(self._conns):
            conn.cancel_tasks()
            conn.abort()

    def crash(self) -> None:
        """Die now, like ``kill -9``: call from the server's own event loop."""
        task = asyncio.get_running_loop().create_task(self.stop())
        self._crash_task = task

    # -- requests --------------------------------------------------------------------------------------------
    async def _app(self, req: Request, resp: Responder) -> None:
        if req.path.startswith("/sim/"):
            self._admin(req, resp)
            return
        self._record(req)
        self.stats.requests += 1
        engine = self.engine
        faults = self.faults
        if faults.added_latency_s > 0:
            await asyncio.sleep(faults.added_latency_s)
        hang = faults.hang_seconds()
        if hang is not None:
            await self._hang(resp, hang)
            if resp.closed:
                return
        if self.loading:
            engine.loading(req, resp)
            return
        handler = engine.routes().get((req.method, req.path)) or engine.match_route(req.method, req.path)
        if handler is None:
            known = any(path == req.path for _, path in engine.routes())
            status = 405 if known else 404
            engine.send_error(resp, EngineError(status, "Method Not Allowed" if known else "Not Found",
                                                "not_found"))
            return
        if not engine.authorized(req):
            engine.unauthorized(resp)
            return
        if req.path in engine.generation_paths and faults.should_fail():
            msg = "Simulated engine error" if faults.error_status == 500 else "Service Unavailable"
            kind = "server" if faults.error_status == 500 else "unavailable"
            engine.send_error(resp, EngineError(faults.error_status, msg, kind))
            return
        try:
            await handler(req, resp)
        except EngineError as err:
            if resp.started:
                resp.abort()
            else:
                engine.send_error(resp, err)

    async def _hang(self, resp: Responder, seconds: float) -> None:
        closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not closed.done():
                closed.set_result(None)

        resp.on_close.append(wake)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(closed, None if seconds == float("inf") else seconds)

    def _record(self, req: Request) -> None:
        body: Any = None
        if req.body:
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError:
                body = req.body.decode("utf-8", "replace")
        self.received.append(RecordedRequest(req.method, req.path, dict(req.headers), body))

    def _admin(self, req: Request, resp: Responder) -> None:
        key = (req.method, req.path)
        if key == ("GET", "/sim/faults"):
            resp.send(200, orjson.dumps(self.faults.as_dict()))
        elif key == ("POST", "/sim/faults"):
            try:
                changes = orjson.loads(req.body or b"{}")
                if not isinstance(changes, dict):
                    raise ValueError("body must be a JSON object")
                crash = bool(changes.pop("crash", False))
                drop = changes.pop("kv_events_drop_next", None)
                if drop is not None and (not isinstance(drop, int) or drop < 0 or self.kv_events is None):
                    raise ValueError("kv_events_drop_next: a count >= 0, on a server publishing KV events")
                self.faults.update(changes)
                if drop is not None and self.kv_events is not None:
                    self.kv_events.drop_next = drop
            except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
                resp.send(400, orjson.dumps({"error": str(exc)}))
                return
            resp.send(200, orjson.dumps(self.faults.as_dict()))
            if crash:
                asyncio.get_running_loop().call_later(0.01, self.crash)
        elif key == ("GET", "/sim/requests"):
            resp.send(200, orjson.dumps([r.__dict__ for r in self.received]))
        elif key == ("GET", "/sim/stats"):
            queue = self.lat.queue
            resp.send(200, orjson.dumps({**self.stats.as_dict(), "engine": self.spec.engine,
                                         "model": self.spec.model, "emulated": True,
                                         "queue_seconds_sum": queue.sum, "queue_count": sum(queue.counts)}))
        else:
            resp.send(404, b'{"error":"unknown admin endpoint"}')


def _as_told(told: str, bound: str) -> str:
    """``tcp://*:*`` told, ``tcp://0.0.0.0:41234`` bound -> ``tcp://*:41234``."""
    if not (told.startswith("tcp://") and bound.startswith("tcp://")):
        return bound
    host = told[len("tcp://"):].rpartition(":")[0]
    return f"tcp://{host}:{bound.rpartition(':')[2]}"
