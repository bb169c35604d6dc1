"""What a finished exchange tells the metrics and the routing plugins. Runs once per request, after its last
byte was sent.

The access log is one JSON line per request (:func:`access_record`). It goes through the ``gateway.access``
logger, unless that logger does nothing but hand its records to an :class:`AccessLogWriter` (through an
:class:`AccessLogHandler`, as ``gateway serve`` sets it up): then the line is given to the writer directly,
without the logging machinery (a record, handler locks, a queue item per line), which cost ~8% of the CPU of a
gateway under load. Embedders who attach their own handler to ``gateway.access`` get their records.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import TextIO

import orjson

from gateway.pool.backend import Backend
from gateway.proxy.exchange import Exchange
from gateway.routing.request import Outcome, RouteRequest
from gateway.telemetry.metrics import UNKNOWN, GatewayMetrics
from gateway.telemetry.recent import Recent

access_log = logging.getLogger("gateway.access")
log = logging.getLogger(__name__)


class AccessLogWriter:
    """Writes access-log lines to a stream from a thread of its own, in batches: a slow stream (a full pipe to
    a log collector) never blocks the event loop that carries every stream.

    ``write`` only appends the line to a deque (thread-safe, no lock taken). The thread takes what is there
    every ``interval`` seconds, or as soon as ``batch`` lines wait, and writes it with one ``write`` (and one
    ``flush``) call: whole lines, in order, never interleaved. ``stop`` writes what is left before it returns;
    lines written after it go straight to the stream. Nothing is dropped: while the stream blocks, lines wait in
    memory (as they did in the logging queue before).
    """

    def __init__(self, stream: TextIO, *, interval: float = 0.05, batch: int = 512) -> None:
        self._stream = stream
        self._interval = interval
        self._batch = batch
        self._lines: collections.deque[bytes] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._failed = False
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()  # the thread, and ``write`` once stopped

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gateway-access-log", daemon=True)
        self._thread.start()

    def write(self, line: bytes) -> None:
        """Queue one line (UTF-8, without its newline)."""
        lines = self._lines
        lines.append(line)
        if len(lines) == self._batch:
            self._wake.set()
        if self._stopping:
            self._drain()

    def stop(self) -> None:
        """Write every queued line and end the thread (idempotent)."""
        self._stopping = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._drain()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._interval)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        with self._write_lock:
            lines = self._lines
            n = len(lines)
            if not n:
                return
            batch = [lines.popleft() for _ in range(n)]
            batch.append(b"")  # a newline after the last line too
            text = b"\n".join(batch).decode()
            try:
                self._stream.write(text)
                self._stream.flush()
            except Exception:  # a closed or broken stream: say so once, keep the event loop's side untouched
                if not self._failed:
                    self._failed = True
                    log.exception("the access log could not be written")


class AccessLogHandler(logging.Handler):
    """Hands the ``gateway.access`` logger's records to an :class:`AccessLogWriter`, one line each. When it is the
    logger's only handler, :class:`Accounting` skips logging and writes its lines to the writer itself."""

    def __init__(self, writer: AccessLogWriter) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.writer.write(self.format(record).encode())
        except Exception:
            self.handleError(record)


def _direct_writer() -> Callable[[bytes], None] | None:
    """The writer's ``write``, when the access logger would do nothing but hand an INFO record to it."""
    handlers = access_log.handlers
    if len(handlers) != 1 or access_log.propagate:
        return None
    handler = handlers[0]
    if type(handler) is not AccessLogHandler or not access_log.isEnabledFor(logging.INFO):
        return None
    if handler.filters or access_log.filters or handler.level > logging.INFO:
        return None
    return handler.writer.write


# outcomes that count as the backend's errors in the recent view (a client's own error or hang-up is not)
FAILED = frozenset({"upstream_error", "upstream_failed"})


class Accounting:
    """Accounts one finished request: its metrics, its access-log line, what routing learns from it
    (``learn``: the routing pipeline's ``observe``) and the operator's recent view of its backend (``recent``)."""

    def __init__(self, metrics: GatewayMetrics, learn: Callable[[Outcome, Backend], None],
                 access_log_enabled: bool, recent: Recent | None = None) -> None:
        self._metrics = metrics
        self._learn = learn
        self._access_log = access_log_enabled
        self._recent = recent

    def relearn(self, learn: Callable[[Outcome, Backend], None]) -> None:
        """A reloaded routing pipeline's ``observe``."""
        self._learn = learn

    def __call__(self, exchange: Exchange) -> None:
        if (exchange.request is not None and exchange.backend is not None
                and exchange.outcome != "pending" and exchange.outcome != "interrupted"):  # (nothing learnt)
            self._learn(outcome_of(exchange, exchange.request), exchange.backend)
        record_metrics(self._metrics, exchange)
        backend = exchange.backend
        if self._recent is not None and backend is not None:
            first = exchange.t_first_text
            ttft = None if first is None else first - exchange.t_start
            self._recent.record(backend.name, exchange.t_end or time.perf_counter(), ok=exchange.outcome not in FAILED,
                                ttft=ttft,
                                tokens=exchange.usage_int("completion_tokens"),
                                first=first, last=exchange.t_last_text, reason=exchange.route_reason)
        if self._access_log:
            write = _direct_writer()
            if write is not None:
                write(access_record(exchange))
            else:
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


_second: list[object] = [None, ""]  # the last second formatted, and its text


def _timestamp() -> str:
    """Now in UTC, as ``datetime.now(UTC).isoformat(timespec="milliseconds")`` writes it, the date and time
    formatted once a second (a third of an access-log line's cost was that call)."""
    now = time.time()
    second = int(now)
    if second != _second[0]:
        _second[0], _second[1] = second, datetime.datetime.fromtimestamp(second, datetime.UTC).strftime(
            "%Y-%m-%dT%H:%M:%S")
    return f"{_second[1]}.{int((now - second) * 1000):03d}+00:00"


def access_record(exchange: Exchange) -> bytes:
    """The access-log line of a finished request (JSON)."""
    end = exchange.t_end or time.perf_counter()
    usage = exchange.usage or {}
    backend = exchange.backend
    return orjson.dumps({
        "ts": _timestamp(),
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
        "prompt_tokens": exchange.usage_int("prompt_tokens") if "prompt_tokens" in usage else None,
        "completion_tokens": exchange.usage_int("completion_tokens") if "completion_tokens" in usage else None,
        "cached_tokens": exchange.cached_tokens() if usage else None,
        "route_reason": exchange.route_reason,
    })


def record_metrics(m: GatewayMetrics, exchange: Exchange) -> None:
    live = m.live
    backend = exchange.backend.name if exchange.backend else UNKNOWN
    model = exchange.model if exchange.model is not None else UNKNOWN
    status_class = f"{exchange.status // 100}xx" if exchange.status else "none"
    live.count_request(exchange.route, model, backend, status_class, exchange.outcome)
    if exchange.backend is None:
        return
    end = exchange.t_end or time.perf_counter()
    live.duration(exchange.route, backend, model).observe(end - exchange.t_start)
    if exchange.t_dispatch is not None:
        m.queue_wait.observe(backend, "gateway", exchange.t_dispatch - exchange.t_start)
    first, last = exchange.t_first_text, exchange.t_last_text
    series = live.model(backend, model)
    if first is not None:
        series.ttft.observe(first - exchange.t_start)
        counts = exchange.gap_counts
        if counts is not None and any(counts):
            series.itl.add(counts, exchange.gap_sum)
    usage = exchange.usage
    if usage:
        series.usage_seen = True
        series.prompt_tokens += exchange.usage_int("prompt_tokens")
        completion = exchange.usage_int("completion_tokens")
        series.completion_tokens += completion
        series.reasoning_tokens += exchange.reasoning_tokens()
        reported = exchange.reported_cached_tokens()
        series.cached_tokens += reported or 0
        request = exchange.request
        if reported is not None and request is not None:
            # the engine's own events where they predicted it, else the approximate index
            if request.events_cached_tokens is not None:
                live.prefix_tokens(backend, "events", request.events_cached_tokens, reported)
            elif request.predicted_cached_tokens is not None:
                live.prefix_tokens(backend, "approximate", request.predicted_cached_tokens, reported)
        if first is not None and last is not None and completion >= 2 and last > first:
            per_token = (last - first) / (completion - 1)
            series.tpot.observe(per_token)
            series.tps.observe(1.0 / per_token)
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
