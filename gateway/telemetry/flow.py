"""Flow control's metrics: admissions and refusals by band (and key), the wait for admission, queue depth by
band and each model's saturation, the signal autoscalers scale on.

Label values stay bounded: ``model`` is a model some backend serves (a request for an unknown model never
reaches admission), ``band`` one of ``admission.bands``, ``key`` a configured key's name or ``_anonymous``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.telemetry.request_metrics import Buckets

if TYPE_CHECKING:
    from gateway.config import AdmissionSettings
    from gateway.pool.pool import Pool
    from gateway.proxy.admission import Admission

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FlowMetrics(Collector):
    def __init__(self) -> None:
        self.admission: Admission | None = None
        self.pool: Pool | None = None
        self._admitted: dict[tuple[str, str, str], int] = {}
        self._refused: dict[tuple[str, str, str, str], int] = {}
        self._wait: dict[tuple[str, str], Buckets] = {}

    def admitted(self, model: str, band: str, key: str, waited: float) -> None:
        labels = (model, band, key)
        self._admitted[labels] = self._admitted.get(labels, 0) + 1
        buckets = self._wait.get((model, band))
        if buckets is None:
            buckets = self._wait[(model, band)] = Buckets(WAIT_BUCKETS)
        buckets.observe(waited)

    def refused(self, model: str, band: str, key: str, reason: str) -> None:
        """A request admission refused (429), for ``reason``."""
        labels = (model, band, key, reason)
        self._refused[labels] = self._refused.get(labels, 0) + 1

    def collect(self) -> Iterator[Metric]:
        admitted = CounterMetricFamily(
            "gateway_admissions", "Requests admitted to a backend, by model, priority band and API key.",
            labels=["model", "band", "key"])
        for labels, count in self._admitted.items():
            admitted.add_metric(list(labels), float(count))
        refused = CounterMetricFamily(
            "gateway_admission_refusals",
            "Requests refused by admission with 429, by reason: deadline (predicted wait past the request's "
            "deadline: shed at once), timeout (waited its whole deadline), queue_full, displaced (a higher "
            "priority took its place in a full queue).", labels=["model", "band", "key", "reason"])
        for refusal, count in self._refused.items():
            refused.add_metric(list(refusal), float(count))
        wait = HistogramMetricFamily(
            "gateway_admission_wait_seconds", "Arrival to admission (0 for a request that found a free slot), by "
                                              "model and priority band.", labels=["model", "band"])
        for (model, band), buckets in self._wait.items():
            wait.add_metric([model, band], buckets.cumulative(), buckets.sum)
        yield from (admitted, refused, wait)
        admission, pool = self.admission, self.pool
        if admission is None:
            return
        settings: AdmissionSettings = admission.settings
        depth = GaugeMetricFamily("gateway_queue_depth", "Requests waiting in the gateway's queue, by model and "
                                                         "priority band.", labels=["model", "band"])
        by_band: dict[tuple[str, str], int] = {}
        for (model, priority), count in admission.depth().items():
            place = (model, settings.band_of(priority))
            by_band[place] = by_band.get(place, 0) + count
        for model in admission.models():  # (every band of a model that queued, from zero)
            for band in settings.bands:
                depth.add_metric([model, band], float(by_band.get((model, band), 0)))
        yield depth
        if pool is None:
            return
        saturation = GaugeMetricFamily(
            "gateway_model_saturation",
            "Requests in flight through this gateway plus those queued, over the slots of the model's ready "
            "backends (1: full; above 1: a queue). Summed over workers and replicas it is the fleet's, when "
            "every backend has a max_concurrency or reports its slots.", labels=["model"])
        capacity = GaugeMetricFamily("gateway_model_slots", "Slots of the model's ready backends.",
                                     labels=["model"])
        for model in sorted(pool.models()):
            slots = [b.slots for b in pool if model in b.models and b.routable]
            if not slots or any(s is None for s in slots):
                continue
            total = float(sum(s for s in slots if s is not None))
            if total <= 0:
                continue
            capacity.add_metric([model], total)
            saturation.add_metric([model], (admission.active(model) + admission.queued(model)) / total)
        yield from (saturation, capacity)
