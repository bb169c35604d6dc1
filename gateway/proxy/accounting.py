"""What a finished exchange tells the metrics and the routing plugins. Runs once per request, after its last
byte was sent."""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import orjson

from gateway.pool.backend import Backend
from gateway.proxy.exchange import Exchange
from gateway.routing.request import Outcome, RouteRequest
from gateway.telemetry.metrics import UNKNOWN, GatewayMetrics

access_log = logging.getLogger("gateway.access")


class Accounting:
    """Accounts one finished request: its metrics, its access-log line, and what routing learns from it
    (``learn``: the routing pipeline's ``observe``)."""

    def __init__(self, metrics: GatewayMetrics, learn: Callable[[Outcome, Backend], None],
                 access_log_enabled: bool) -> None:
        self._metrics = metrics
        self._learn = learn
        self._access_log = access_log_enabled

    def __call__(self, exchange: Exchange) -> None:
        if exchange.request is not None and exchange.backend is not None and exchange.outcome != "pending":
            self._learn(outcome_of(exchange, exchange.request), exchange.backend)
        record_metrics(self._metrics, exchange)
        if self._access_log:
            access_log.info(access_record(exchange).decode())


def _engine_times(exchange: Exchange) -> tuple[float, float] | None:
    """The engine's own (prompt processing, generation) seconds, where its spec says it reports them
    (``EngineSpec.timings``)."""
    source = exchange.backend.spec.timings if exchange.backend is not None else None
    if source == "timings_ms":
        timings = exchange.timings or {}
        prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
        if isinstance(prompt_ms, int | float) and isinstance(predicted_ms, int | float):
            return prompt_ms / 1000, predicted_ms / 1000
    elif source == "usage_seconds":
        usage = exchange.usage or {}
        prompt_time, completion_time = usage.get("prompt_time"), usage.get("completion_time")
        if isinstance(prompt_time, int | float) and isinstance(completion_time, int | float):
            return float(prompt_time), float(completion_time)
    return None


def access_record(exchange: Exchange) -> bytes:
    """The access-log line of a finished request (JSON)."""
    end = exchange.t_end or time.perf_counter()
    usage = exchange.usage or {}
    backend = exchange.backend
    return orjson.dumps({
        "ts": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        "request_id": exchange.request_id,
        "route": exchange.route,
        "model": exchange.model,
        "backend": backend.name if backend else None,
        "engine": backend.engine if backend else None,
        "status": exchange.status,
        "outcome": exchange.outcome,
        "stream": exchange.stream,
        "ttft_ms": round((exchange.t_first_text - exchange.t_start) * 1000, 2)
        if exchange.t_first_text is not None else None,
        "duration_ms": round((end - exchange.t_start) * 1000, 2),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": exchange.cached_tokens() if usage else None,
        "route_reason": exchange.route_reason,
    })


def record_metrics(m: GatewayMetrics, exchange: Exchange) -> None:
    child = m.child
    backend = exchange.backend.name if exchange.backend else UNKNOWN
    model = exchange.model if exchange.model is not None else UNKNOWN
    status_class = f"{exchange.status // 100}xx" if exchange.status else "none"
    child(m.requests, exchange.route, model, backend, status_class, exchange.outcome).inc()
    if exchange.backend is None:
        return
    end = exchange.t_end or time.perf_counter()
    child(m.request_duration, exchange.route, backend, model).observe(end - exchange.t_start)
    if exchange.t_dispatch is not None:
        m.queue_wait.observe(backend, "gateway", exchange.t_dispatch - exchange.t_start)
    first, last = exchange.t_first_text, exchange.t_last_text
    if first is not None:
        child(m.time_to_first_token, backend, model).observe(first - exchange.t_start)
        if exchange.gaps or exchange.zero_gaps:
            itl = child(m.inter_token_latency, backend, model)
            for gap in exchange.gaps:
                itl.observe(gap)
            for _ in range(exchange.zero_gaps):
                itl.observe(0.0)
    if exchange.usage:
        child(m.prompt_tokens, backend, model).inc(exchange.usage_int("prompt_tokens"))
        completion = exchange.usage_int("completion_tokens")
        child(m.completion_tokens, backend, model).inc(completion)
        child(m.cached_tokens, backend, model).inc(exchange.cached_tokens())
        reported = exchange.reported_cached_tokens()
        request = exchange.request
        if reported is not None and request is not None:
            # the engine's own events where they predicted it, else the approximate index
            if request.events_cached_tokens is not None:
                child(m.prefix_predicted_tokens, backend, "events").inc(request.events_cached_tokens)
                child(m.prefix_reported_tokens, backend, "events").inc(reported)
            elif request.predicted_cached_tokens is not None:
                child(m.prefix_predicted_tokens, backend, "approximate").inc(request.predicted_cached_tokens)
                child(m.prefix_reported_tokens, backend, "approximate").inc(reported)
        if first is not None and last is not None and completion >= 2 and last > first:
            per_token = (last - first) / (completion - 1)
            child(m.time_per_output_token, backend, model).observe(per_token)
            child(m.output_tokens_per_second, backend, model).observe(1.0 / per_token)
    engine_times = _engine_times(exchange)
    if engine_times is not None and exchange.t_dispatch is not None and exchange.outcome == "success":
        prompt_s, generate_s = engine_times
        if first is not None:  # streamed: time to the first token, less the engine's prompt processing
            waited = first - exchange.t_dispatch - prompt_s
        else:
            waited = end - exchange.t_dispatch - prompt_s - generate_s
        m.queue_wait.observe(backend, "engine", waited)


def outcome_of(exchange: Exchange, request: RouteRequest) -> Outcome:
    """What routing learns from a finished exchange. Engine-reported times are preferred to the gateway's own
    clock, which includes network and queueing."""
    assert exchange.backend is not None
    ttft = decode = None
    if exchange.t_first_text is not None:
        ttft = exchange.t_first_text - (exchange.t_dispatch or exchange.t_start)
        if exchange.t_last_text is not None:
            decode = exchange.t_last_text - exchange.t_first_text
    engine_times = _engine_times(exchange)
    if engine_times is not None:
        ttft, decode = engine_times
    cached = exchange.reported_cached_tokens()
    return Outcome(
        request=request,
        backend=exchange.backend.name,
        concurrency=exchange.concurrency,
        ok=exchange.outcome == "success",
        ttft=ttft,
        decode_seconds=decode,
        prompt_tokens=exchange.usage_int("prompt_tokens") or None,
        completion_tokens=exchange.usage_int("completion_tokens") or None,
        cached_tokens=cached,
    )
