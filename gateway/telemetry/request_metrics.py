"""The series every request updates, kept as plain numbers and exported when Prometheus scrapes.

prometheus_client takes a lock for every increment (a counter's value, a histogram's bucket and its sum) and a
label lookup for every child; a finished request updates about twenty values, which cost ~10% of the gateway's
per-request CPU. Every update here happens on the event loop (the requests' own thread, and the thread the
``/metrics`` route runs on), so no lock is needed: an update is an integer or float addition on a slot, and
``collect`` builds the families from them. The exposition is what the prometheus_client metrics wrote before
(same names, help, labels and buckets): ``tests/telemetry/test_request_metrics.py`` compares the two.

Labels stay bounded as everywhere: routes, backend and model names the configuration and the backends give,
status classes, outcome words, routing reasons, plugin names.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# LLM latencies: time to first token from 10 ms to 60 s, inter-token from 1 ms to 1 s, requests to 15 min.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 900.0)
TOKENS_PER_SECOND_BUCKETS = (1, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
PLUGIN_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class Buckets:
    """A histogram's buckets kept by hand: ``counts[i]`` values in bucket ``i`` (the first whose upper bound
    the value does not exceed, as Prometheus's ``le``; +Inf last), their sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def add(self, counts: Sequence[int], total: float) -> None:
        """Values already sorted into these buckets (``counts``, +Inf last) and their sum, in one go."""
        mine = self.counts
        if len(counts) != len(mine):
            raise ValueError(f"{len(counts)} counts for a histogram of {len(mine)} buckets")
        n = 0
        for i, c in enumerate(counts):
            if c:
                mine[i] += c
                n += c
        self.sum += total
        self.count += n

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


class ModelSeries:
    """What a finished request adds to one (backend, model)'s series."""

    __slots__ = ("cached_tokens", "completion_tokens", "itl", "prompt_tokens", "reasoning_tokens", "tpot", "tps",
                 "ttft", "usage_seen")

    def __init__(self) -> None:
        self.ttft = Buckets(TTFT_BUCKETS)
        self.itl = Buckets(ITL_BUCKETS)
        self.tpot = Buckets(ITL_BUCKETS)
        self.tps = Buckets(TOKENS_PER_SECOND_BUCKETS)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.cached_tokens = 0
        self.usage_seen = False  # the token series appear with the first usage (the histograms with a value)


class RequestMetrics(Collector):
    """The per-request series. Update on the event loop only (see the module docstring)."""

    def __init__(self) -> None:
        self.in_flight = 0
        # (route, model, backend, status_class, outcome) -> requests
        self.requests: dict[tuple[str, str, str, str, str], int] = {}
        self.durations: dict[tuple[str, str, str], Buckets] = {}  # (route, backend, model)
        self.models: dict[tuple[str, str], ModelSeries] = {}  # (backend, model)
        self.prefix: dict[tuple[str, str], list[int]] = {}  # (backend, index) -> [predicted, reported]
        self.decisions: dict[tuple[str, str], int] = {}  # (backend, reason)
        self.plugin_seconds: dict[str, Buckets] = {}

    def model(self, backend: str, model: str) -> ModelSeries:
        key = (backend, model)
        series = self.models.get(key)
        if series is None:
            series = self.models[key] = ModelSeries()
        return series

    def duration(self, route: str, backend: str, model: str) -> Buckets:
        key = (route, backend, model)
        buckets = self.durations.get(key)
        if buckets is None:
            buckets = self.durations[key] = Buckets(DURATION_BUCKETS)
        return buckets

    def count_request(self, route: str, model: str, backend: str, status_class: str, outcome: str) -> None:
        key = (route, model, backend, status_class, outcome)
        requests = self.requests
        requests[key] = requests.get(key, 0) + 1

    def count_decision(self, backend: str, reason: str) -> None:
        key = (backend, reason)
        decisions = self.decisions
        decisions[key] = decisions.get(key, 0) + 1

    def prefix_tokens(self, backend: str, index: str, predicted: int, reported: int) -> None:
        pair = self.prefix.get((backend, index))
        if pair is None:
            pair = self.prefix[(backend, index)] = [0, 0]
        pair[0] += predicted
        pair[1] += reported

    def plugin_time(self, plugin: str, seconds: float) -> None:
        buckets = self.plugin_seconds.get(plugin)
        if buckets is None:
            buckets = self.plugin_seconds[plugin] = Buckets(PLUGIN_BUCKETS)
        buckets.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        # (copies first: a scrape reads while requests may add series)
        by_model = ["backend", "model"]
        requests = CounterMetricFamily(
            "gateway_requests", "Requests answered, by route, model, backend, HTTP status class and outcome.",
            labels=["route", "model", "backend", "status_class", "outcome"])
        for request_key, n in list(self.requests.items()):
            requests.add_metric(list(request_key), float(n))
        yield requests
        yield GaugeMetricFamily("gateway_requests_in_flight", "Requests the gateway is handling now.",
                                value=float(self.in_flight))
        models = list(self.models.items())
        for name, doc, attr in (
            ("gateway_time_to_first_token_seconds",
             "From the gateway receiving a streamed request to sending the client its first generated text.", "ttft"),
            ("gateway_inter_token_latency_seconds",
             "Gaps between the streamed events carrying generated text, as sent to the client.", "itl"),
            ("gateway_time_per_output_token_seconds",
             "Per request: (last token - first token time) / (output tokens - 1).", "tpot"),
            ("gateway_output_tokens_per_second",
             "Per request decode speed: (output tokens - 1) / (last token - first token time).", "tps"),
        ):
            family = HistogramMetricFamily(name, doc, labels=by_model)
            for key, series in models:
                buckets = getattr(series, attr)
                if buckets.count:
                    family.add_metric(list(key), buckets.cumulative(), buckets.sum)
            yield family
        duration = HistogramMetricFamily("gateway_request_duration_seconds",
                                         "From the gateway receiving a request to its last byte sent.",
                                         labels=["route", "backend", "model"])
        for route_key, buckets in list(self.durations.items()):
            duration.add_metric(list(route_key), buckets.cumulative(), buckets.sum)
        yield duration
        for name, doc, attr in (
            ("gateway_prompt_tokens", "Prompt tokens, from upstream usage.", "prompt_tokens"),
            ("gateway_completion_tokens", "Completion tokens, from upstream usage.", "completion_tokens"),
            ("gateway_reasoning_tokens", "Completion tokens spent on reasoning, where the engine reports them "
             "(usage.completion_tokens_details.reasoning_tokens; SGLang's usage.reasoning_tokens).",
             "reasoning_tokens"),
            ("gateway_cached_tokens", "Prompt tokens the engine reported as served from its prefix cache.",
             "cached_tokens"),
        ):
            counter = CounterMetricFamily(name, doc, labels=by_model)
            for key, series in models:
                if series.usage_seen and (attr != "reasoning_tokens" or series.reasoning_tokens):
                    counter.add_metric(list(key), float(getattr(series, attr)))
            yield counter
        prefix = list(self.prefix.items())
        predicted = CounterMetricFamily(
            "gateway_prefix_predicted_cached_tokens",
            "Prompt tokens the prefix index predicted cached, for requests whose engine reported cached tokens; "
            "index=events: from the engine's KV events, index=approximate: from what was routed there.",
            labels=["backend", "index"])
        reported = CounterMetricFamily(
            "gateway_prefix_reported_cached_tokens",
            "Prompt tokens the engine reported cached, for the same requests as "
            "gateway_prefix_predicted_cached_tokens_total.", labels=["backend", "index"])
        for index_key, (p, r) in prefix:
            predicted.add_metric(list(index_key), float(p))
            reported.add_metric(list(index_key), float(r))
        yield predicted
        yield reported
        decisions = CounterMetricFamily(
            "gateway_routing_decisions",
            "Routing decisions, by chosen backend and the plugin that made the difference.",
            labels=["backend", "reason"])
        for decision_key, n in list(self.decisions.items()):
            decisions.add_metric(list(decision_key), float(n))
        yield decisions
        plugins = HistogramMetricFamily("gateway_routing_plugin_seconds",
                                        "Time each routing plugin took (one decision in 8).", labels=["plugin"])
        for plugin, buckets in list(self.plugin_seconds.items()):
            plugins.add_metric([plugin], buckets.cumulative(), buckets.sum)
        yield plugins
