"""Every gateway metric, in one place: ``gateway_`` prefix, base units, bounded labels. The series every
request updates are kept apart, as plain numbers exported at scrape time (:mod:`gateway.telemetry.request_metrics`).

Labels are only ever backend and engine names from the configuration, models some backend serves, route
names, stages and outcome words: never a request id, a user or a prompt. Backend state (health, load,
in-flight) is read from the pool when Prometheus scrapes, so it costs nothing per request.

Queue wait (``gateway_queue_wait_seconds{backend,stage}``) has two stages:
* ``gateway``: from the request's arrival to its dispatch to the backend (validation, routing and, once
  admission control exists, waiting for a slot), measured by the gateway;
* ``engine``: time in the engine's own queue. vLLM and SGLang measure it themselves: the gateway re-exports
  their ``vllm:request_queue_time_seconds`` / ``sglang:queue_time_seconds`` histograms as last scraped (the
  engine's buckets, cumulative since the engine started). llama.cpp and TabbyAPI do not: per request the
  gateway takes its time to first token and subtracts the engine's own prompt time (llama.cpp
  ``timings.prompt_ms``, TabbyAPI ``usage.prompt_time``) and the gateway stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.pool.state import Health
from gateway.telemetry.flow import FlowMetrics
from gateway.telemetry.loop_lag import LoopLag
from gateway.telemetry.request_metrics import (  # noqa: F401  (the buckets, for those who read them here)
    DURATION_BUCKETS,
    ITL_BUCKETS,
    PLUGIN_BUCKETS,
    TOKENS_PER_SECOND_BUCKETS,
    TTFT_BUCKETS,
    Buckets,
    RequestMetrics,
)

if TYPE_CHECKING:
    from gateway.kvcache.subscriber import EventHub
    from gateway.pool.pool import Pool
    from gateway.state.shared import SharedState

QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

UNKNOWN = "_unknown"  # label value for a model or backend the request never reached


# why the server refused or cut a client connection (gateway.server_protocol)
REFUSAL_CODES = ("request_headers_too_large", "header_timeout", "idle_timeout", "body_timeout",
                 "too_many_connections", "invalid_http_request")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # ``*_created`` series double the exposition for no use on dashboards (process-wide switch)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # what every request updates: plain numbers, exported at scrape time (see request_metrics)
        self.live = RequestMetrics()
        r.register(self.live)
        self.retries = Counter(
            "gateway_retries", "Requests sent again to another backend, by the backend that failed and why.",
            ["backend", "reason"], registry=r)
        self.invalid_outputs = Counter(
            "gateway_structured_output_invalid",
            "Non-streamed answers that failed their structured-output check, by what was done (retried, marked).",
            ["backend", "engine", "action"], registry=r)
        self.unchecked_outputs = Counter(
            "gateway_structured_output_unchecked",
            "Non-streamed answers passed to the client without their structured-output check (validate_outputs): "
            "too large or costly to check, no validation worker free, or past limits.validation_timeout.",
            ["backend", "engine"], registry=r)
        self.connections_refused = Counter(
            "gateway_connections_refused",
            "Client connections refused or cut by the server's limits, by code (request_headers_too_large, "
            "header_timeout, idle_timeout, body_timeout, too_many_connections, invalid_http_request).",
            ["code"], registry=r)
        for code in REFUSAL_CODES:  # a bounded set, exported from zero so rates and alerts have a series
            self.connections_refused.labels(code)
        self.queue_wait = QueueWaitCollector()
        r.register(self.queue_wait)
        self.flow = FlowMetrics()  # admissions, refusals, queue depth and saturation (flow control)
        r.register(self.flow)
        self.loop_lag = LoopLag()  # (measures once started, with the app)
        r.register(self.loop_lag)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: label values are bounded, and ``labels()`` takes a lock and
        builds a tuple each call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch_pool(self, pool: Pool) -> None:
        self.queue_wait.pool = pool
        self.flow.pool = pool
        self.registry.register(PoolCollector(pool))

    def watch_kv_events(self, hub: EventHub) -> None:
        self.registry.register(KvEventsCollector(hub))

    def watch_state(self, shared: SharedState) -> None:
        self.registry.register(StateCollector(shared))


class QueueWaitCollector(Collector):
    """``gateway_queue_wait_seconds{backend,stage}``: the gateway's measurements, and the engines' own
    queue histograms where the engine keeps one (see the module docstring)."""

    def __init__(self) -> None:
        self.pool: Pool | None = None
        self._own: dict[tuple[str, str], Buckets] = {}

    def observe(self, backend: str, stage: str, seconds: float) -> None:
        buckets = self._own.get((backend, stage))
        if buckets is None:
            buckets = self._own[(backend, stage)] = Buckets(QUEUE_BUCKETS)
        buckets.observe(max(0.0, seconds))

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "gateway_queue_wait_seconds",
            "Time waiting before processing: stage=gateway (arrival to dispatch), stage=engine (in the engine's "
            "queue; vLLM/SGLang's own histogram, else TTFT minus the engine's prompt time).",
            labels=["backend", "stage"])
        mirrored = set()
        for backend in self.pool or ():
            load = backend.load
            if load is not None and load.queue_histogram is not None:
                buckets, total, _count = load.queue_histogram
                family.add_metric([backend.name, "engine"], list(buckets), total)
                mirrored.add(backend.name)
        for (name, stage), own in self._own.items():
            if stage == "engine" and name in mirrored:
                continue
            family.add_metric([name, stage], own.cumulative(), own.sum)
        yield family


class PoolCollector(Collector):
    """Backend and model state as gauges, read at scrape time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        import time

        labels = ["backend", "engine"]
        up = GaugeMetricFamily("gateway_backend_up", "1 when the backend answers (ready or loading).", labels=labels)
        ready = GaugeMetricFamily(
            "gateway_backend_ready",
            "1 when the backend can take requests: ready by its health check, not ejected by its circuit breaker, "
            "not drained.",
            labels=labels)
        model_ready = GaugeMetricFamily(
            "gateway_model_ready", "1 when at least one backend serving the model can take requests.",
            labels=["model"])
        drained = GaugeMetricFamily(
            "gateway_backend_drained", "1 while an operator has the backend drained (the admin API).", labels=labels)
        in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight_requests", "Requests this gateway has in flight to the backend.", labels=labels)
        running = GaugeMetricFamily(
            "gateway_backend_running_requests", "Sequences running on the engine, as last read.", labels=labels)
        waiting = GaugeMetricFamily(
            "gateway_backend_waiting_requests", "Requests queued in the engine, as last read.", labels=labels)
        kv = GaugeMetricFamily("gateway_backend_kv_cache_usage_ratio", "KV cache in use, 0..1, as last read.",
                               labels=labels)
        slots = GaugeMetricFamily("gateway_backend_slots", "Concurrent sequences the backend runs.", labels=labels)
        age = GaugeMetricFamily("gateway_backend_load_age_seconds",
                                "Seconds since the backend's load was last read successfully.", labels=labels)
        errors = CounterMetricFamily(
            "gateway_backend_scrape_errors", "Failed reads of a backend's load, models or capacity.", labels=labels)
        now = time.monotonic()
        for backend in self._pool:
            key = [backend.name, backend.engine]
            up.add_metric(key, 1.0 if backend.health in (Health.READY, Health.LOADING) else 0.0)
            ready.add_metric(key, 1.0 if backend.routable else 0.0)
            drained.add_metric(key, 1.0 if backend.drained else 0.0)
            in_flight.add_metric(key, float(backend.in_flight))
            errors.add_metric(key, float(backend.scrape_errors))
            if backend.slots:
                slots.add_metric(key, float(backend.slots))
            load = backend.load
            if load is not None:
                age.add_metric(key, now - load.read_at)
            load = backend.fresh_load(now)
            if load is None:
                continue
            if load.running is not None:
                running.add_metric(key, float(load.running))
            if load.waiting is not None:
                waiting.add_metric(key, float(load.waiting))
            if load.kv_usage is not None:
                kv.add_metric(key, load.kv_usage)
        servable = set(self._pool.models())
        for model in sorted(self._pool.known_models()):
            model_ready.add_metric([model], 1.0 if model in servable else 0.0)
        yield from (up, ready, drained, model_ready, in_flight, running, waiting, kv, slots, age, errors)


class KvEventsCollector(Collector):
    """The engines' KV-event streams (backends with ``kv_events``), read at scrape time."""

    def __init__(self, hub: EventHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Metric]:
        b = ["backend"]
        batches = CounterMetricFamily("gateway_kv_event_batches", "KV-event batches applied to the index.", labels=b)
        events = CounterMetricFamily("gateway_kv_events", "KV events received (applied batches).", labels=b)
        gaps = CounterMetricFamily("gateway_kv_event_gaps",
                                   "Holes in the engine's sequence numbers (events missed live).", labels=b)
        replays = CounterMetricFamily(
            "gateway_kv_event_replays", "Replays asked of the engine, by result: complete, partial (its buffer no "
                                        "longer reached back), failed (no answer).", labels=["backend", "result"])
        resets = CounterMetricFamily(
            "gateway_kv_event_index_resets", "Index cleared: restart (sequence numbers began again), epoch (the "
                                             "backend came back up), history_lost (a hole no replay could fill).",
            labels=["backend", "reason"])
        errors = CounterMetricFamily("gateway_kv_event_decode_errors", "Messages that were not KV event batches.",
                                     labels=b)
        dropped = CounterMetricFamily(
            "gateway_kv_event_dropped", "Messages dropped unread: what waited to be applied was at its byte bound "
                                        "(the hole they leave is filled by a replay, or the stream goes partial).",
            labels=b)
        orphans = CounterMetricFamily(
            "gateway_kv_event_orphan_blocks", "Stored-block events dropped: their parent block was never announced.",
            labels=b)
        blocks = GaugeMetricFamily("gateway_kv_event_index_blocks", "Engine blocks the event index holds.", labels=b)
        live = GaugeMetricFamily(
            "gateway_kv_events_live", "1 while the backend's event stream is complete and current (routing uses it); "
                                      "0 while it falls back to the approximate index.", labels=b)
        for name, stream in sorted(self._hub.streams.items()):
            c = stream.counters
            batches.add_metric([name], float(c.batches))
            events.add_metric([name], float(c.events))
            gaps.add_metric([name], float(c.gaps))
            errors.add_metric([name], float(c.decode_errors))
            dropped.add_metric([name], float(c.dropped))
            orphans.add_metric([name], float(stream.index.orphans))
            for result, count in c.replays.items():
                replays.add_metric([name, result], float(count))
            for reason, count in c.resets.items():
                resets.add_metric([name, reason], float(count))
            blocks.add_metric([name], float(len(stream.index)))
            live.add_metric([name], 1.0 if stream.live() else 0.0)
        yield from (batches, events, gaps, replays, resets, errors, dropped, orphans, blocks, live)


class StateCollector(Collector):
    """The shared state's connection (``state.url``), read at scrape time."""

    def __init__(self, shared: SharedState) -> None:
        self._shared = shared

    def collect(self) -> Iterator[Metric]:
        shared = self._shared
        yield GaugeMetricFamily("gateway_state_up", "1 while the shared state (Redis) answers.",
                                value=1.0 if shared.up else 0.0)
        errors = CounterMetricFamily("gateway_state_errors", "Shared-state operations that failed, by operation.",
                                     labels=["operation"])
        for operation, count in sorted(shared.errors.items()):
            errors.add_metric([operation], float(count))
        yield errors
        admissions = CounterMetricFamily(
            "gateway_state_admissions", "Admissions checked against the shared state, by how: from the slots and "
            "leases this process holds (local), from what another request's round trip brought (waited), or with "
            "a round trip to Redis (redis).", labels=["path"])
        for path, count in shared.admissions.items():
            admissions.add_metric([path], float(count))
        yield admissions
        yield CounterMetricFamily(
            "gateway_state_lease_refills", "Leases of a key's requests and tokens topped up ahead of need, in the "
            "background (round trips to Redis that no request waits on).", value=float(shared.refills))
        yield CounterMetricFamily(
            "gateway_state_fail_open", "Requests of rate-limited keys passed unchecked while the shared state was "
            "down (state.on_failure: open).", value=float(shared.fail_open))
        yield CounterMetricFamily(
            "gateway_state_settlements_dropped", "Settlements (tokens used, slots freed) dropped because too many "
            "waited while the shared state was down.", value=float(shared.dropped))
        yield GaugeMetricFamily("gateway_state_settlements_pending",
                                "Settlements waiting for the shared state to answer.", value=float(shared.pending))
        rejected = CounterMetricFamily(
            "gateway_state_messages_rejected", "Messages on the replicas' channels dropped, by why: unauthenticated "
            "(not sealed with this fleet's secret: another fleet's replica, or someone else publishing to Redis), "
            "stale (stamped over a minute from this clock), replayed, malformed.", labels=["reason"])
        for reason, count in shared.rejected.items():
            rejected.add_metric([reason], float(count))
        yield rejected
        yield CounterMetricFamily(
            "gateway_state_abandoned", "Round trips to Redis (admissions, slots, lease top-ups) answered after their "
            "request gave up (timed out or left) or after a resync: what they took was given back.",
            value=float(shared.abandoned))
