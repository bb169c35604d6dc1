"""Traces (in-memory exporter) and the JSON access log, through the gateway in front of emulated engines."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Iterator

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from gateway.proxy import accounting
from gateway.sim import FleetThread, SimSpec
from gateway.telemetry.tracing import provider_from_environment
from tests.api.conftest import TIME_SCALE, gateway_settings
from tests.conftest import ServerThread, serve_in_thread
from tests.waiting import wait_until

ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[ServerThread, InMemorySpanExporter, FleetThread]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=TIME_SCALE)]
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers), tracer_provider=provider)
        with serve_in_thread(app) as gateway:
            yield gateway, exporter, fleet


def test_a_request_is_one_server_span_with_route_and_upstream_children(traced: tuple[ServerThread,
                                                                           InMemorySpanExporter, FleetThread]) -> None:
    gateway, exporter, fleet = traced
    exporter.clear()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    list(c.chat.completions.create(model="m", messages=ASK, max_tokens=5, stream=True,
                                   stream_options={"include_usage": True},
                                   extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}))
    # the request span ends after the last byte: the client may have read it a moment before
    wait_until(lambda: "chat m" in {s.name for s in exporter.get_finished_spans()}, "the request's span ended")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["chat m"]
    assert root.kind is SpanKind.SERVER and format(root.context.trace_id, "032x") == trace_id
    assert root.parent is not None and format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gateway.backend"] == "v"
    assert attrs["gateway.route.reason"] and attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.response.time_to_first_chunk"] > 0
    route, upstream = spans["route"], spans["POST /v1/chat/completions"]
    assert route.parent is not None and route.parent.span_id == root.context.span_id
    assert upstream.kind is SpanKind.CLIENT and upstream.parent is not None
    assert dict(upstream.attributes or {})["gen_ai.provider.name"] == "vllm"
    # the backend got W3C trace context naming the upstream span
    sent = [r for r in list(fleet.fleet["v"].received) if r.path == "/v1/chat/completions"][-1]
    assert sent.headers["traceparent"] == f"00-{trace_id}-{format(upstream.context.span_id, '016x')}-01"


def test_a_failed_request_is_marked(traced: tuple[ServerThread, InMemorySpanExporter, FleetThread]) -> None:
    gateway, exporter, fleet = traced
    exporter.clear()
    fleet.fleet["v"].faults.update({"error_rate": 1.0, "error_status": 500})
    try:
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model="m", messages=ASK, max_tokens=5)
    finally:
        fleet.fleet["v"].faults.update({"error_rate": 0.0})
    root = next(s for s in exporter.get_finished_spans() if s.name == "chat m")
    assert not root.status.is_ok and dict(root.attributes or {})["error.type"] == "upstream_error"


def test_an_agent_api_request_is_named_by_its_api_and_a_stream_cut_short_says_why(
        traced: tuple[ServerThread, InMemorySpanExporter, FleetThread]) -> None:
    """A Responses request (translated to chat here: the emulated vLLM is sent chat completions or its own
    Responses route) was a span named "chat m"; a stream the backend cut short was an error "HTTP 200"."""
    gateway, exporter, fleet = traced
    exporter.clear()
    c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    c.responses.create(model="m", input="hello", max_output_tokens=5)
    wait_until(lambda: "responses m" in {s.name for s in exporter.get_finished_spans()}, "the request's span ended")
    root = next(s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER)
    assert root.name == "responses m" and dict(root.attributes or {})["gen_ai.operation.name"] == "responses"
    exporter.clear()
    fleet.fleet["v"].faults.update({"drop_mid_stream_after_tokens": 2})
    try:
        with pytest.raises(openai.APIError):  # (the stream ends with an error event)
            list(c.chat.completions.create(model="m", messages=ASK, max_tokens=20, stream=True))
    finally:
        fleet.fleet["v"].faults.update({"drop_mid_stream_after_tokens": None})
    wait_until(lambda: "chat m" in {s.name for s in exporter.get_finished_spans()}, "the request's span ended")
    root = next(s for s in exporter.get_finished_spans() if s.name == "chat m")
    assert not root.status.is_ok and root.status.description == "upstream_failed (HTTP 200)", root.status


def test_tracing_follows_the_standard_environment_variables() -> None:
    assert provider_from_environment({}) is None
    assert provider_from_environment({"OTEL_TRACES_EXPORTER": "none",
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) is None
    assert provider_from_environment({"OTEL_SDK_DISABLED": "true",
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) is None
    provider = provider_from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                                          "OTEL_SERVICE_NAME": "gw-test"})
    assert provider is not None and provider.resource.attributes["service.name"] == "gw-test"
    provider.shutdown()


def test_access_log_is_one_json_line_per_request_without_content(caplog: pytest.LogCaptureFixture) -> None:
    specs = [SimSpec(engine="sglang", model="m", name="s", time_scale=TIME_SCALE, api_key="backend-secret")]
    with FleetThread(specs) as fleet, serve_in_thread(create_app(gateway_settings(fleet.fleet.servers))) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="client-secret", max_retries=0)
        with caplog.at_level(logging.INFO, logger="gateway.access"):
            list(c.chat.completions.create(model="m", messages=[{"role": "user", "content": "very private"}],
                                           max_tokens=4, stream=True, extra_headers={"x-request-id": "abc-1"}))
            with pytest.raises(openai.NotFoundError):
                c.chat.completions.create(model="nope", messages=ASK)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gateway.access"]
    ok = next(line for line in lines if line["request_id"] == "abc-1")
    assert ok["model"] == "m" and ok["backend"] == "s" and ok["engine"] == "sglang" and ok["status"] == 200
    assert ok["outcome"] == "success" and ok["completion_tokens"] == 4 and ok["ttft_ms"] > 0
    assert ok["duration_ms"] >= ok["ttft_ms"] and ok["stream"] is True
    stamped = datetime.datetime.fromisoformat(ok["ts"])  # ISO 8601, UTC, to the millisecond
    assert stamped.utcoffset() == datetime.timedelta(0) and len(ok["ts"]) == len("2026-01-01T00:00:00.000+00:00")
    assert abs((datetime.datetime.now(datetime.UTC) - stamped).total_seconds()) < 60
    missing = next(line for line in lines if line["status"] == 404)
    assert missing["backend"] is None and missing["outcome"] == "client_error"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "very private" not in text and "secret" not in text


def test_access_log_timestamps_are_those_datetime_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The line's time is formatted once a second; each line still gets its own millisecond, across seconds."""
    for now in (1_700_000_000.0005, 1_700_000_000.9999, 1_700_000_001.25, 1_700_000_001.25, 1_800_000_000.042):
        monkeypatch.setattr(accounting.time, "time", lambda now=now: now)
        expected = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="milliseconds")
        assert accounting._timestamp() == expected


@pytest.mark.anyio
async def test_a_collector_that_never_answers_holds_a_shutdown_no_longer_than_its_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    """Sweep 19: with the OTLP endpoint a black hole (a socket that takes connections and answers nothing), the
    gateway's exit waited out the exporter's timeouts, 30 s, on the event loop. The shutdown now waits its bound,
    then drops what was not sent and says so; the exporter, still waiting, is left to its daemon thread."""
    import socket
    import threading

    from gateway.telemetry.tracing import Tracing

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        endpoint = f"http://127.0.0.1:{hole.getsockname()[1]}/v1/traces"
        tracing = Tracing(provider_from_environment({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}))
        tracing.start_request("chat", []).end()
        with caplog.at_level(logging.WARNING, logger="gateway.tracing"):
            await tracing.shutdown(within=0.2)
        assert "did not finish within 0.2 s" in caplog.text
        assert any(t.name == "otel-shutdown" and t.is_alive() for t in threading.enumerate()), \
            "the exporter was still waiting on the collector: the bound, not the exporter, ended the wait"
