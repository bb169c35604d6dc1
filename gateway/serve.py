"""Run the gateway under uvicorn (uvloop + httptools): configured by a file, or in front of an emulated fleet
that the command line started (``gateway.sim.embedded``; the gateway never imports the emulators).

With ``server.workers`` above one, this process becomes the workers' supervisor: it starts each worker as a
process of its own (spawned, so that none inherits another's event loop or threads), and every worker listens
on the same port through a socket of its own with ``SO_REUSEPORT``, the kernel spreading new connections over
them. The supervisor restarts a worker that dies, and on SIGINT or SIGTERM asks every worker to shut down
gracefully (each lets its streams finish for ``server.shutdown_timeout``), kills what is left after that, and
exits. A worker whose supervisor is gone shuts itself down.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import logging.handlers
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from gateway import gcpolicy
from gateway.api.admin import AdminApp
from gateway.app import GatewayApp, create_app
from gateway.config import (
    ConfigError,
    Settings,
    is_loopback,
    parse_settings,
    read_settings_to_start,
    settings_from_mapping,
)
from gateway.proxy.accounting import AccessLogHandler, AccessLogWriter
from gateway.routing.policies import check_settings
from gateway.server_limits import raise_nofile_limit, uvicorn_config
from gateway.state.sealing import fleet_secret
from gateway.workers import InForce, WorkerIdentity

log = logging.getLogger("gateway.serve")

RESTARTS_PER_MINUTE = 5  # per worker; past that the supervisor gives up (a worker that cannot start)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


class _AdminServer(uvicorn.Server):
    """The admin listener's server: it leaves signals to the main server, which stops it when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _MainServer(uvicorn.Server):
    """The main listener's server: on SIGTERM or SIGINT the control plane stops taking changes at once (the
    admin listener stays up while streams finish, to watch them, but changes nothing any more)."""

    def __init__(self, config: uvicorn.Config, app: GatewayApp) -> None:
        super().__init__(config)
        self._gateway_app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._gateway_app.gateway.control.close(signal.Signals(sig).name)
        super().handle_exit(sig, frame)


def _serve(app: GatewayApp, settings: Settings, log_level: str, sock: socket.socket | None = None) -> None:
    """The main listener and, with ``server.admin_port``, the admin listener, on one event loop until SIGINT or
    SIGTERM (the main server's graceful shutdown, then the admin listener's)."""
    server = _MainServer(uvicorn_config(app, settings.server, log_level=log_level), app)
    sockets = [sock] if sock is not None else None
    port = settings.server.admin_port
    if port is None:
        server.run(sockets=sockets)
        return
    admin_settings = settings.server.model_copy(update={"host": settings.server.admin_host, "port": port})
    admin_app = AdminApp(app.gateway.control, app.gateway.keys)
    admin = _AdminServer(uvicorn_config(admin_app, admin_settings, log_level=log_level, lifespan="off",
                                        graceful_shutdown=1.0))
    # several workers share the admin port like the main one (any of them answers: drains and reloads reach
    # the others through the shared state)
    admin_sockets = [reuseport_socket(settings.server.admin_host, port)] if sock is not None else None

    async def both() -> None:
        task = asyncio.create_task(admin.serve(sockets=admin_sockets))
        try:
            await server.serve(sockets=sockets)
        finally:
            admin.should_exit = True
            await task

    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(both())


def _reload_on_sighup(app: GatewayApp) -> None:
    """SIGHUP re-reads the configuration file (see Gateway.reconfigure). A worker starts with SIGHUP blocked (see
    ``supervise``): one sent meanwhile is delivered here, and reloads once the gateway has started."""
    signal.signal(signal.SIGHUP, lambda signum, frame: app.gateway.control.request_reload("SIGHUP"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


def warn_if_open(settings: Settings) -> None:
    """One WARNING when the gateway serves without API keys, louder when other machines can reach it."""
    if settings.auth.keys:
        return
    server = settings.server
    where = f"{server.host or '*'}:{server.port}"
    how = ("to require keys, list them under auth.keys (name, key_sha256: the SHA-256 of the key, scopes) and reload "
           "(docs/operating.md#api-keys-and-what-a-client-never-sees)")
    said = " (auth.open: true)" if settings.auth.open else ""
    if is_loopback(server.host):
        log.warning("no API keys%s: the gateway on %s serves anyone who can connect to it on this machine; %s",
                    said, where, how)
    else:
        log.warning("NO API KEYS%s, AND %s CAN BE REACHED FROM OTHER MACHINES: anyone who can connect may use every "
                    "model and spend the engines' capacity; %s", said, where, how)


def _run(settings: Settings, log_level: str, config_path: str | None = None, content: bytes | None = None) -> None:
    warn_if_open(settings)
    count = settings.server.worker_count()
    if count > 1:
        raise SystemExit(supervise(settings, log_level, count, config_path, content))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to the handlers that were
    # installed before it. Make those end the process by unwinding, so that every ``finally`` runs (the
    # embedded fleet's child process is stopped) and the exit status is 0.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    raise_nofile_limit()  # before the connection cap is worked out from it
    app = create_app(settings, config_path=config_path, config_content=content)
    _reload_on_sighup(app)
    gcpolicy.quiet()
    _serve(app, settings, log_level)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that other processes may bind too (``SO_REUSEPORT``), not listening
    yet: the event loop's server listens on it once the app has started, so that the kernel hands a starting
    (or restarting) worker no connection before its backends are probed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def configure_logging(log_level: str) -> None:
    """The process's logs: diagnostics on standard error, the access log's JSON lines on standard output, both
    written by threads (see ``log_off_the_loop`` and ``AccessLogWriter``). Run by ``gateway serve`` and by
    each of its workers (spawned: a fresh interpreter inherits no logging)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_off_the_loop()
    # one line per health/load scrape is noise; the pool logs state changes itself
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    # The access log: bare JSON lines on standard output, apart from the diagnostic log on standard error.
    # Written by a thread, in batches: a slow stdout (a full pipe to a log collector) must never block the
    # event loop that carries every stream. With this handler alone on the logger, accounting hands its lines
    # to the writer without the logging machinery; what is left is written at exit.
    access = logging.getLogger("gateway.access")
    writer = AccessLogWriter(sys.stdout)
    access.addHandler(AccessLogHandler(writer))
    access.setLevel(logging.INFO)
    access.propagate = False
    writer.start()
    atexit.register(writer.stop)


def log_off_the_loop() -> None:
    """Hand the root logger's records to a thread that writes them with its handlers: a blocked standard error
    (a full pipe to a log collector, a stalled terminal) must not stall the event loop that carries every stream.
    Records wait in memory meanwhile, none is dropped; what is left is written at exit."""
    root = logging.getLogger()
    handlers = [h for h in root.handlers if not isinstance(h, logging.handlers.QueueHandler)]
    if not handlers:
        return
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, *handlers, respect_handler_level=True)
    root.handlers = [logging.handlers.QueueHandler(records)]
    listener.start()
    atexit.register(listener.stop)


def _orphan_watch(parent: int) -> None:
    """End this worker (gracefully, as SIGTERM does) once its supervisor is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker(in_force: InForce, identity: WorkerIdentity, log_level: str, parent: int, config_path: str | None,
            report: Connection) -> None:
    """One worker: serves ``in_force`` and tells the supervisor, over ``report``, what it applies later."""
    configure_logging(log_level)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    threading.Thread(target=_orphan_watch, args=(parent,), name="orphan-watch", daemon=True).start()
    raise_nofile_limit()
    settings = in_force.settings
    app = create_app(settings, worker=identity, config_path=config_path, config_content=in_force.content,
                     on_applied=report.send, known_keys=in_force.known)
    _reload_on_sighup(app)
    gcpolicy.quiet()
    _serve(app, settings, log_level, reuseport_socket(settings.server.host, settings.server.port))


class _Applied:
    """What the workers report they applied, the latest kept: a worker started again runs what is in force now
    (the last reload, and the admin API's changes since, with the keys they have had in force), not the
    configuration the gateway started with.

    A worker that applied another reading of the file (a reload by the admin API, SIGHUP or its file watch) has
    the others read it too (``new_file``: the supervisor sends them SIGHUP), and so does a reload by the admin API of
    an unchanged file (it undoes the admin API's changes since, which reached the others over Redis alone: a
    backend it removed kept being served by the others while Redis did not answer, sweep 22). Told over Redis
    alone, a reload made while Redis did not answer, or while a worker was started again, never reached them: a
    key revoked through the admin API kept being served by the other workers (sweep 20). The file is what they
    read, not a worker's settings: passed on whole, the settings of two changes made at once overwrote each
    other, an older one bringing a revoked key back, or went round the workers for good (sweep 21)."""

    def __init__(self, first: InForce, new_file: Callable[[int], None]) -> None:
        self.latest = first
        self._new_file = new_file  # told the index of a worker that applied another reading of the file
        self._reports: dict[int, Connection] = {}  # worker index -> its pipe's reading end

    def channel(self, index: int) -> Connection:
        """A new pipe for worker ``index`` (started or started again): the end its process writes to."""
        self.close(index)
        receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        self._reports[index] = receive
        return send

    def waitables(self) -> list[Connection]:
        return list(self._reports.values())

    def take(self) -> None:
        """Read every report waiting (a worker that died has said its last)."""
        for index, conn in list(self._reports.items()):
            try:
                while conn.poll():
                    report = conn.recv()
                    if isinstance(report, InForce):
                        new_file = report.content is not None and (report.tell
                                                                   or report.content != self.latest.content)
                        self.latest = report
                        if new_file:
                            self._new_file(index)
            except (EOFError, OSError):
                self.close(index)

    def close(self, index: int) -> None:
        conn = self._reports.pop(index, None)
        if conn is not None:
            conn.close()


def supervise(settings: Settings, log_level: str, count: int, config_path: str | None = None,
              content: bytes | None = None) -> int:
    """Run ``count`` workers until SIGINT or SIGTERM (SIGHUP is passed to every worker, each of which reloads
    the configuration file); the exit status (1: a worker kept failing to start). ``content``: the file's bytes
    ``settings`` came from. A worker started again runs what the workers last applied (:class:`_Applied`)."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
    try:  # the port, checked once here rather than by every worker failing alike
        reuseport_socket(settings.server.host, settings.server.port).close()
    except OSError as exc:
        raise ConfigError(f"server: cannot listen on {settings.server.host}:{settings.server.port}: "
                          f"{exc.strerror}") from None
    run_dir = tempfile.mkdtemp(prefix="gateway-workers-")  # mode 0700: only this user reaches the sockets
    ctx = multiprocessing.get_context("spawn")
    parent = os.getpid()
    stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def reload(signum: int, frame: object) -> None:
        for proc in list(procs.values()):
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGHUP)

    def others_reload(index: int) -> None:
        for other, proc in list(procs.items()):
            if other != index and proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGHUP)

    applied = _Applied(InForce(settings, content), others_reload)
    secret = fleet_secret(settings.state, [k.digest() for k in settings.auth.keys])

    def start(index: int) -> BaseProcess:
        identity = WorkerIdentity(index, count, run_dir, secret)
        applied.take()  # (what a worker said before it died, or just now)
        report = applied.channel(index)
        proc = ctx.Process(target=_worker, args=(applied.latest, identity, log_level, parent, config_path, report),
                           name=f"worker-{index}")
        # SIGHUP's default action ends a process, and a worker's handler is installed only once its app is built:
        # a reload signal sent to the process group, or forwarded while a worker started (again), killed it. The
        # mask is inherited across fork and exec: the worker unblocks SIGHUP once its handler is in place, and a
        # pending one is then a reload (so is multiprocessing's resource tracker, started here the first time)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        report.close()  # (the worker holds its own copy)
        return proc

    procs: dict[int, BaseProcess] = {}
    signal.signal(signal.SIGHUP, reload)
    procs.update((i, start(i)) for i in range(count))
    restarts: dict[int, list[float]] = {i: [] for i in range(count)}
    status = 0
    log.info("gateway: %d workers on %s:%d (pids %s)", count, settings.server.host, settings.server.port,
             " ".join(str(p.pid) for p in procs.values()))
    try:
        while not stopping.is_set():
            sentinels = {p.sentinel: i for i, p in procs.items()}
            ready = multiprocessing.connection.wait([*sentinels, *applied.waitables()], timeout=0.5)
            applied.take()
            for sentinel in ready:
                if not isinstance(sentinel, int):
                    continue
                index = sentinels[sentinel]
                proc = procs[index]
                proc.join()
                if stopping.is_set():
                    break
                now = time.monotonic()
                recent = [t for t in restarts[index] if now - t < 60.0] + [now]
                restarts[index] = recent
                if len(recent) > RESTARTS_PER_MINUTE:
                    log.error("worker %d exited with status %s %d times within a minute: stopping the gateway",
                              index, proc.exitcode, len(recent))
                    status = 1
                    stopping.set()
                    break
                log.warning("worker %d (pid %s) exited with status %s: starting it again", index, proc.pid,
                            proc.exitcode)
                procs[index] = start(index)
    finally:
        _stop_all(list(procs.values()), settings.server.shutdown_timeout + 10.0)
        for index in procs:
            applied.close(index)
        shutil.rmtree(run_dir, ignore_errors=True)
    return status


def _stop_all(procs: list[BaseProcess], grace: float) -> None:
    """SIGTERM to every worker (each shuts down gracefully), SIGKILL to those still there after ``grace``."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.error("worker %s did not stop within %.0f s: killing it", proc.name, grace)
            proc.kill()
            proc.join()


DEMO_ADMIN_PORT = 8001  # the admin listener in front of the emulated fleet, when no port is asked for


def serve(config_path: str | None, *, host: str | None, port: int | None, log_level: str,
          emulated: Sequence[Mapping[str, str]] = (), admin_port: int | None = None) -> int:
    """Serve until SIGINT or SIGTERM: the gateway configured by ``config_path`` or, without one, in front of
    ``emulated``: the backends (``name``, ``engine``, ``url``) of an emulated fleet that the caller started and
    keeps running meanwhile. ``host``, ``port`` and ``admin_port`` override the configured listeners; in front
    of the emulated fleet on the default port, the admin listener (and its status page) is on 8001."""
    if config_path is None and port is None and admin_port is None:
        admin_port = DEMO_ADMIN_PORT
    server_overrides = {k: v for k, v in (("host", host), ("port", port), ("admin_port", admin_port))
                        if v is not None}
    if config_path is not None:
        # The flags go where the environment's overrides go, so that every reload of the file (and every worker)
        # keeps them: applied to the loaded settings alone, each reload saw the file's port as a change of
        # 'server' and answered restart_needed though nothing had changed.
        for key, value in server_overrides.items():
            os.environ[f"GATEWAY_SERVER__{key.upper()}"] = str(value)
        content = read_settings_to_start(config_path)  # (once it held still: a file rewritten in place, sweep 27)
        settings = parse_settings(content, config_path)
        check_settings(settings)
        _run(settings, log_level, config_path, content)
        return 0
    settings = settings_from_mapping({"server": server_overrides, "backends": [dict(b) for b in emulated]})
    check_settings(settings)
    print(
        "No --config given: the gateway is serving an EMULATED fleet, not real models:\n"
        + "\n".join(f"  {b.name:<16} {b.engine:<9} {b.url}" for b in settings.backends)
        + f"\nOpenAI base URL: http://{settings.server.host}:{settings.server.port}/v1"
        + (f"\nStatus page: http://{settings.server.admin_host}:{settings.server.admin_port}/ui"
           if settings.server.admin_port is not None else ""),
        flush=True,
    )
    _run(settings, log_level)
    return 0
