"""Every gateway metric, in one place: ``gateway_`` prefix, base units, bounded labels.

Labels are only ever backend and engine names from the configuration, models some backend serves, route
names and outcome words: never a request id, a user or a prompt. Backend state (health, load, in-flight) is
read from the pool when Prometheus scrapes, so it costs nothing per request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.pool.state import Health

if TYPE_CHECKING:
    from gateway.pool.pool import Pool

# LLM latencies: time to first token from 10 ms to 60 s, whole requests up to 15 minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0)

PLUGIN_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)

UNKNOWN = "_unknown"  # label value for a model or backend the request never reached


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # ``*_created`` series double the exposition for no use on dashboards (process-wide switch)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by route, model, backend, HTTP status class and outcome.",
            ["route", "model", "backend", "status_class", "outcome"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "gateway_time_to_first_token_seconds",
            "From the gateway receiving a streamed request to sending the client its first event.",
            ["backend", "model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "From the gateway receiving a request to its last byte sent.",
            ["route", "backend", "model"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens, from upstream usage.", ["backend", "model"], registry=r
        )
        self.completion_tokens = Counter(
            "gateway_completion_tokens", "Completion tokens, from upstream usage.", ["backend", "model"], registry=r
        )
        self.cached_tokens = Counter(
            "gateway_cached_tokens",
            "Prompt tokens the engine reported as served from its prefix cache.",
            ["backend", "model"],
            registry=r,
        )

        self.routing_decisions = Counter(
            "gateway_routing_decisions",
            "Routing decisions, by chosen backend and the plugin that made the difference.",
            ["backend", "reason"],
            registry=r,
        )
        self.routing_plugin_seconds = Histogram(
            "gateway_routing_plugin_seconds",
            "Time each routing plugin took per request.",
            ["plugin"],
            buckets=PLUGIN_BUCKETS,
            registry=r,
        )

        self.invalid_outputs = Counter(
            "gateway_structured_output_invalid",
            "Non-streamed answers that failed their structured-output check, by what was done (retried, marked).",
            ["backend", "engine", "action"],
            registry=r,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: label values are bounded, and ``labels()`` takes a lock and
        builds a tuple each call, which showed in hot-path profiles."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch_pool(self, pool: Pool) -> None:
        self.registry.register(PoolCollector(pool))


class PoolCollector(Collector):
    """Backend state as gauges, read at scrape time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        labels = ["backend", "engine"]
        up = GaugeMetricFamily("gateway_backend_up", "1 when the backend's last health check passed.", labels=labels)
        in_flight = GaugeMetricFamily(
            "gateway_backend_in_flight_requests", "Requests this gateway has in flight to the backend.", labels=labels
        )
        running = GaugeMetricFamily(
            "gateway_backend_running_requests", "Sequences running on the engine, as last read.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "gateway_backend_waiting_requests", "Requests queued in the engine, as last read.", labels=labels
        )
        kv = GaugeMetricFamily("gateway_backend_kv_cache_usage_ratio", "KV cache in use, 0..1, as last read.",
                               labels=labels)
        errors = CounterMetricFamily(
            "gateway_backend_scrape_errors", "Failed reads of a backend's load, models or capacity.", labels=labels
        )
        for backend in self._pool:
            key = [backend.name, backend.engine]
            up.add_metric(key, 1.0 if backend.health is Health.READY else 0.0)
            in_flight.add_metric(key, float(backend.in_flight))
            errors.add_metric(key, float(backend.scrape_errors))
            load = backend.fresh_load()
            if load is None:
                continue
            if load.running is not None:
                running.add_metric(key, float(load.running))
            if load.waiting is not None:
                waiting.add_metric(key, float(load.waiting))
            if load.kv_usage is not None:
                kv.add_metric(key, load.kv_usage)
        yield from (up, in_flight, running, waiting, kv, errors)
