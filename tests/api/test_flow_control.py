"""Flow control through the gateway, over HTTP, in front of emulated engines: fair shares between keys,
priorities from keys and headers, shedding with an honest Retry-After, the engines' own priority field, and
the metrics autoscalers read."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.proxy.admission import Admission, Ticket
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import Running, gateway_settings
from tests.conftest import serve_in_thread
from tests.waiting import until

ASK = [{"role": "user", "content": "hi"}]
KEYS = {"flood": "sk-flood", "light": "sk-light", "ops": "sk-ops", "batch": "sk-batch"}


def digest(name: str) -> str:
    return hashlib.sha256(KEYS[name].encode()).hexdigest()


def running(specs: list[SimSpec], backend: dict[str, Any] | None = None, **extra: Any) -> Iterator[Running]:
    with FleetThread(specs) as fleet:
        settings = gateway_settings(fleet.fleet.servers, **extra)
        if backend:
            raw = settings.model_dump(mode="json")
            raw["backends"] = [{**b, **backend} for b in raw["backends"]]
            from gateway.config import settings_from_mapping

            settings = settings_from_mapping(raw)
        app = create_app(settings)
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


AUTH = {"keys": [
    {"name": "flood", "key_sha256": digest("flood")},
    {"name": "light", "key_sha256": digest("light")},
    {"name": "ops", "key_sha256": digest("ops"), "max_priority": "critical"},
    {"name": "batch", "key_sha256": digest("batch"), "priority": "sheddable"},
]}


@pytest.fixture(scope="module")
def one_slot() -> Iterator[Running]:
    """One vLLM emulator at its real speed, one request at a time (max_concurrency 1): ~0.25 s each."""
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=1.0)]
    yield from running(specs, backend={"max_concurrency": 1}, auth=AUTH,
                       admission={"queue_size": 64, "max_wait_seconds": 20})


async def post(client: httpx.AsyncClient, key: str, tag: str, finished: list[str], max_tokens: int = 40,
               headers: dict[str, str] | None = None) -> httpx.Response:
    # (every answer exactly max_tokens long: an emulated answer otherwise stops at a random natural length, and
    # a test about order then meets a long request that happened to end at once)
    body = {"model": "m", "messages": [{"role": "user", "content": f"{tag}: hi"}], "max_tokens": max_tokens,
            "ignore_eos": True}
    response = await client.post("/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEYS[key]}", **(headers or {})})
    finished.append(tag)
    return response


def taken_in(r: Running, finished: list[str]) -> int:
    """Requests the gateway has taken in so far: waiting in its queue, on the backend, or answered."""
    return r.app.gateway.admission.waiting + r.app.gateway.pool.get("v").in_flight + len(finished)


def test_a_flooding_key_does_not_delay_another_keys_request_behind_its_backlog(one_slot: Running) -> None:
    async def scenario() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=60) as client:
            flood = [asyncio.create_task(post(client, "flood", f"f{i}", finished)) for i in range(8)]
            await until(lambda: taken_in(one_slot, finished) >= 8, "the flood in the slot and the queue")
            light = await post(client, "light", "light", finished)
            assert light.status_code == 200
            assert all(r.status_code == 200 for r in await asyncio.gather(*flood))
        return finished

    finished = asyncio.run(scenario())
    # FIFO would finish it last; its fair share puts it right behind the request in the slot (and at most one
    # flood request woken as it arrived)
    assert finished.index("light") <= 3, finished


def test_priority_from_the_header_within_the_keys_ceiling(one_slot: Running) -> None:
    async def scenario() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=60) as client:
            first = asyncio.create_task(post(client, "light", "running", finished, max_tokens=100))
            await until(lambda: taken_in(one_slot, finished) >= 1, "the first request in the slot")
            low = [asyncio.create_task(post(client, "batch", f"batch{i}", finished)) for i in range(4)]
            await until(lambda: taken_in(one_slot, finished) >= 5, "the sheddable requests queued")
            crit = await post(client, "ops", "critical", finished, headers={"x-gateway-priority": "critical"})
            assert crit.status_code == 200
            assert all(r.status_code == 200 for r in await asyncio.gather(first, *low))  # the low band still ran
        return finished

    finished = asyncio.run(scenario())
    assert finished.index("critical") <= 2, finished  # ahead of the sheddable requests queued before it


def test_bad_or_unallowed_priority_and_deadline_headers_are_refused_in_the_openai_shape(one_slot: Running) -> None:
    def ask(key: str, **headers: str) -> httpx.Response:
        return httpx.post(one_slot.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 2},
                          headers={"authorization": f"Bearer {KEYS[key]}", **headers}, timeout=30)

    denied = ask("light", **{"x-gateway-priority": "critical"})
    assert denied.status_code == 403
    assert denied.json()["error"]["code"] == "priority_not_allowed"
    assert denied.json()["error"]["param"] == "x-gateway-priority"
    bad = ask("ops", **{"x-gateway-priority": "urgent"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_priority"
    assert "critical, standard, sheddable" in bad.json()["error"]["message"]
    late = ask("light", **{"x-gateway-deadline-ms": "soon"})
    assert late.status_code == 400 and late.json()["error"]["code"] == "invalid_deadline"
    # digits that are not ASCII ("²".isdigit() is true in Python, and int("²") raises): 400, not 500
    for name, code in (("x-gateway-deadline-ms", "invalid_deadline"), ("x-gateway-priority", "invalid_priority")):
        odd = httpx.post(one_slot.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 2},
                         headers={"authorization": f"Bearer {KEYS['ops']}", name: b"\xb2"}, timeout=30)
        assert odd.status_code == 400 and odd.json()["error"]["code"] == code, odd.text
    assert ask("light", **{"x-gateway-priority": "sheddable", "x-gateway-deadline-ms": "5000"}).status_code == 200


def test_a_request_that_cannot_be_served_before_its_deadline_is_refused_at_once(one_slot: Running) -> None:
    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=one_slot.url, timeout=60) as client:
            # the model's completion rate, measured by admission while it is busy (six at once on one slot)
            await asyncio.gather(*(post(client, "flood", f"warm{i}", finished, max_tokens=10) for i in range(6)))
            backlog = [asyncio.create_task(post(client, "flood", f"b{i}", finished)) for i in range(8)]
            await until(lambda: taken_in(one_slot, finished) >= 6 + 8, "the backlog in the slot and the queue")
            hurried = await post(client, "flood", "hurried", finished,
                                 headers={"x-gateway-deadline-ms": "200"})
            return await asyncio.gather(*backlog), hurried

    backlog, hurried = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in backlog)
    assert hurried.status_code == 429, hurried.text
    error = hurried.json()["error"]
    # refused at once on its predicted wait (not queue_timeout: after waiting out its deadline)
    assert error["code"] == "queue_deadline" and "requests ahead" in error["message"]
    assert int(hurried.headers["retry-after"]) >= 1
    metrics = httpx.get(one_slot.url + "/metrics").text
    assert 'gateway_admission_refusals_total{band="standard",key="flood",model="m",reason="deadline"} 1.0' in metrics
    # the refusal is the model's and a shed one, not a client error the error-rate alert leaves out
    shed = [line for line in metrics.splitlines()
            if line.startswith("gateway_requests_total{") and 'outcome="shed"' in line]
    assert shed and all('model="m"' in line and 'status_class="4xx"' in line for line in shed), shed


def test_flow_metrics_for_dashboards_and_autoscalers(one_slot: Running) -> None:
    httpx.post(one_slot.url + "/v1/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 2},
               headers={"authorization": f"Bearer {KEYS['batch']}"}, timeout=30)
    metrics = httpx.get(one_slot.url + "/metrics").text
    assert 'gateway_admissions_total{band="sheddable",key="batch",model="m"}' in metrics
    assert 'gateway_admission_wait_seconds_bucket{band="sheddable",le="0.001",model="m"}' in metrics
    assert 'gateway_queue_depth{band="critical",model="m"} 0.0' in metrics
    assert 'gateway_model_slots{model="m"} 1.0' in metrics
    assert 'gateway_model_saturation{model="m"} 0.0' in metrics


def test_the_sheddable_band_leaves_the_last_tenth_of_the_slots_to_the_others() -> None:
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=1.0)]
    for r in running(specs, backend={"max_concurrency": 10}, auth=AUTH):
        backend = r.app.gateway.pool.get("v")

        async def scenario(r: Running = r, backend: Any = backend) -> tuple[int, list[str]]:
            finished: list[str] = []
            async with httpx.AsyncClient(base_url=r.url, timeout=60) as client:
                batch = [asyncio.create_task(post(client, "batch", f"batch{i}", finished, max_tokens=150))
                         for i in range(10)]
                # every one on the backend or queued: the tenth has taken the last slot or been held back
                await until(lambda: taken_in(r, finished) >= 10, "the ten batch requests taken in")
                held = backend.in_flight  # 9 of 10: sheddable stops below 90%
                urgent = await post(client, "light", "standard", finished, max_tokens=4)
                assert urgent.status_code == 200
                assert all(b.status_code == 200 for b in await asyncio.gather(*batch))
            return held, finished

        held, finished = asyncio.run(scenario())
        assert held == 9
        assert finished[0] == "standard", finished  # it found the slot kept free, ahead of every batch answer


# -- the engines' own priority field -----------------------------------------------------------------------------
def sent_priorities(r: Running, name: str) -> list[Any]:
    return [q.body.get("priority", "absent") for q in list(r.server(name).received) if q.path == "/v1/chat/completions"]


def test_an_engine_with_priority_scheduling_gets_the_priority_in_its_own_order() -> None:
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=40.0, priority_scheduling=True),
             SimSpec(engine="sglang", model="s", name="s", time_scale=40.0, priority_scheduling=True)]
    for r in running(specs, backend={"priority_scheduling": True}, auth=AUTH):
        for model in ("m", "s"):
            for key, header in (("ops", "critical"), ("batch", None), ("light", None)):
                headers = {"authorization": f"Bearer {KEYS[key]}",
                           **({"x-gateway-priority": header} if header else {})}
                answer = httpx.post(r.url + "/v1/chat/completions", headers=headers, timeout=30,
                                    json={"model": model, "messages": ASK, "max_tokens": 2, "priority": 999})
                assert answer.status_code == 200, answer.text
        # vLLM: lower first (critical 100 -> -100); SGLang: higher first; the client's own field overridden
        assert sent_priorities(r, "v") == [-100, 100, 0]
        assert sent_priorities(r, "s") == [100, -100, 0]


def test_an_engine_without_it_gets_no_priority_field_from_the_gateway_nor_from_the_client() -> None:
    """Without ``priority_scheduling`` declared the gateway sends no priority, and removes the client's: an engine
    run with a priority policy the gateway was not told of would let a key reorder every tenant's requests in its
    queue (vLLM 0.34 no longer refuses the field without its policy, so nothing else would stop it)."""
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=40.0)]
    for r in running(specs, auth=AUTH):
        headers = {"authorization": f"Bearer {KEYS['ops']}", "x-gateway-priority": "critical"}
        answer = httpx.post(r.url + "/v1/chat/completions", timeout=30, headers=headers,
                            json={"model": "m", "messages": ASK, "max_tokens": 2, "priority": -1000})
        assert answer.status_code == 200, answer.text
        assert sent_priorities(r, "v") == ["absent"]
        answer = httpx.post(r.url + "/v1/responses", timeout=30, headers=headers,  # (no such Responses field)
                            json={"model": "m", "input": "hi", "max_output_tokens": 2, "priority": -1000})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "priority", answer.text


def test_priority_scheduling_is_refused_for_an_engine_without_it() -> None:
    from gateway.config import ConfigError, settings_from_mapping

    with pytest.raises(ConfigError, match="does not schedule by a request priority"):
        settings_from_mapping({"backends": [{"name": "t", "engine": "tabbyapi", "url": "http://t",
                                             "priority_scheduling": True}]})


def queued_first(admission: Admission, key: str) -> list[bool]:
    """Whether each request of ``key`` admitted from now on queued before it got its backend."""
    waited: list[bool] = []
    admitted = admission.admitted

    def seen(ticket: Ticket) -> None:
        if ticket.key == key:
            waited.append(ticket.waited)
        admitted(ticket)

    admission.admitted = seen  # type: ignore[method-assign]
    return waited


def test_a_light_key_beside_a_flood_gets_a_kept_slot_at_once_and_the_flood_the_rest() -> None:
    """Four slots, a key flooding them with 12 streams at a time, and a light key sending one request after
    another: with slots kept for light keys the light key's requests start at once (its time to first byte
    is the engine's), without it each waits for the next slot the flood frees. Both seen in one run."""
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=1.0)]

    async def scenario(r: Running) -> int:
        finished: list[str] = []
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=r.url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            async def flooder(i: int) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    assert (await post(client, "flood", f"f{i}-{n}", finished, max_tokens=48)).status_code == 200

            flood = [asyncio.create_task(flooder(i)) for i in range(12)]
            admission, backend = r.app.gateway.admission, r.app.gateway.pool.get("v")
            await until(lambda: backend.in_flight == 4 and admission.waiting, "the flood in every slot, and queued")
            for i in range(8):
                body = {"model": "m", "messages": [{"role": "user", "content": f"light {i}"}], "max_tokens": 8,
                        "stream": True, "ignore_eos": True}
                async with client.stream("POST", "/v1/chat/completions", json=body,
                                         headers={"authorization": f"Bearer {KEYS['light']}"}) as response:
                    assert response.status_code == 200
                    assert [chunk async for chunk in response.aiter_bytes()]
                # real time: a light key's pace (admission keeps it slots by its rate over reserve_window_seconds)
                await asyncio.sleep(0.15)
            stop.set()
            await asyncio.gather(*flood)
        return sum(1 for tag in finished if tag.startswith("f"))

    waits: dict[bool, list[bool]] = {}  # whether each of the light key's requests queued, with slots kept or not
    with FleetThread(specs) as fleet:
        for keep in (True, False):
            settings = gateway_settings(fleet.fleet.servers, auth=AUTH,
                                        admission={"queue_size": 64, "reserve_for_light_keys": keep})
            raw = settings.model_dump(mode="json")
            raw["backends"][0]["max_concurrency"] = 4
            from gateway.config import settings_from_mapping

            app = create_app(settings_from_mapping(raw))
            waits[keep] = queued_first(app.gateway.admission, "light")
            with serve_in_thread(app) as gateway:
                flooded = asyncio.run(scenario(Running(fleet, gateway, app)))
                assert flooded > 10  # the flood still ran on the other slots
    # kept: each of its requests after the first (before which it had no use to keep a slot for) takes one at
    # once; without: each waits in the queue for the next slot the flood frees
    assert len(waits[True]) == len(waits[False]) == 8, waits
    assert not any(waits[True][1:]), waits
    assert all(waits[False]), waits
