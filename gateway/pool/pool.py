"""The set of backends and the background loop that keeps each one's health, load and models fresh."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson

from gateway.clock import SYSTEM, Clock
from gateway.config import BackendSettings, BreakerSettings, DiscoverySettings, ScrapeSettings
from gateway.engines.base import BackendError, EngineAdapter
from gateway.engines.readings import MAX_MODELS
from gateway.engines.registry import create_adapter
from gateway.errors import Redactor
from gateway.pool.backend import Backend
from gateway.pool.discovery import MAX_DNS_REPLICAS, Resolver, replica_settings, system_resolver
from gateway.pool.state import Capacity, Health, KvEventSource, LoadRecord, LoopReading, Probe
from gateway.redaction import redact_url
from gateway.tasks import cancel_and_wait

log = logging.getLogger("gateway.pool")

ClientFactory = Callable[[BackendSettings, EngineAdapter], httpx.AsyncClient]
# a follower's way to the pool snapshot of the worker that scrapes for the whole pod (None: no answer)
Leader = Callable[[], Awaitable[bytes | None]]
LoopReader = Callable[[LoopReading], None]
# a backend answering garbage is logged at most this often (each failed reading is still counted)
COMPLAINT_SECONDS = 60.0


MEASURE_TIMEOUT = 60.0  # seconds a measure of a loop's step alone may take (a few tokens of a slow engine)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS settings every backend's client verifies with (httpx's defaults: certifi's authorities), made once
    per process. Made for each client, they cost 15-90 ms of the event loop apiece (the authorities parsed again):
    a pool of 100 backends held the loop seconds at start, and each backend DNS discovery added held it again."""
    return httpx.create_ssl_context()


def default_client_factory(scrape: ScrapeSettings) -> ClientFactory:
    def factory(settings: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        assert settings.url is not None, "DNS entries are expanded into replicas with URLs first"
        return httpx.AsyncClient(
            base_url=settings.url,
            headers={**settings.basic_auth_header(), **adapter.spec.auth_headers(settings.resolved_api_key())},
            timeout=scrape.timeout,
            verify=tls_context(),
        )

    return factory


class Pool:
    """Owns the backends. ``start`` probes every backend once (so the gateway starts ready when it can be)
    and then runs one scrape loop per backend, plus a discovery loop when some entry names a DNS name;
    ``stop`` ends them and closes their clients. Backends found by DNS are added and removed as the name's
    answers change; a request already sent to a removed replica finishes on it."""

    def __init__(
        self,
        backends: list[BackendSettings],
        scrape: ScrapeSettings,
        client_factory: ClientFactory | None = None,
        *,
        discovery: DiscoverySettings | None = None,
        resolver: Resolver | None = None,
        breaker: BreakerSettings | None = None,
        leader: Leader | None = None,
        clock: Clock = SYSTEM,
        on_kv_source: Callable[[], None] | None = None,
        on_loop: LoopReader | None = None,
    ) -> None:
        # told each reading of a backend's loop step (EngineSpec.load_waits_for_loop; the stall guard,
        # gateway.proxy.stall_guard)
        self.on_loop = on_loop
        # asked, when such a backend's engine runs nothing, whether its loop's step alone is wanted; told it once
        # measured (the stall guard: what its loop takes with no grammar, before any request taught it)
        self.wants_alone: Callable[[str], bool] | None = None
        self.on_alone: Callable[[str, float], None] | None = None
        self._measuring: set[str] = set()
        # told whenever a backend's discovered KV-event source changes (kv_events: discover), to subscribe
        self._on_kv_source = on_kv_source
        self._kv_unknown: dict[str, str] = {}  # backend -> why its engine showed no usable source (logged once)
        self._scrape = scrape
        self._clock = clock
        self._complained: dict[str, float] = {}  # backend -> when its last failed reading was logged
        self._overlisted: set[str] = set()  # backends that listed more than MAX_MODELS models (logged once)
        # a worker of several (server.workers) that is not the first takes the first one's readings instead of
        # scraping every engine itself: one set of scrapes per pod, whatever the number of workers
        self._leader = leader
        self._following = False
        self._probed_at: dict[str, float] = {}
        self._breaker = breaker or BreakerSettings()
        self._discovery = discovery or DiscoverySettings()
        self._resolver = resolver or system_resolver
        self._factory = client_factory or default_client_factory(scrape)
        self._groups = [b for b in backends if b.dns is not None]
        self.backends: list[Backend] = []
        self.adapters: dict[str, EngineAdapter] = {}
        self._by_name: dict[str, Backend] = {}
        self._settings: dict[str, BackendSettings] = {}
        self._group_members: dict[str, set[str]] = {g.name: set() for g in self._groups}
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._discovery_task: asyncio.Task[None] | None = None
        self._cycles: dict[str, int] = {}
        self._late: set[str] = set()  # backends whose last probe timed out while they answered the proxy
        self._running = False
        self._background: set[asyncio.Task[None]] = set()  # reloads' removals and client closes, until done
        self._leaving: set[str] = set()  # backends a reload removed, draining until their requests end
        for settings in backends:
            if settings.dns is None:
                self._add(settings)

    def _add(self, settings: BackendSettings) -> Backend:
        assert settings.url is not None
        adapter = create_adapter(settings.engine)
        backend = Backend(
            settings.name,
            settings.engine,
            settings.url,
            models=settings.models,
            max_concurrency=settings.max_concurrency,
            stale_after=self._scrape.stale_after,
            breaker=self._breaker,
            spec=adapter.spec,
            cache_ram_mib=settings.cache_ram_mib,
            priority_order=settings.priority_order(),
            clock=self._clock,
        )
        backend.request_headers = {"Content-Type": "application/json", **settings.basic_auth_header(),
                                   **adapter.spec.auth_headers(settings.resolved_api_key())}
        backend.secrets = Redactor(settings.name, settings.url, settings.secrets())
        self.backends.append(backend)
        self.adapters[settings.name] = adapter
        self._by_name[settings.name] = backend
        self._settings[settings.name] = settings
        return backend

    async def _remove(self, name: str, why: str = "no longer in DNS", keep: Backend | None = None) -> None:
        """Drop a backend: its scrape loop and client end; a request still on it finishes (``keep``: the entry
        is being replaced, so it is not marked down)."""
        # Everything kept under its name is taken before the first await: a backend added again under the name
        # meanwhile (a reload, the admin API) must not lose its settings, client or scrape loop to this
        # removal (it did: every later configuration change failed on its missing settings; sweep 16).
        backend = self._by_name.pop(name)
        self.backends.remove(backend)
        if keep is None:
            backend.mark_down(f"removed: {why}")  # anything still holding it routes elsewhere
        task = self._tasks.pop(name, None)
        client = self._clients.pop(name, None)
        self._settings.pop(name, None)
        self._probed_at.pop(name, None)
        self._complained.pop(name, None)
        self._kv_unknown.pop(name, None)
        self._overlisted.discard(name)
        await cancel_and_wait([task])
        if client is not None:
            await client.aclose()
        log.info("backend %s removed (%s)", name, why)

    async def reconcile(self, backends: list[BackendSettings], drain_seconds: float) -> dict[str, list[str]]:
        """Take a reloaded ``backends`` list (entries by URL; DNS entries are the caller's to refuse): new names
        are added and probed before they are routed to, removed ones are drained (no new requests) and
        dropped once their requests have ended or after ``drain_seconds``, changed ones are updated in place
        (or replaced when their URL or engine changed: the old entry's requests finish on it). Returns the names
        ``added``, ``removed`` and ``changed``."""
        wanted = {b.name: b for b in backends if b.dns is None}
        current = {name: s for name, s in self._settings.items() if s.dns is None and name in self._by_name}
        grouped = {n for members in self._group_members.values() for n in members}
        for name in self._leaving & set(wanted):  # removed by an earlier reload, still draining: back it comes
            self._leaving.discard(name)
            self._by_name[name].drained = False
            log.info("backend %s kept: a reload brought it back while it drained", name)
        added = [n for n in wanted if n not in current and n not in grouped]
        removed = [n for n in current if n not in wanted and n not in grouped and n not in self._leaving]
        changed = [n for n in wanted if n in current and wanted[n] != current[n]]
        for name in removed:
            self._by_name[name].drained = True
            self._leaving.add(name)
        fresh = list(added)
        for name in changed:
            new, old = wanted[name], current[name]
            if (new.url, new.engine) == (old.url, old.engine):
                self._update(self._by_name[name], new)  # in place: its in-flight count, health and breaker stay
                continue
            # another server under the name: out with the old entry (its requests finish on it), in with the new
            self._by_name[name].drained = True
            await self._remove(name, why="replaced by a reload", keep=self._by_name[name])
            self._bring_in(self._add(new))
            fresh.append(name)
        for name in added:
            self._bring_in(self._add(wanted[name]))
            log.info("backend %s added by a reload", name)
        await asyncio.gather(*(self.scrape_once(self._by_name[n]) for n in fresh))
        for name in removed:
            self._spawn_removal(name, drain_seconds)
        return {"added": added, "removed": removed, "changed": changed}

    def _update(self, backend: Backend, settings: BackendSettings) -> None:
        assert settings.url is not None
        spec = self.adapters[backend.name].spec
        backend.configured_models = frozenset(settings.models) if settings.models else None
        if backend.configured_models is not None:
            backend.models = backend.configured_models
        backend.max_concurrency = settings.max_concurrency
        backend.cache_ram_mib = settings.cache_ram_mib
        backend.priority_order = settings.priority_order()
        backend.request_headers = {"Content-Type": "application/json", **settings.basic_auth_header(),
                                   **spec.auth_headers(settings.resolved_api_key())}
        backend.secrets = Redactor(settings.name, settings.url, settings.secrets())
        before = self._settings[backend.name]
        self._settings[backend.name] = settings
        if (before.api_key, before.basic_auth) != (settings.api_key, settings.basic_auth):
            stale = self._clients.pop(backend.name, None)  # the scrape client carries the credentials
            if stale is not None:
                self._open(backend)
                task = asyncio.get_running_loop().create_task(stale.aclose())
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        log.info("backend %s updated by a reload", backend.name)

    def _bring_in(self, backend: Backend) -> None:
        if self._running:
            self._open(backend)
            if self._leader is None:
                self._start_loop(backend)

    def _spawn_removal(self, name: str, drain_seconds: float) -> None:
        async def remove() -> None:
            backend = self._by_name.get(name)
            for _ in range(max(1, int(drain_seconds / 0.05))):  # until its requests end, drain_seconds at most
                if backend is None or not backend.in_flight:
                    break
                await self._clock.sleep(0.05)
            if name in self._leaving and self._by_name.get(name) is backend:
                self._leaving.discard(name)
                await self._remove(name, why="no longer configured")

        task = asyncio.get_running_loop().create_task(remove(), name=f"remove:{name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self.backends))

    def get(self, name: str) -> Backend:
        return self._by_name[name]

    def find(self, name: str) -> Backend | None:
        return self._by_name.get(name)

    def leaving(self, name: str) -> bool:
        """Removed by a reload, draining until its last request ends (then gone from the pool)."""
        return name in self._leaving

    def discovered(self, name: str) -> bool:
        """A replica found by a DNS entry (which only a restart changes)."""
        return any(name in members for members in self._group_members.values())

    def settings_of(self, backend: Backend) -> BackendSettings:
        """The configuration the backend was built from (a DNS replica's: its group's, with its address)."""
        return self._settings[backend.name]

    def models(self) -> list[str]:
        """Models served by at least one routable backend."""
        return sorted({m for b in self.backends if b.routable for m in b.models})

    def known_models(self) -> frozenset[str]:
        """Models any backend has served (routable or not)."""
        return frozenset(m for b in self.backends for m in b.models)

    async def start(self) -> None:
        self._running = True
        if self._groups:
            await self.discover()
        for backend in self.backends:
            self._open(backend)
        if self.backends:
            await asyncio.gather(*(self.scrape_once(b) for b in self.backends))
        if self._leader is not None:
            self._tasks["(leader)"] = asyncio.create_task(self._follow_loop(), name="follow-leader")
        else:
            for backend in self.backends:
                self._start_loop(backend)
        if self._groups:
            self._discovery_task = asyncio.create_task(self._discovery_loop(), name="dns-discovery")

    def _open(self, backend: Backend) -> None:
        if backend.name not in self._clients:
            settings = self._settings[backend.name]
            self._clients[backend.name] = self._factory(settings, self.adapters[backend.name])

    def _start_loop(self, backend: Backend) -> None:
        self._tasks[backend.name] = asyncio.create_task(self._loop(backend), name=f"scrape:{backend.name}")

    async def stop(self) -> None:
        self._running = False
        tasks = [*self._tasks.values(), *([self._discovery_task] if self._discovery_task else []), *self._background]
        await cancel_and_wait(tasks)
        self._tasks = {}
        self._discovery_task = None
        for client in self._clients.values():
            await client.aclose()
        self._clients = {}

    async def discover(self) -> None:
        """Resolve every DNS entry once; add new replicas (probed at once) and remove vanished ones. A failed
        lookup keeps the current replicas (DNS hiccups must not empty the pool)."""
        for group in self._groups:
            assert group.dns is not None and group.port is not None
            try:
                addresses = await self._resolver(group.dns, group.port)
            except OSError as exc:
                log.warning("resolving %s for backend %s failed: %s", group.dns, group.name, exc)
                continue
            if len(addresses) > MAX_DNS_REPLICAS:
                # (a selector's slip or a stale wildcard record: 2,000 dead addresses, each scraped every second,
                # took 58% of a core and got the one live replica marked down, sweep 24)
                log.warning("%s resolves to %d addresses for backend %s; taking the first %d (sorted)", group.dns,
                            len(addresses), group.name, MAX_DNS_REPLICAS)
                addresses = sorted(addresses)[:MAX_DNS_REPLICAS]
            wanted = {replica_settings(group, a).name: replica_settings(group, a) for a in addresses}
            members = self._group_members[group.name]
            for name in sorted(members - set(wanted)):
                members.discard(name)
                await self._remove(name)
            for name in sorted(set(wanted) - members):
                members.add(name)
                backend = self._add(wanted[name])
                log.info("backend %s added from DNS %s", name, group.dns)
                if self._running and self._tasks:  # after start: bring it in like the others
                    self._open(backend)
                    await self.scrape_once(backend)
                    if self._leader is None:
                        self._start_loop(backend)

    async def _discovery_loop(self) -> None:
        while True:
            await self._clock.sleep(self._discovery.interval)
            await self.discover()

    async def _loop(self, backend: Backend) -> None:
        while True:
            await self._clock.sleep(self._scrape.interval)
            await self.scrape_once(backend)  # (never raises: a loop that died would freeze its backend's health)

    async def _follow_loop(self) -> None:
        """A follower's loop: every scrape interval, the leader's readings; while the leader has none to give
        (restarting, or its readings are stale), this worker scrapes for itself."""
        assert self._leader is not None
        while True:
            await self._clock.sleep(self._scrape.interval)
            answer = await self._leader()
            if answer is not None and self.apply_snapshot(answer):
                if self._following is False:
                    log.debug("following the first worker's backend readings")
                self._following = True
                continue
            if self._following:
                log.warning("the first worker has no fresh backend readings: this worker scrapes for itself")
            self._following = False
            await asyncio.gather(*(self.scrape_once(b) for b in list(self.backends)))

    def snapshot(self) -> dict[str, Any]:
        """What this pool last read of every backend, for the other workers of the pod (JSON-ready; each
        backend's ``probed_at`` and load ``read_at`` are its clock's monotonic time: ``time.monotonic()``, which
        every process of one machine shares)."""
        backends: dict[str, Any] = {}
        for b in self.backends:
            load = b.load
            backends[b.name] = {
                "health": b.health.value, "detail": b.detail, "models": sorted(b.models),
                "capacity": [b.capacity.slots, b.capacity.context_length, b.capacity.cache_tokens,
                             b.capacity.page_tokens, b.capacity.tool_calls],
                "load": None if load is None else [load.running, load.waiting, load.kv_usage, load.read_at,
                                                   load.queue_histogram],
                "probed_at": self._probed_at.get(b.name), "scrape_errors": b.scrape_errors, "loop": b.loop_step,
                "alone": b.step_alone,
                "kv_source": None if b.kv_source is None else [b.kv_source.endpoint, b.kv_source.replay_endpoint,
                                                               b.kv_source.topic, b.kv_source.block_size],
            }
        return {"backends": backends}

    def apply_snapshot(self, raw: bytes) -> bool:
        """Take another worker's readings (see :meth:`snapshot`) for the backends this pool knows; False when
        they are unusable: malformed, or not one of them fresher than ``stale_after``."""
        try:
            snap = orjson.loads(raw)
            entries = snap["backends"]
            now = self._clock.monotonic()
            fresh = 0
            for name, entry in entries.items():
                backend = self._by_name.get(name)
                probed_at = entry["probed_at"]
                if backend is None or probed_at is None or now - probed_at > self._scrape.stale_after:
                    continue
                fresh += 1
                if probed_at <= self._probed_at.get(name, 0.0) or probed_at < backend.marked_down_at:
                    continue  # nothing newer, or this worker saw it fail after that reading
                self._probed_at[name] = probed_at
                if backend.configured_models is None:
                    backend.models = frozenset(entry["models"])
                backend.capacity = Capacity(*entry["capacity"])
                backend.scrape_errors = entry["scrape_errors"]
                step = entry.get("loop")
                if step is not None and (backend.loop_step is None or backend.loop_step[2] != step[2]):
                    tasks = step[4] if len(step) > 4 else None
                    backend.loop_step = (float(step[0]), None if step[1] is None else int(step[1]), float(step[2]),
                                         bool(step[3]), None if tasks is None else tuple(int(t) for t in tasks))
                    if self.on_loop is not None:
                        # (the engine runs every worker's requests; this worker knows its own in flight alone,
                        # as of now, not of the reading)
                        self.on_loop(LoopReading(name, backend.loop_step[0], backend.loop_step[1],
                                                 backend.in_flight, backend.loop_step[3],
                                                 _task_set(backend.loop_step[4])))
                alone = entry.get("alone")
                if isinstance(alone, int | float) and alone > 0 and alone != backend.step_alone:
                    backend.step_alone = float(alone)
                    if self.on_alone is not None:
                        self.on_alone(name, backend.step_alone)
                kv = entry.get("kv_source")
                self._set_kv_source(backend, None if kv is None else KvEventSource(*kv))
                load = entry["load"]
                if load is None:
                    backend.record_load(None)
                elif backend.load is None or backend.load.read_at != load[3]:
                    histogram = load[4]
                    if histogram is not None:
                        histogram = (tuple((le, count) for le, count in histogram[0]), histogram[1], histogram[2])
                    backend.record_load(LoadRecord(load[0], load[1], load[2], load[3], histogram))
                self._transition(backend, Probe(Health(entry["health"]), entry["detail"]), quiet=True)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
            log.warning("the first worker's backend readings are unusable: %s", exc)
            return False
        return fresh > 0 or not self.backends

    async def scrape_once(self, backend: Backend) -> None:
        """Probe one backend; when ready, refresh its models (on recovery and every few cycles), its capacity
        (on recovery) and its load. Never raises, whatever the backend answers: every failure becomes state
        (a reading that failed is counted in ``scrape_errors`` and logged at most once a minute per backend)."""
        try:
            await self._read(backend)
        except Exception as exc:  # (a fault no adapter foresaw: the next cycle tries again)
            backend.scrape_errors += 1
            self._complain(backend, f"reading it failed: {type(exc).__name__}: {exc}")

    async def still_answers(self, backend: Backend) -> bool:
        """Whether ``backend`` answers its health check now (within the scrape's timeout): asked when a request's
        connection to it broke, before the request is sent to another."""
        try:
            probe = await asyncio.wait_for(self.adapters[backend.name].probe(self._clients[backend.name]),
                                           self._scrape.timeout)
        except Exception:  # (down, slow or garbage: no answer)
            return False
        return probe.health is not Health.DOWN

    def _complain(self, backend: Backend, what: str) -> None:
        """Log a failed reading: a warning at most every COMPLAINT_SECONDS per backend, else at debug level.
        The backend's address and credentials are scrubbed from the whole message."""
        now = self._clock.monotonic()
        last = self._complained.get(backend.name)
        quiet = last is not None and now - last < COMPLAINT_SECONDS
        if not quiet:
            self._complained[backend.name] = now
        log.log(logging.DEBUG if quiet else logging.WARNING, "backend %s: %s%s", backend.name,
                backend.secrets.scrub(what), "" if quiet else " (such failures of this backend are logged at most "
                                                              "once a minute)")

    async def _read(self, backend: Backend) -> None:
        adapter = self.adapters[backend.name]
        client = self._clients[backend.name]
        cycle = self._cycles.get(backend.name, 0)
        self._cycles[backend.name] = cycle + 1
        marks, answered = backend.marked_down, backend.answered
        began = self._clock.monotonic()
        try:
            probe = await asyncio.wait_for(adapter.probe(client), self._scrape.timeout)
        except BackendError as exc:
            probe = Probe(Health.DOWN, backend.secrets.scrub(str(exc)) or "health check failed")
        except TimeoutError:
            if backend.answered != answered and backend.health is Health.READY:
                # It answered the proxy while the probe waited: the time ran out in this process (an event loop
                # behind under load), not in the backend. Ejecting it would turn an overloaded gateway's lag
                # into 503s for every request.
                backend.scrape_errors += 1
                level = logging.DEBUG if backend.name in self._late else logging.WARNING  # once a streak
                self._late.add(backend.name)
                log.log(level, "backend %s: health check timed out while it answered %d requests; kept in rotation",
                        backend.name, backend.answered - answered)
                return
            probe = Probe(Health.DOWN, "health check timed out")
        except Exception as exc:  # an answer the adapter did not foresee: no health either
            probe = Probe(Health.DOWN, f"health check failed: {type(exc).__name__}")
            backend.scrape_errors += 1
            self._complain(backend, f"health check failed: {type(exc).__name__}: {exc}")
        probed = self._clock.monotonic() - began  # (what the network and this process's lateness take)
        self._late.discard(backend.name)
        if backend.marked_down != marks:
            return  # the proxy saw it fail while this probe was out: the probe's answer is older news
        self._probed_at[backend.name] = self._clock.monotonic()
        if probe.health is not Health.READY:
            self._transition(backend, probe)
            backend.record_load(None)
            return
        recovering = backend.health is not Health.READY
        try:
            if recovering or cycle % self._scrape.models_every == 0:
                # (each within the scrape's timeout in all: a /metrics answer trickled a byte every 0.5 s held a
                # backend's health checks 31 s, its load going stale; sweep 14)
                if backend.configured_models is None:
                    backend.models = self._listed(backend, await asyncio.wait_for(adapter.list_models(client),
                                                                                  self._scrape.timeout))
                backend.capacity = await asyncio.wait_for(adapter.read_capacity(client), self._scrape.timeout)
        except Exception as exc:  # (BackendError, or an answer the adapter did not foresee)
            backend.scrape_errors += 1
            if recovering:
                self._transition(backend, Probe(Health.DOWN, f"healthy but unusable: "
                                                             f"{backend.secrets.scrub(_why(exc))}"))
                return
            self._complain(backend, f"refreshing models/capacity failed: {_why(exc)}")
        if not backend.models:
            self._transition(backend, Probe(Health.DOWN, "serves no model"))
            return
        if self._discovers(backend) and (recovering or (backend.kv_source is None
                                                        and backend.name not in self._kv_unknown)):
            await self._read_kv_source(backend, adapter, client)
        began = self._clock.monotonic()
        try:
            load = await asyncio.wait_for(adapter.read_load(client), self._scrape.timeout)
        except Exception as exc:  # (the last reading goes stale: routing falls back to the in-flight count)
            backend.scrape_errors += 1
            self._complain(backend, f"load reading failed: {_why(exc)}")
            if isinstance(exc, TimeoutError):  # (the loop's step is longer than the reading could wait)
                self._loop_reading(backend, self._scrape.timeout - probed, None)
        else:
            step = self._clock.monotonic() - began - probed
            if load is not None:  # (read when it came, on this pool's clock)
                load = dataclasses.replace(load, read_at=self._clock.monotonic())
            backend.record_load(load)
            self._loop_reading(backend, step, -1 if load is None or load.running is None
                               else load.running + (load.waiting or 0), load is not None and load.prefilling,
                               None if load is None else load.tasks)
            if load is not None and load.running == 0 and not load.waiting:
                self._measure_alone(backend, adapter, client)
            if load is not None and load.rejected:
                backend.scrape_errors += 1
                self._complain(backend, f"its load reading had garbage for {', '.join(load.rejected)} (taken as no "
                                        f"reading)")
        self._transition(backend, probe)

    def _loop_reading(self, backend: Backend, step: float, running: int | None, prefilling: bool = False,
                      tasks: frozenset[int] | None = None) -> None:
        """Where the load reading waits for the engine's loop, how long it waited (at least what was left of the
        step under way), the sequences it said it runs (None: the reading timed out; -1: it came, unsaid), whether
        one was reading its prompt, and the engine's ids of those it runs (None: unsaid)."""
        if not backend.spec.load_waits_for_loop:
            return
        backend.loop_step = (max(0.0, step), running, self._clock.monotonic(), prefilling,
                             None if tasks is None else tuple(sorted(tasks)))
        if self.on_loop is not None:
            self.on_loop(LoopReading(backend.name, backend.loop_step[0], running, backend.in_flight, prefilling,
                                     tasks))

    def _measure_alone(self, backend: Backend, adapter: EngineAdapter, client: httpx.AsyncClient) -> None:
        """Its engine idle: measure its loop's step with one short plain request alone, if that is wanted, in the
        background (a slow engine's few tokens must not hold its scrapes)."""
        if (not backend.spec.load_waits_for_loop or self.wants_alone is None or backend.name in self._measuring
                or not self.wants_alone(backend.name)):
            return
        self._measuring.add(backend.name)

        async def measure() -> None:
            try:
                seconds = await asyncio.wait_for(adapter.measure_step(client), MEASURE_TIMEOUT)
            except Exception as exc:  # (BackendError, a timeout, or an answer the adapter did not foresee)
                log.info("backend %s: measuring its loop's step alone failed: %s", backend.name,
                         backend.secrets.scrub(_why(exc)))
                return
            finally:
                self._measuring.discard(backend.name)
            if seconds is not None:
                backend.step_alone = seconds
                if self.on_alone is not None:
                    self.on_alone(backend.name, seconds)

        task = asyncio.create_task(measure(), name=f"measure-step:{backend.name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _discovers(self, backend: Backend) -> bool:
        settings = self._settings.get(backend.name)
        return settings is not None and settings.kv_events is not None and settings.kv_events.discover

    async def _read_kv_source(self, backend: Backend, adapter: EngineAdapter, client: httpx.AsyncClient) -> None:
        """Where the engine says it publishes its KV events, read each time it comes (back) up (a restart may
        move them). One that shows none keeps the approximate index, said once per backend and reason."""
        try:
            found = await asyncio.wait_for(adapter.read_kv_events(client), self._scrape.timeout)
            said = f"{found.endpoint} {found.replay_endpoint} {found.topic}".encode()
            if backend.secrets.echoed(said) and backend.secrets.scrub_json(
                    [found.endpoint, found.replay_endpoint, found.topic]):
                # (an engine echoing what it was sent: no address to connect to or look up, nor a line to log)
                raise BackendError("the KV-event source it names carries the gateway's credential for it")
        except Exception as exc:  # (BackendError: it shows none; or an answer the adapter did not foresee)
            why = "timed out" if isinstance(exc, TimeoutError) else backend.secrets.scrub(_why(exc))
            if self._kv_unknown.get(backend.name) != why:
                self._kv_unknown[backend.name] = why
                log.warning("backend %s: kv_events: discover, but no KV-event source was found (%s); it is routed "
                            "by the approximate prefix index", backend.name, why)
            self._set_kv_source(backend, None)
            return
        if self._kv_unknown.pop(backend.name, None) is not None or backend.kv_source != found:
            # (the operator's log: addresses as they are, user and password out; the client-side redactor would
            # put the backend's name in place of its host, and the log would name no address)
            log.info("backend %s publishes its KV events at %s (replay %s, topic %r)", backend.name,
                     redact_url(found.endpoint), found.replay_endpoint and redact_url(found.replay_endpoint),
                     found.topic)
        self._set_kv_source(backend, found)

    def _set_kv_source(self, backend: Backend, source: KvEventSource | None) -> None:
        if source != backend.kv_source:
            backend.kv_source = source
            if self._on_kv_source is not None:
                self._on_kv_source()

    def _listed(self, backend: Backend, models: list[str]) -> frozenset[str]:
        """The models a backend listed, at most MAX_MODELS of them (the excess logged once), less any whose name
        holds the backend's own credentials (an engine echoing what it was sent: the name would reach clients,
        metrics labels and logs)."""
        secrets = backend.secrets
        echoing = [name for name in models if secrets.echoed(name.encode()) and secrets.scrub(name) != name]
        if echoing:
            models = [name for name in models if name not in echoing]
            log.warning("backend %s lists %d model(s) whose name holds its own credentials: not served",
                        backend.name, len(echoing))
        if len(models) <= MAX_MODELS:
            return frozenset(models)
        if backend.name not in self._overlisted:
            self._overlisted.add(backend.name)
            log.warning("backend %s lists more than %d models: only the first %d are served through it (set its "
                        "models in the configuration to choose them)", backend.name, MAX_MODELS, MAX_MODELS)
        return frozenset(models[:MAX_MODELS])

    @staticmethod
    def _transition(backend: Backend, probe: Probe, *, quiet: bool = False) -> None:
        before = backend.health
        backend.record_probe(probe)
        if before is not probe.health:
            # a follower's transitions are the leader's, which logged them already
            level = logging.DEBUG if quiet else logging.INFO if probe.health is Health.READY else logging.WARNING
            log.log(level, "backend %s (%s) is %s%s", backend.name, backend.engine, probe.health.value,
                    f": {probe.detail}" if probe.detail else "")


def _why(exc: Exception) -> str:
    """A failed reading's message: the adapter's own for a BackendError, else the exception's kind too."""
    return str(exc) if isinstance(exc, BackendError) else f"{type(exc).__name__}: {exc}"


def _task_set(tasks: tuple[int, ...] | None) -> frozenset[int] | None:
    return None if tasks is None else frozenset(tasks)
