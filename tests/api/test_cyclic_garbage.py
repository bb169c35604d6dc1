"""A request leaves nothing for the cyclic garbage collector, whose full collections stop the event loop (up to
180 ms in a fairness run, the light key's slowest first tokens): what a served or refused request made must be
freed by reference counting alone. Checked with ``gc.DEBUG_SAVEALL``, which keeps what the collector finds in
``gc.garbage`` instead of freeing it, counted by type."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import gateway_settings
from tests.conftest import serve_in_thread

ASK = [{"role": "user", "content": "hi"}]


def _ours(obj: object, port: int | None) -> bool:
    """Whether ``obj`` is of the gateway on ``port``: other tests' servers may still run in this process's
    threads, and their connections closing meanwhile leave uvicorn's own per-connection cycles."""
    kind = type(obj).__qualname__
    if port is None or kind not in ("RequestResponseCycle", "BodyWriter"):
        return True
    server = obj.scope.get("server") if kind == "RequestResponseCycle" else obj._protocol.server  # type: ignore[attr-defined]
    return server is None or server[1] == port


@contextmanager
def cyclic_garbage(port: int | None = None) -> Iterator[Counter[str]]:
    """The types of the objects the cyclic collector finds between entry and exit (filled in on exit); with
    ``port``, of request cycles and body writers only those of the server on that port."""
    found: Counter[str] = Counter()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.update(type(o).__qualname__ for o in gc.garbage if _ours(o, port))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_requests_on_a_kept_alive_connection_leave_no_cyclic_garbage() -> None:
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=20.0)]) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers))
        with serve_in_thread(app) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as http:
            http.get("/health")  # the connection
            with cyclic_garbage(gateway.port) as found:
                for i in range(20):
                    body = {"model": "m", "messages": ASK, "max_tokens": 8, "stream": i % 2 == 0}
                    r = http.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200
    # the protocol's cycle, its scope and the scope's body writer referred to each other: one cycle per request
    assert found["RequestResponseCycle"] == 0, found.most_common(12)
    assert found["BodyWriter"] == 0, found.most_common(12)


def test_requests_refused_by_the_queue_leave_no_cyclic_garbage() -> None:
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=1.0)]) as fleet:
        settings = gateway_settings(fleet.fleet.servers, admission={"queue_size": 1, "max_wait_seconds": 20})
        raw = settings.model_dump(mode="json")
        raw["backends"] = [{**b, "max_concurrency": 1} for b in raw["backends"]]
        app = create_app(settings_from_mapping(raw))
        with serve_in_thread(app) as gateway:
            async def burst() -> list[int]:
                async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
                    answers = await asyncio.gather(*(
                        http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 20})
                        for _ in range(8)))
                return [a.status_code for a in answers]

            with cyclic_garbage() as found:
                statuses = asyncio.run(burst())
    assert statuses.count(429) >= 5, statuses  # one slot, one place in the queue
    # a refusal kept on its ticket held the frames that held the ticket: a cycle per refused request
    assert found["Refused"] == 0, found.most_common(12)


def test_agent_api_requests_leave_no_cyclic_garbage() -> None:
    """A Responses or Messages request's translation, its exchange and its request referred to each other: every
    body stayed until a full collection (a tenant pushed a gateway to 4.3 GB with continuations)."""
    with FleetThread([SimSpec(engine="llamacpp", model="m", name="l", time_scale=20.0)]) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers))
        with serve_in_thread(app) as gateway, httpx.Client(base_url=gateway.url, timeout=30) as http:
            http.get("/health")
            with cyclic_garbage(gateway.port) as found:
                for i in range(6):
                    stream = i % 2 == 0
                    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 8,
                                                         "stream": stream})
                    assert r.status_code == 200, r.text
                    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 8, "stream": stream,
                                                        "messages": [{"role": "user", "content": "hi"}]})
                    assert r.status_code == 200, r.text
    assert not {kind for kind in found if kind.startswith(("_Responses", "_Messages", "Exchange", "RouteRequest"))}, \
        found.most_common(12)
