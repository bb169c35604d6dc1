"""The scrape loop survives anything one backend answers, at start as at run time: garbage is no reading, each
failed reading is counted (``gateway_backend_scrape_errors``) and logged at most once a minute per backend, and
the backend's health keeps being read. The security sweep's gateway refused to start in front of a vLLM reporting
``NaN`` load, and a backend whose load turned to NaN at run time had its scrape loop die silently: when its
``/health`` then answered 503, the gateway still routed to it."""

from __future__ import annotations

import logging

import httpx
import looptime
import pytest

from gateway.config import BackendSettings, ScrapeSettings
from gateway.engines.base import EngineAdapter
from gateway.engines.readings import MAX_MODELS
from gateway.engines.vllm import VLLMAdapter
from gateway.pool.pool import Pool
from gateway.pool.state import Health, LoadRecord
from tests.clock import ManualClock

pytestmark = pytest.mark.unit

SOUND = "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\n"
NAN = "vllm:num_requests_running NaN\nvllm:num_requests_waiting -1e308\nvllm:kv_cache_usage_perc NaN\n"


class Engine:
    """A vLLM or llama.cpp-like server whose answers the test changes between scrapes."""

    def __init__(self, metrics: str = SOUND) -> None:
        self.metrics = metrics
        self.health = 200
        self.slots: httpx.Response = httpx.Response(200, json=[{"id": 0, "is_processing": True}])
        self.models = ["m"]

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(self.health, json={})
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": m, "max_model_len": 4096} for m in self.models]})
        if path == "/slots":
            return self.slots
        if path == "/props":
            return httpx.Response(200, json={"total_slots": 1, "default_generation_settings": {"n_ctx": 4096}})
        return httpx.Response(404)


def make_pool(engines: dict[str, tuple[str, Engine]], clock: ManualClock | None = None) -> Pool:
    settings = [BackendSettings(name=name, engine=kind, url=f"http://{name}.internal:8000")
                for name, (kind, _) in engines.items()]

    def factory(s: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(engines[s.name][1].handler), base_url=s.url)

    return Pool(settings, ScrapeSettings(interval=60, stale_after=5), factory, clock=clock or ManualClock())


@pytest.mark.anyio
async def test_the_pool_starts_in_front_of_backends_answering_garbage() -> None:
    vllm = Engine(metrics=NAN)
    llamacpp = Engine()
    llamacpp.slots = httpx.Response(200, text="<html>maintenance</html>", headers={"content-type": "text/html"})
    pool = make_pool({"v": ("vllm", vllm), "l": ("llamacpp", llamacpp)})
    await pool.start()
    try:
        v, lc = pool.get("v"), pool.get("l")
        assert v.health is Health.READY and lc.health is Health.READY and pool.models() == ["m"]
        assert v.load is not None and (v.load.running, v.load.waiting, v.load.kv_usage) == (None, None, None)
        assert lc.load is None, "a /slots that is no JSON is no reading"
        assert v.scrape_errors == 1 and lc.scrape_errors == 1
        assert v.estimated_queue() == 0, "routing falls back to the gateway's own in-flight count"
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_a_backend_turning_hostile_and_then_down_is_marked_down() -> None:
    engine = Engine()
    pool = make_pool({"v": ("vllm", engine)})
    await pool.start()
    try:
        v = pool.get("v")
        assert v.load is not None and v.load.running == 2
        for metrics in (NAN, "vllm:num_requests_running +Inf\n", "vllm:num_requests_running 1e999\n"):
            engine.metrics = metrics
            await pool.scrape_once(v)
            assert v.health is Health.READY and v.load is not None and v.load.running is None
        engine.health = 503
        await pool.scrape_once(v)
        assert v.health is Health.DOWN and not v.routable and pool.models() == []
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_failed_readings_are_counted_each_time_and_logged_at_most_once_a_minute_per_backend(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    a, b = Engine(metrics=NAN), Engine(metrics="vllm:num_requests_running{ 1 2\n")
    pool = make_pool({"a": ("vllm", a), "b": ("vllm", b)}, clock)
    with caplog.at_level(logging.WARNING, logger="gateway.pool"):
        await pool.start()
        try:
            for _ in range(3):
                clock.now += 15
                for backend in pool:
                    await pool.scrape_once(backend)
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warned) == 2, warned  # one per backend, though each failed four times within the minute
            assert "backend a: its load reading had garbage for running, waiting, kv_usage" in warned[0]
            assert "backend b: load reading failed" in warned[1] and "once a minute" in warned[1]
            assert pool.get("a").scrape_errors == 4 and pool.get("b").scrape_errors == 4
            clock.now += 15  # a minute after the first
            await pool.scrape_once(pool.get("a"))
            assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3, "a minute later: again"
        finally:
            await pool.stop()


class Broken(VLLMAdapter):
    """An adapter with a fault no one foresaw (what a garbage answer could once set off)."""

    async def read_load(self, client: httpx.AsyncClient) -> LoadRecord | None:
        raise ZeroDivisionError("division by zero")


@pytest.mark.anyio
async def test_a_reading_failing_in_a_way_no_adapter_foresaw_is_a_failed_reading_not_a_dead_pool() -> None:
    engine = Engine()
    pool = make_pool({"v": ("vllm", engine)})
    pool.adapters["v"] = Broken()
    await pool.start()
    try:
        v = pool.get("v")
        assert v.health is Health.READY and v.scrape_errors == 1
        engine.health = 503
        await pool.scrape_once(v)
        assert v.health is Health.DOWN
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_a_backend_listing_too_many_models_serves_the_first_thousand_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    engine.models = [f"m-{i:05d}" for i in range(3 * MAX_MODELS)]
    pool = make_pool({"v": ("vllm", engine)})
    with caplog.at_level(logging.WARNING, logger="gateway.pool"):
        await pool.start()
        try:
            v = pool.get("v")
            assert v.models == set(engine.models[:MAX_MODELS]) and len(pool.models()) == MAX_MODELS
            engine.health = 503
            await pool.scrape_once(v)
            engine.health = 200
            await pool.scrape_once(v)  # (back up: its models are listed again)
            assert v.health is Health.READY and len(v.models) == MAX_MODELS
        finally:
            await pool.stop()
    assert len([r for r in caplog.records if "lists more than 1000 models" in r.getMessage()]) == 1


@pytest.mark.anyio
async def test_a_kv_source_echoing_the_backends_key_is_not_followed_nor_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """The final sweep: an engine echoing the Authorization it was sent in its /kv_event_sources answer had the
    gateway log the backend's key (the topic, the replay address) and, as a host, look it up."""
    key = "sk-backendSECRET-0123456789"
    engine = Engine()
    rank = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}
    answers = [{"0": {**rank, "topic": f"t-{key}"}}, {"0": {**rank, "topic": "kv"}}]
    handler = engine.handler

    def with_sources(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/kv_event_sources":
            return httpx.Response(200, json=answers[0])
        return handler(request)

    engine.handler = with_sources  # type: ignore[method-assign]
    settings = [BackendSettings(name="v", engine="vllm", url="http://v.internal:8000", api_key=key,
                                kv_events="discover")]

    def factory(s: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(engine.handler), base_url=s.url)

    pool = Pool(settings, ScrapeSettings(interval=60, stale_after=5), factory, clock=ManualClock())
    with caplog.at_level(logging.INFO, logger="gateway.pool"):
        await pool.start()
        try:
            v = pool.get("v")
            assert v.health is Health.READY and v.kv_source is None
            answers.pop(0)  # (the engine says something else when it comes back up)
            engine.health = 503
            await pool.scrape_once(v)
            engine.health = 200
            await pool.scrape_once(v)
            assert v.kv_source is not None and v.kv_source.topic == "kv"
        finally:
            await pool.stop()
    assert "carries the gateway's credential" in caplog.text
    assert "SECRET" not in caplog.text


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"loop_factory": looptime.new_event_loop})], ids=["fake-time"])
async def test_a_reading_trickled_byte_by_byte_ends_within_the_scrape_timeout() -> None:
    """Sweep 14: httpx's timeout is per read, and only the health probe had a deadline in all: a /metrics answer
    trickled a byte every 0.5 s held a backend's scrape (its health checks included) 31 s, its load going stale.
    Each reading now ends within the scrape's timeout, as a failed reading (here llama.cpp's /slots)."""
    import asyncio
    from collections.abc import AsyncIterator

    engine = Engine()

    async def trickle() -> AsyncIterator[bytes]:  # (~1.7 s in all, of a fake-time loop's: none of it real)
        for byte in b'[{"id": 0, "is_processing": true}]':
            # real time: the trickle's pace is the behaviour (a byte every 0.05 s, of the fake-time loop's time)
            await asyncio.sleep(0.05)
            yield bytes([byte])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slots":  # (llama.cpp's load reading)
            return httpx.Response(200, content=trickle())
        return engine.handler(request)

    settings = [BackendSettings(name="v", engine="llamacpp", url="http://v.internal:8000")]
    pool = Pool(settings, ScrapeSettings(interval=60, stale_after=5, timeout=0.3),
                lambda s, adapter: httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=s.url),
                clock=ManualClock())
    await pool.start()
    try:
        v = pool.get("v")  # (read whole, the trickle would have given a load; cut at 0.3 s, none)
        assert v.health is Health.READY and v.scrape_errors == 1 and v.load is None
    finally:
        await pool.stop()
