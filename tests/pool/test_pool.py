"""The scrape loop's state machine: discovery, loading, failure and recovery, stale readings."""

from __future__ import annotations

import asyncio

import httpx
import looptime
import pytest

from gateway.clock import SYSTEM, Clock
from gateway.config import BackendSettings, ScrapeSettings
from gateway.engines.base import EngineAdapter
from gateway.pool.pool import Pool
from gateway.pool.state import Health, LoopReading
from tests.clock import ManualClock
from tests.waiting import until

pytestmark = pytest.mark.unit

FAKE_TIME = ("asyncio", {"loop_factory": lambda: looptime.new_event_loop(start=1000.0)})  # anyio_backend


class FakeEngine:
    """A llama.cpp-like server whose answers the test changes between scrapes."""

    def __init__(self) -> None:
        self.state = "ready"  # ready | loading | down
        self.models = ["m1"]
        self.busy = 1
        self.completions = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.state == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if self.state == "loading":
            return httpx.Response(503, json={"error": {"code": 503, "message": "Loading model"}})
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": m} for m in self.models]})
        if path == "/slots":
            return httpx.Response(200, json=[{"id": i, "is_processing": i < self.busy} for i in range(2)])
        if path == "/metrics":
            return httpx.Response(501, json={"error": {"code": 501}})
        if path == "/props":
            return httpx.Response(200, json={"total_slots": 2, "default_generation_settings": {"n_ctx": 2048}})
        if path == "/completion":
            self.completions += 1
            return httpx.Response(200, json={"content": "a b c", "timings": {"predicted_per_token_ms": 4.0,
                                                                             "predicted_n": 8}})
        return httpx.Response(404)


def make_pool(engine: FakeEngine, clock: Clock = SYSTEM, **backend: object) -> Pool:
    settings = BackendSettings(name="a", engine="llamacpp", url="http://a", **backend)  # type: ignore[arg-type]

    def factory(s: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(engine.handler), base_url=s.url)

    return Pool([settings], ScrapeSettings(interval=60, stale_after=5), factory, clock=clock)


@pytest.mark.anyio
async def test_discovery_failure_and_recovery() -> None:
    engine = FakeEngine()
    pool = make_pool(engine)
    await pool.start()
    try:
        a = pool.get("a")
        assert a.health is Health.READY and a.models == {"m1"} and pool.models() == ["m1"]
        assert a.capacity.slots == 2 and a.capacity.context_length == 2048
        assert a.load is not None and a.load.running == 1

        engine.state = "down"
        await pool.scrape_once(a)
        assert a.health is Health.DOWN and "refused" in a.detail and a.load is None
        assert pool.models() == [] and pool.known_models() == {"m1"}, "a down backend's model stays known"

        engine.state, engine.models = "loading", ["m2"]
        await pool.scrape_once(a)
        assert a.health is Health.LOADING

        engine.state = "ready"
        await pool.scrape_once(a)
        assert a.health is Health.READY and a.models == {"m2"}, "models are re-discovered on recovery"
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_configured_models_skip_discovery_and_mark_down_is_undone_by_the_next_probe() -> None:
    engine = FakeEngine()
    pool = make_pool(engine, models=["alias"])
    await pool.start()
    try:
        a = pool.get("a")
        assert a.models == {"alias"}
        a.mark_down("connection failed")
        assert not a.routable
        await pool.scrape_once(a)
        assert a.routable
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_a_server_that_serves_no_model_is_not_routable() -> None:
    engine = FakeEngine()
    engine.models = []
    pool = make_pool(engine)
    await pool.start()
    try:
        assert pool.get("a").health is Health.DOWN and "no model" in pool.get("a").detail
    finally:
        await pool.stop()


# -- a follower (server.workers > 1): the first worker's readings instead of its own scrapes -----------------
def follower(engine: FakeEngine, answers: list[bytes | None], interval: float = 60, clock: Clock = SYSTEM) -> Pool:
    settings = BackendSettings(name="a", engine="llamacpp", url="http://a")

    def factory(s: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(engine.handler), base_url=s.url)

    async def leader() -> bytes | None:
        return answers.pop(0) if answers else None

    return Pool([settings], ScrapeSettings(interval=interval, stale_after=5), factory, leader=leader, clock=clock)


@pytest.mark.anyio
async def test_a_follower_takes_the_leaders_readings_and_ignores_stale_or_superseded_ones() -> None:
    import orjson

    clock = ManualClock()  # (both workers' clocks: time.monotonic(), the same in every process of a pod)
    engine = FakeEngine()
    leader_pool = make_pool(engine, clock)
    await leader_pool.start()
    pool = follower(FakeEngine(), [], clock=clock)
    await pool.start()  # its own first probe, as at a worker's start
    try:
        clock.advance(1)
        engine.busy = 2
        await leader_pool.scrape_once(leader_pool.get("a"))
        fresh = orjson.dumps(leader_pool.snapshot())
        a = pool.get("a")
        loops: list[LoopReading] = []  # (the stall guard's: the leader's reading of the loop, once each)
        pool.on_loop = loops.append
        assert pool.apply_snapshot(fresh)
        assert a.load is not None and a.load.running == 2 and a.health is Health.READY
        assert a.models == {"m1"} and a.capacity.slots == 2
        assert pool.apply_snapshot(fresh)
        # (with this worker's own in flight: the engine running more is running what another worker sent)
        assert [(r.backend, r.running, r.in_flight) for r in loops] == [("a", 2, 0)], loops
        # the proxy saw it fail after that reading: the same reading does not bring it back
        clock.advance(1)
        a.mark_down("connection refused")
        assert pool.apply_snapshot(fresh) and a.health is Health.DOWN
        # a newer reading does
        clock.advance(1)
        await leader_pool.scrape_once(leader_pool.get("a"))
        assert pool.apply_snapshot(orjson.dumps(leader_pool.snapshot())) and a.health is Health.READY
        # a reading older than stale_after is no reading: the follower must scrape for itself
        old = leader_pool.snapshot()
        old["backends"]["a"]["probed_at"] = clock.now - 6
        assert not pool.apply_snapshot(orjson.dumps(old))
        assert not pool.apply_snapshot(b"{not json")
    finally:
        await pool.stop()
        await leader_pool.stop()


@pytest.mark.anyio
async def test_a_follower_whose_leader_has_nothing_to_give_scrapes_for_itself() -> None:
    engine = FakeEngine()
    pool = follower(engine, [None, b"garbage"], interval=0.01)
    await pool.start()
    try:
        a = pool.get("a")
        engine.busy = 0
        await until(lambda: a.load is not None and a.load.running == 0, "a reading from the engine itself")
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_a_reload_brings_back_a_backend_it_removed_while_that_one_drains() -> None:
    def entry(name: str, port: int, **extra: object) -> BackendSettings:
        return BackendSettings.model_validate({"name": name, "engine": "vllm", "url": f"http://127.0.0.1:{port}",
                                               **extra})

    pool = Pool([entry("a", 9), entry("b", 10)], ScrapeSettings())
    pool.get("a").in_flight = 1  # a request still on it
    changes = await pool.reconcile([entry("b", 10)], drain_seconds=5)
    assert changes == {"added": [], "removed": ["a"], "changed": []} and pool.get("a").drained
    removal = next(t for t in pool._background if t.get_name() == "remove:a")
    again = await pool.reconcile([entry("a", 9), entry("b", 10, max_concurrency=4)], drain_seconds=5)
    assert again == {"added": [], "removed": [], "changed": ["b"]}
    assert not pool.get("a").drained and pool.get("b").max_concurrency == 4
    pool.get("a").in_flight = 0
    await asyncio.wait([removal])  # the first reload's removal, run to its end (its drain over)
    assert {b.name for b in pool} == {"a", "b"}
    await pool.stop()


@pytest.mark.anyio
async def test_a_backend_added_again_while_its_removal_runs_keeps_its_settings_and_scrapes() -> None:
    """Sweep 16: a backend removed (admin DELETE) and added again under its name (admin POST) at once: the removal,
    resumed after its first await, took the new entry's settings, and every later configuration change of that
    process failed on them (500 KeyError) until a restart."""
    engine = FakeEngine()

    def factory(s: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(engine.handler), base_url=s.url)

    def entry(name: str) -> BackendSettings:
        return BackendSettings(name=name, engine="llamacpp", url=f"http://{name}")

    pool = Pool([entry("a"), entry("x")], ScrapeSettings(interval=60, stale_after=5), factory)
    await pool.start()
    try:
        await pool.reconcile([entry("a")], drain_seconds=0)
        removal = next(t for t in pool._background if t.get_name() == "remove:x")
        for _ in range(100):  # a few loop turns: the removal under way, out of the pool, not yet finished
            if pool.find("x") is None:
                break
            await asyncio.sleep(0)
        assert pool.find("x") is None and not removal.done()
        assert (await pool.reconcile([entry("a"), entry("x")], drain_seconds=0))["added"] == ["x"]
        await removal
        x = pool.get("x")
        assert pool.settings_of(x).url == "http://x" and x.health is Health.READY
        assert "x" in pool._tasks and not pool._tasks["x"].done(), "its scrape loop runs"
    finally:
        await pool.stop()


# -- a probe that times out while the proxy is being answered ------------------------------------------------
class SlowHealth(FakeEngine):
    """While ``hanging``, its health path never answers (a probe waits to its timeout), and says when it is
    asked (``asked``); everything else answers at once."""

    def __init__(self) -> None:
        super().__init__()
        self.hanging = False
        self.asked = asyncio.Event()

    async def async_handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health" and self.hanging:
            self.asked.set()
            await asyncio.Event().wait()  # (until the probe gives up)
        return self.handler(request)


def slow_pool(engine: SlowHealth) -> Pool:
    settings = BackendSettings(name="a", engine="llamacpp", url="http://a")

    def factory(s: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(engine.async_handler), base_url=s.url)

    return Pool([settings], ScrapeSettings(interval=60, timeout=0.2, stale_after=5), factory)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [FAKE_TIME], ids=["fake-time"])
async def test_a_probe_timing_out_while_the_backend_answers_requests_does_not_eject_it() -> None:
    """An event loop behind under load times out its own probes: the requests the backend answered meanwhile
    say it is up. Without them a timed-out probe still takes it out. (On a fake-time loop: each probe's 0.2 s
    timeout passes at once.)"""
    engine = SlowHealth()
    pool = slow_pool(engine)
    await pool.start()
    try:
        a = pool.get("a")
        assert a.health is Health.READY
        engine.hanging = True

        async def answering() -> None:
            await engine.asked.wait()  # while the probe waits for its answer
            a.answered += 1  # what the forwarder counts when a response head comes from it

        await asyncio.gather(pool.scrape_once(a), answering())
        assert a.health is Health.READY, a.detail
        assert a.scrape_errors == 1

        await pool.scrape_once(a)  # nothing answered while this one waited
        assert a.health is Health.DOWN and a.detail == "health check timed out"

        engine.asked.clear()
        await asyncio.gather(pool.scrape_once(a), answering())  # answers do not bring a down backend back
        assert a.health is Health.DOWN
        engine.hanging = False
        await pool.scrape_once(a)
        assert a.health is Health.READY
    finally:
        await pool.stop()


@pytest.mark.anyio
async def test_an_idle_llamacpp_loop_has_its_step_alone_measured_when_wanted_and_followers_are_told() -> None:
    """The stall guard's usual before any request taught it (sweep 30): the pool sends an idle llama-server a few
    tokens of a plain request, in the background, when the guard wants it; a follower takes it from the leader."""
    import orjson

    clock = ManualClock()
    engine = FakeEngine()
    pool = make_pool(engine, clock)
    wanted: list[str] = []
    told: list[tuple[str, float]] = []
    pool.wants_alone = lambda name: not wanted.append(name)  # (wanted each time)
    pool.on_alone = lambda name, seconds: told.append((name, seconds))
    await pool.start()
    try:
        assert engine.completions == 0 and not wanted, "busy: not measured"
        engine.busy = 0
        await pool.scrape_once(pool.get("a"))
        await until(lambda: told, "the measure")
        assert told == [("a", 0.004)] and engine.completions == 1 and pool.get("a").step_alone == 0.004
        pool.wants_alone = lambda name: False
        await pool.scrape_once(pool.get("a"))
        assert engine.completions == 1, "not wanted: not measured"
        follower_pool = follower(FakeEngine(), [], clock=clock)
        heard: list[tuple[str, float]] = []
        follower_pool.on_alone = lambda name, seconds: heard.append((name, seconds))
        await follower_pool.start()
        try:
            clock.advance(1)
            await pool.scrape_once(pool.get("a"))
            assert follower_pool.apply_snapshot(orjson.dumps(pool.snapshot()))
            assert heard == [("a", 0.004)] and follower_pool.get("a").step_alone == 0.004
        finally:
            await follower_pool.stop()
    finally:
        await pool.stop()
