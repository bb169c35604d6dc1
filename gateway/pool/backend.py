"""One backend as the gateway knows it: identity, health, last load reading, and its own in-flight count."""

from __future__ import annotations

from gateway.clock import SYSTEM, Clock
from gateway.config import BreakerSettings
from gateway.engines.spec import EngineSpec
from gateway.errors import Redactor
from gateway.pool.breaker import Breaker
from gateway.pool.state import Capacity, Health, KvEventSource, LoadRecord, Probe


class Backend:
    """Mutable state of one backend, shared by the scrape loop (writer), routing and the proxy (readers).

    Everything runs on one event loop, so plain attributes suffice.
    """

    __slots__ = (
        "_in_flight_at_read",
        "answered",
        "breaker",
        "cache_ram_mib",
        "capacity",
        "checked",
        "clock",
        "configured_models",
        "detail",
        "drained",
        "engine",
        "epoch",
        "health",
        "in_flight",
        "kv_source",
        "load",
        "loop_step",
        "marked_down",
        "marked_down_at",
        "max_concurrency",
        "models",
        "name",
        "priority_order",
        "request_headers",
        "scrape_errors",
        "secrets",
        "spec",
        "stale_after",
        "step_alone",
        "url",
    )

    def __init__(
        self,
        name: str,
        engine: str,
        url: str,
        *,
        models: list[str] | None = None,
        max_concurrency: int | None = None,
        stale_after: float = 5.0,
        breaker: BreakerSettings | None = None,
        spec: EngineSpec | None = None,
        cache_ram_mib: int | None = None,
        priority_order: str | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.name = name
        self.clock = clock
        self.engine = engine
        # the engine's facts (routes, structured output, retries, stream quirks, shape): a plain
        # OpenAI-compatible server's when not given
        self.spec = spec if spec is not None else EngineSpec(name=engine)
        self.cache_ram_mib = cache_ram_mib  # llama.cpp's --cache-ram as configured (None: its default)
        # its engine schedules by the request's "priority" field, this way ("lower-first", "higher-first"), or
        # None: the gateway's priority stays in the gateway
        self.priority_order = priority_order
        self.url = url
        self.configured_models = frozenset(models) if models else None
        # Last known models are kept while a backend is down, so its model is "unavailable" (503), not
        # "unknown" (404).
        self.models: frozenset[str] = self.configured_models or frozenset()
        self.max_concurrency = max_concurrency
        self.stale_after = stale_after
        self.health = Health.UNKNOWN
        self.detail = "not probed yet"
        self.load: LoadRecord | None = None
        self.capacity = Capacity()
        self.kv_source: KvEventSource | None = None  # where it says it publishes KV events (kv_events: discover)
        # its loop's last step as read (EngineSpec.load_waits_for_loop): seconds at least, the sequences it said it
        # runs (None: the reading timed out; -1: unsaid), clock.monotonic() when read, whether one read its prompt,
        # the ids of the sequences it runs (None: unsaid)
        self.loop_step: tuple[float, int | None, float, bool, tuple[int, ...] | None] | None = None
        self.step_alone: float | None = None  # its loop's step with one short plain request alone, as measured
        self.in_flight = 0
        self._in_flight_at_read = 0
        self.scrape_errors = 0
        # what every proxied request to it carries: content type and its own key (never the client's)
        self.request_headers: dict[str, str] = {"Content-Type": "application/json"}
        # its address and credentials, kept out of every message passed to a client
        self.secrets = Redactor(name, url)
        self.marked_down = 0  # times the proxy took it out of rotation (a probe begun before that is stale)
        self.marked_down_at = 0.0  # clock.monotonic() of the last time
        # response heads below 500 it sent the proxy: a health check that timed out while this grew measured
        # the gateway's own lateness, not the backend's
        self.answered = 0
        self.checked = 0  # health checks it passed
        self.breaker = Breaker(breaker or BreakerSettings(), clock)
        # bumped each time the backend comes (back) up: a restarted engine has empty caches
        self.epoch = 0
        # an operator drained it (the admin API): no new request goes to it; those in flight finish
        self.drained = False

    def __repr__(self) -> str:
        return f"<Backend {self.name} {self.engine} {self.health.value} in_flight={self.in_flight}>"

    @property
    def routable(self) -> bool:
        """Ready by its last health check, not ejected by its circuit breaker, not drained."""
        return self.health is Health.READY and not self.drained and self.breaker.available()

    @property
    def caches_by_slot(self) -> bool:
        """Its prefix cache is its slots' last prompts and nothing else (llama.cpp with --cache-ram 0)."""
        return self.spec.cache == "slots" and self.cache_ram_mib == 0

    @property
    def slots(self) -> int | None:
        """Concurrent sequences this backend should run: the configured limit, else what the engine says."""
        return self.max_concurrency or self.capacity.slots

    def fresh_load(self, now: float | None = None) -> LoadRecord | None:
        load = self.load
        if load is None:
            return None
        if (now if now is not None else self.clock.monotonic()) - load.read_at > self.stale_after:
            return None
        return load

    def estimated_queue(self, now: float | None = None) -> int:
        """Sequences on the engine now (running + waiting), as best known.

        The engine's reading includes the requests this gateway had in flight when it was taken; requests
        started or finished since are accounted for by the change in our own in-flight count. Without a
        fresh reading (TabbyAPI never has one) our own in-flight count is the estimate.
        """
        load = self.fresh_load(now)
        if load is None or (load.running is None and load.waiting is None):
            return self.in_flight
        engine_total = (load.running or 0) + (load.waiting or 0)
        return max(self.in_flight, engine_total + self.in_flight - self._in_flight_at_read)

    # --- written by the scrape loop ----------------------------------------------------------------------
    def record_probe(self, probe: Probe) -> None:
        if probe.health is Health.READY and self.health is not Health.READY:
            self.epoch += 1
        if probe.health is Health.READY:
            self.checked += 1
        self.health = probe.health
        self.detail = probe.detail

    def record_load(self, load: LoadRecord | None) -> None:
        self.load = load
        self._in_flight_at_read = self.in_flight

    # --- written by the proxy ------------------------------------------------------------------------------
    def mark_down(self, reason: str) -> None:
        """Take the backend out of rotation at once after a failed connection; the scrape loop restores it."""
        self.health = Health.DOWN
        self.detail = reason
        self.load = None
        self.marked_down += 1
        self.marked_down_at = self.clock.monotonic()
