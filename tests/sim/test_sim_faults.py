"""Fault injection (flags and admin endpoint), loading, crash/restart, and client disconnects."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from gateway.sim import FleetThread, SimServer
from tests.waiting import until_true, wait_until

CHAT = {"model": "sim-llama-2-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang", "tabbyapi"])
def test_error_rate_answers_in_engine_shape(fleet: FleetThread, engine: str) -> None:
    server = fleet.fleet[f"sim-{engine}"]
    with httpx.Client(timeout=10) as c:
        r = c.post(server.url + "/sim/faults", json={"error_rate": 1.0, "error_status": 503})
        assert r.json()["error_rate"] == 1.0
        try:
            bad = c.post(server.url + "/v1/chat/completions", json=CHAT)
            health = c.get(server.url + "/health")
        finally:
            c.post(server.url + "/sim/faults", json={"error_rate": 0})
        ok = c.post(server.url + "/v1/chat/completions", json=CHAT)
    assert bad.status_code == 503 and ok.status_code == 200 and health.status_code == 200
    body = bad.json()
    key = "detail" if engine == "tabbyapi" else ("message" if engine == "sglang" else "error")
    assert key in body


def test_llamacpp_loading_answers_503_everywhere(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-llamacpp"]
    server.faults.loading = True
    try:
        with httpx.Client(timeout=10) as c:
            rs = [c.get(server.url + "/health"), c.post(server.url + "/v1/chat/completions", json=CHAT)]
    finally:
        server.faults.loading = False
    for r in rs:
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


@pytest.mark.anyio
async def test_slow_start_per_engine(make_spec) -> None:  # type: ignore[no-untyped-def]
    llama = SimServer(make_spec("llamacpp", time_scale=1.0, load_seconds=0.6))
    vllm = SimServer(make_spec("vllm", time_scale=1.0, load_seconds=0.6))
    await llama.start()
    await vllm.start()
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            assert (await c.get(llama.url + "/health")).status_code == 503
            with pytest.raises(httpx.ConnectError):
                await c.get(vllm.url + "/health")

            async def healthy(url: str) -> bool:
                with contextlib.suppress(httpx.ConnectError):
                    return (await c.get(url + "/health")).status_code == 200
                return False

            await until_true(lambda: healthy(llama.url), "llama.cpp loaded")
            await until_true(lambda: healthy(vllm.url), "vLLM loaded")
    finally:
        await llama.stop()
        await vllm.stop()


def test_hang_before_first_byte(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-vllm"]
    server.faults.hang_before_first_byte = True
    try:
        with httpx.Client(timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
            c.post(server.url + "/v1/chat/completions", json=CHAT)
    finally:
        server.faults.hang_before_first_byte = False


def test_drop_mid_stream(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-sglang"]
    server.faults.drop_mid_stream_after_tokens = 3
    got = b""
    try:
        with httpx.Client(timeout=10) as c, pytest.raises(httpx.RemoteProtocolError):  # noqa: SIM117
            with c.stream("POST", server.url + "/v1/chat/completions",
                          json={**CHAT, "max_tokens": 20, "stream": True}) as r:
                for chunk in r.iter_bytes():
                    got += chunk
    finally:
        server.faults.drop_mid_stream_after_tokens = None
    assert got.count(b'"finish_reason":null') >= 3 and b"[DONE]" not in got


def test_drop_mid_stream_cuts_the_native_agent_streams_too(fleet: FleetThread) -> None:
    """QA: the fault cut chat streams only; a native Messages or Responses stream ran to its end, so the
    gateway's handling of a cut native stream could not be tried."""
    server = fleet.fleet["sim-sglang"]
    server.faults.drop_mid_stream_after_tokens = 3
    asks = [("/v1/messages", {"model": CHAT["model"], "max_tokens": 20, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}, b"message_stop"),
            ("/v1/responses", {"model": CHAT["model"], "max_output_tokens": 20, "stream": True, "input": "hi"},
             b"response.completed")]
    try:
        for path, body, end in asks:
            got = b""
            with httpx.Client(timeout=10) as c, pytest.raises(httpx.RemoteProtocolError):  # noqa: SIM117
                with c.stream("POST", server.url + path, json=body) as r:
                    for chunk in r.iter_bytes():
                        got += chunk
            assert got and end not in got, (path, got[-300:])
    finally:
        server.faults.drop_mid_stream_after_tokens = None


def test_client_disconnect_aborts_the_sequence(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-vllm"]
    before = server.stats.cancelled
    with httpx.Client(timeout=10) as c, c.stream("POST", server.url + "/v1/chat/completions",
                                                  json={**CHAT, "max_tokens": 2000, "stream": True}) as r:
        it = r.iter_bytes()
        next(it)
        next(it)
    wait_until(lambda: server.stats.cancelled == before + 1, "the sequence cancelled")
    wait_until(lambda: server.stats.active_sequences == 0, "no sequence active")
    assert server.stats.last_cancel_time is not None


def test_crash_then_restart_on_the_same_port(make_spec) -> None:  # type: ignore[no-untyped-def]
    with FleetThread([make_spec("tabbyapi")]) as ft:
        server = ft.fleet.servers[0]
        port = server.port
        with httpx.Client(timeout=5) as c:
            assert c.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
            assert server.stats.completed == 1
            ft.loop.call_soon_threadsafe(server.faults.crash)
            wait_until(lambda: not server.running, "the server crashed")
            # (on a new connection: the kept-alive one may still be open here, then reset by the crash, ReadError)
            with pytest.raises(httpx.ConnectError):
                httpx.get(server.url + "/health", timeout=5)
            ft.call(server.start())
            assert server.port == port and server.stats.completed == 0  # a fresh process
            assert c.get(server.url + "/health").status_code == 200


def test_stop_closes_open_streams(make_spec) -> None:  # type: ignore[no-untyped-def]
    with FleetThread([make_spec("llamacpp", time_scale=1.0)]) as ft:
        server = ft.fleet.servers[0]
        with httpx.Client(timeout=10) as c, pytest.raises(httpx.RemoteProtocolError):  # noqa: SIM117
            with c.stream("POST", server.url + "/v1/chat/completions",
                          json={**CHAT, "max_tokens": 500, "stream": True}) as r:
                for i, _ in enumerate(r.iter_bytes()):
                    if i == 1:
                        ft.call(server.stop())


def test_admin_endpoints_record_requests(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-tabbyapi"]
    with httpx.Client(timeout=10) as c:
        c.post(server.url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": "k1"})
        recent = c.get(server.url + "/sim/requests").json()
        stats = c.get(server.url + "/sim/stats").json()
        bad = c.post(server.url + "/sim/faults", json={"nope": 1})
    assert recent[-1]["path"] == "/v1/chat/completions" and recent[-1]["body"]["max_tokens"] == 3
    assert recent[-1]["headers"]["x-api-key"] == "k1"
    assert server.received[-1].body == CHAT
    assert stats["emulated"] is True and stats["requests"] >= 1
    assert bad.status_code == 400
