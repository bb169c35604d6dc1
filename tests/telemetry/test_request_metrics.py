"""The per-request series, kept as plain numbers, expose exactly what prometheus_client's own metrics did for
the same updates: names, help, types, labels, buckets, values."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from gateway.telemetry.request_metrics import (
    DURATION_BUCKETS,
    ITL_BUCKETS,
    PLUGIN_BUCKETS,
    TOKENS_PER_SECOND_BUCKETS,
    TTFT_BUCKETS,
    Buckets,
    RequestMetrics,
)

pytestmark = pytest.mark.unit


def reference(r: CollectorRegistry) -> dict[str, object]:
    """The metrics as they were, prometheus_client's, in the gateway's order."""
    by_model = ["backend", "model"]
    return {
        "requests": Counter("gateway_requests", "Requests answered, by route, model, backend, HTTP status class and "
                            "outcome.", ["route", "model", "backend", "status_class", "outcome"], registry=r),
        "in_flight": Gauge("gateway_requests_in_flight", "Requests the gateway is handling now.", registry=r),
        "ttft": Histogram("gateway_time_to_first_token_seconds", "From the gateway receiving a streamed request to "
                          "sending the client its first generated text.", by_model, buckets=TTFT_BUCKETS, registry=r),
        "itl": Histogram("gateway_inter_token_latency_seconds", "Gaps between the streamed events carrying generated "
                         "text, as sent to the client.", by_model, buckets=ITL_BUCKETS, registry=r),
        "tpot": Histogram("gateway_time_per_output_token_seconds", "Per request: (last token - first token time) / "
                          "(output tokens - 1).", by_model, buckets=ITL_BUCKETS, registry=r),
        "tps": Histogram("gateway_output_tokens_per_second", "Per request decode speed: (output tokens - 1) / (last "
                         "token - first token time).", by_model, buckets=TOKENS_PER_SECOND_BUCKETS, registry=r),
        "duration": Histogram("gateway_request_duration_seconds", "From the gateway receiving a request to its last "
                              "byte sent.", ["route", "backend", "model"], buckets=DURATION_BUCKETS, registry=r),
        "prompt": Counter("gateway_prompt_tokens", "Prompt tokens, from upstream usage.", by_model, registry=r),
        "completion": Counter("gateway_completion_tokens", "Completion tokens, from upstream usage.", by_model,
                              registry=r),
        "reasoning": Counter("gateway_reasoning_tokens", "Completion tokens spent on reasoning, where the engine "
                             "reports them (usage.completion_tokens_details.reasoning_tokens; SGLang's "
                             "usage.reasoning_tokens).", by_model, registry=r),
        "cached": Counter("gateway_cached_tokens", "Prompt tokens the engine reported as served from its prefix "
                          "cache.", by_model, registry=r),
        "predicted": Counter("gateway_prefix_predicted_cached_tokens", "Prompt tokens the prefix index predicted "
                             "cached, for requests whose engine reported cached tokens; index=events: from the "
                             "engine's KV events, index=approximate: from what was routed there.",
                             ["backend", "index"], registry=r),
        "reported": Counter("gateway_prefix_reported_cached_tokens", "Prompt tokens the engine reported cached, for "
                            "the same requests as gateway_prefix_predicted_cached_tokens_total.", ["backend", "index"],
                            registry=r),
        "decisions": Counter("gateway_routing_decisions", "Routing decisions, by chosen backend and the plugin that "
                             "made the difference.", ["backend", "reason"], registry=r),
        "plugins": Histogram("gateway_routing_plugin_seconds", "Time each routing plugin took (one decision in 8).",
                             ["plugin"], buckets=PLUGIN_BUCKETS, registry=r),
    }


def lines(registry: CollectorRegistry) -> list[str]:
    return generate_latest(registry).decode().splitlines()


def test_the_exposition_is_prometheus_clients_for_the_same_updates() -> None:
    disable_created_metrics()  # as the gateway does (GatewayMetrics): no *_created series
    rng = random.Random(7)
    mine = CollectorRegistry()
    live = RequestMetrics()
    mine.register(live)
    theirs = CollectorRegistry()
    ref: dict[str, Counter | Gauge | Histogram] = reference(theirs)  # type: ignore[assignment]
    for _ in range(300):
        route, model, backend = rng.choice(["chat", "completions"]), rng.choice(["m1", "m2"]), rng.choice("ab")
        status, outcome = rng.choice([("2xx", "success"), ("5xx", "upstream_error")])
        live.count_request(route, model, backend, status, outcome)
        ref["requests"].labels(route, model, backend, status, outcome).inc()  # type: ignore[union-attr]
        seconds = rng.expovariate(1.0)
        live.duration(route, backend, model).observe(seconds)
        ref["duration"].labels(route, backend, model).observe(seconds)  # type: ignore[union-attr]
        series = live.model(backend, model)
        ttft = rng.choice([0.01, 0.3, 99.0, rng.random()])  # on a bound, between, beyond the last
        series.ttft.observe(ttft)
        ref["ttft"].labels(backend, model).observe(ttft)  # type: ignore[union-attr]
        for _ in range(rng.randint(1, 3)):
            gap = rng.choice([0.001, rng.random() / 10])
            series.itl.observe(gap)
            ref["itl"].labels(backend, model).observe(gap)  # type: ignore[union-attr]
        tpot = rng.random() / 50
        series.tpot.observe(tpot)
        series.tps.observe(1 / tpot)
        ref["tpot"].labels(backend, model).observe(tpot)  # type: ignore[union-attr]
        ref["tps"].labels(backend, model).observe(1 / tpot)  # type: ignore[union-attr]
        prompt, completion, cached = rng.randint(1, 2000), rng.randint(1, 200), rng.randint(0, 100)
        series.usage_seen = True
        series.prompt_tokens += prompt
        series.completion_tokens += completion
        series.cached_tokens += cached
        ref["prompt"].labels(backend, model).inc(prompt)  # type: ignore[union-attr]
        ref["completion"].labels(backend, model).inc(completion)  # type: ignore[union-attr]
        ref["cached"].labels(backend, model).inc(cached)  # type: ignore[union-attr]
        if model == "m2":  # a reasoning model: only its series exist
            series.reasoning_tokens += 5
            ref["reasoning"].labels(backend, model).inc(5)  # type: ignore[union-attr]
        index = rng.choice(["events", "approximate"])
        live.prefix_tokens(backend, index, prompt // 2, cached)
        ref["predicted"].labels(backend, index).inc(prompt // 2)  # type: ignore[union-attr]
        ref["reported"].labels(backend, index).inc(cached)  # type: ignore[union-attr]
        reason = rng.choice(["prefix", "least-load", "only-candidate"])
        live.count_decision(backend, reason)
        ref["decisions"].labels(backend, reason).inc()  # type: ignore[union-attr]
        live.plugin_time("prefix", 3e-6)
        ref["plugins"].labels("prefix").observe(3e-6)  # type: ignore[union-attr]
    live.in_flight = 3
    ref["in_flight"].set(3)  # type: ignore[union-attr]

    def canonical(text: list[str]) -> list[str]:
        # sums are added in another order (the last bits of a float); every other line must be identical
        return sorted(line if "_sum{" not in line else line.rsplit(" ", 1)[0] for line in text)

    assert canonical(lines(mine)) == canonical(lines(theirs))
    sums = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines(theirs) if "_sum{" in line}
    for line in lines(mine):
        if "_sum{" in line:
            key, value = line.rsplit(" ", 1)
            assert float(value) == pytest.approx(sums[key], rel=1e-9)


def test_a_series_appears_once_used() -> None:
    registry = CollectorRegistry()
    live = RequestMetrics()
    registry.register(live)
    live.model("b", "m")  # touched, nothing observed yet
    text = "\n".join(lines(registry))
    assert 'backend="b"' not in text
    assert "# TYPE gateway_time_to_first_token_seconds histogram" in text and "gateway_requests_in_flight 0.0" in text


def test_bucketed_values_add_as_observing_each() -> None:
    values = [0.0, 0.001, 0.0012, 0.0025, 0.02, 0.3, 1.0, 1.5, 7.25]
    one, bulk = Buckets(ITL_BUCKETS), Buckets(ITL_BUCKETS)
    counts = [0] * (len(ITL_BUCKETS) + 1)
    for v in values:
        one.observe(v)
        probe = Buckets(ITL_BUCKETS)
        probe.observe(v)
        counts = [a + b for a, b in zip(counts, probe.counts, strict=True)]
    bulk.add(counts, sum(values))
    assert (bulk.counts, bulk.count) == (one.counts, one.count) and bulk.sum == pytest.approx(one.sum)
    with pytest.raises(ValueError):
        bulk.add([1, 2], 0.5)
