"""``gateway bench overhead --tracing``: its OTLP sink takes the real exporter's exports, and what tracing adds
is computed per level against the untraced gateway."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from gateway.bench.overhead import TRACED, tracing_cost
from tests.conftest import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.unit


@pytest.fixture
def sink() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", f"from gateway.bench.overhead import otlp_sink; otlp_sink({port})"])
    url = f"http://127.0.0.1:{port}"

    def answering() -> bool:
        try:
            httpx.get(url + "/stats", timeout=1)
        except httpx.TransportError:
            assert proc.poll() is None, "the sink exited"
            return False
        return True

    try:
        wait_until(answering, "the sink started", within=15)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.system
def test_sink_takes_the_otlp_exporters_spans_and_keeps_only_counts(sink: str) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sink + "/v1/traces")))
    tracer = provider.get_tracer("test")
    for i in range(3):
        with tracer.start_as_current_span(f"span {i}"):
            pass
    provider.shutdown()
    stats = httpx.get(sink + "/stats").json()
    assert stats["exports"] == 3 and stats["bytes"] > 0  # each export answered 200: none retried or lost
    reply = httpx.post(sink + "/v1/traces", content=b"\x00" * 10)
    assert reply.status_code == 200 and reply.content == b""


def test_tracing_cost_is_the_traced_gateway_against_the_untraced_one() -> None:
    def row(ttft: float, e2e: float, cpu: float, added: float | None = None) -> dict[str, float | None]:
        return {"ttft_ms_p50": ttft, "ttft_ms_p99": 2 * ttft, "e2e_ms_p50": e2e, "cpu_ms_per_request": cpu,
                "added_ttft_ms_p50": added}

    levels = {"1": {"direct": row(0.4, 80.0, 0.1), "gateway": row(1.6, 81.0, 1.0, 1.2),
                    TRACED: row(1.9, 81.5, 1.2, 1.5)},
              "16": {"direct": row(1.0, 80.0, 0.1), "gateway": row(5.0, 82.0, 0.5, 4.0)}}
    cost = tracing_cost(levels)
    assert list(cost) == ["1"]  # a level without the traced gateway has nothing to compare
    one = cost["1"]
    assert one["ttft_us_p50"] == pytest.approx(300.0) and one["ttft_us_p99"] == pytest.approx(600.0)
    assert one["e2e_us_p50"] == pytest.approx(500.0) and one["cpu_us_per_request"] == pytest.approx(200.0)
    assert one["ttft_p50_x"] == pytest.approx(1.9 / 1.6) and one["cpu_per_request_x"] == pytest.approx(1.2)
    assert one["added_ttft_over_direct_x"] == pytest.approx(1.25)
