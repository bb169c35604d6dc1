"""One exposition out of several workers' (``server.workers``): what Prometheus scrapes from any worker of a
gateway is the whole gateway's.

Counters, histograms and summaries add up. Gauges add up too (requests in flight, settlements pending), except
those that describe a shared fact every worker reads for itself (a backend's health and last load reading, the
shared state's reachability): those would count N times if added, so the merge takes the highest (the lowest
for ``gateway_state_up``: one worker cut off from Redis is a gateway that is partly cut off).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# gauge families that every worker reads from the same source: not added up
_HIGHEST = frozenset({
    "gateway_backend_up", "gateway_backend_ready", "gateway_backend_drained", "gateway_model_ready",
    "gateway_backend_running_requests", "gateway_backend_waiting_requests", "gateway_backend_kv_cache_usage_ratio",
    "gateway_backend_slots",
    "gateway_kv_event_index_blocks", "gateway_kv_events_live", "gateway_model_slots",
})
_LOWEST = frozenset({"gateway_state_up", "gateway_backend_load_age_seconds"})

Key = tuple[str, tuple[tuple[str, str], ...]]


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_expositions(texts: Iterable[str], *, workers: int) -> bytes:
    """The text exposition of the sum of ``texts`` (each one worker's), plus ``gateway_workers``: how many
    workers' figures it holds."""
    order: list[str] = []
    kinds: dict[str, Metric] = {}
    values: dict[str, dict[Key, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = kinds.get(family.name)
            if merged is None:
                merged = kinds[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
                order.append(family.name)
            pick = min if family.name in _LOWEST else max if family.name in _HIGHEST else None
            into = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in into:
                    into[key] = sample.value
                elif pick is not None and family.type == "gauge":
                    into[key] = pick(into[key], sample.value)
                else:
                    into[key] += sample.value
    families = []
    for name in order:
        family = kinds[name]
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
        families.append(family)
    count = Metric("gateway_workers", "Worker processes whose figures this exposition adds up.", "gauge")
    count.add_sample("gateway_workers", {}, float(workers))
    families.append(count)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families))
    return generate_latest(registry)
