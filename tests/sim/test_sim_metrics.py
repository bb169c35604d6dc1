"""/metrics per engine, parsed with prometheus_client: names, types, flags, llama.cpp's reset-per-scrape gauges."""

from __future__ import annotations

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim import FleetThread, SimServer
from tests.waiting import until


def families(text: str) -> dict[str, tuple[str, list[float]]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, [s.value for s in fam.samples])
    return out


def scrape(server: SimServer) -> httpx.Response:
    with httpx.Client(timeout=10) as c:
        return c.get(server.url + "/metrics")


def generate(server: SimServer, n: int = 5) -> None:
    with httpx.Client(timeout=10) as c:
        r = c.post(server.url + "/v1/completions", json={"model": "sim-llama-2-7b", "prompt": "x y z",
                                                         "max_tokens": n})
        assert r.status_code == 200


def test_vllm_metric_names_and_types(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-vllm"]
    generate(server)
    fams = families(scrape(server).text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info"):
        assert fams[name][0] == "gauge"
    for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:generation_tokens"):
        assert fams[name][0] == "counter"
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"):
        assert fams[name][0] == "histogram"
    assert fams["vllm:generation_tokens"][1][0] >= 5


def test_sglang_metrics_and_flag(fleet: FleetThread, make_spec) -> None:  # type: ignore[no-untyped-def]
    server = fleet.fleet["sim-sglang"]
    generate(server)
    fams = families(scrape(server).text)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"):
        assert fams[name][0] == "gauge"
    assert fams["sglang:cached_tokens"][0] == "counter"
    assert fams["sglang:time_to_first_token_seconds"][0] == "histogram"
    assert fams["sglang:queue_time_seconds"][0] == "histogram"


@pytest.mark.anyio
@pytest.mark.parametrize(("engine", "status"), [("sglang", 404), ("llamacpp", 501)])
async def test_metrics_off_behaves_as_without_the_flag(make_spec, engine: str, status: int) -> None:  # type: ignore[no-untyped-def]
    server = SimServer(make_spec(engine, metrics=False))
    await server.start()
    try:
        async with httpx.AsyncClient() as c:
            r = await c.get(server.url + "/metrics")
        assert r.status_code == status
    finally:
        await server.stop()


def test_llamacpp_gauges_reset_per_scrape(fleet: FleetThread) -> None:
    server = fleet.fleet["sim-llamacpp"]
    scrape(server)
    generate(server, 8)
    first = families(scrape(server).text)
    second = families(scrape(server).text)
    assert first["llamacpp:predicted_tokens_seconds"][0] == "gauge"
    assert first["llamacpp:predicted_tokens_seconds"][1][0] > 0
    assert second["llamacpp:predicted_tokens_seconds"][1][0] == 0  # averaged since the last scrape, then reset
    assert second["llamacpp:tokens_predicted"][1][0] == first["llamacpp:tokens_predicted"][1][0]  # counters stay
    assert {"llamacpp:requests_processing", "llamacpp:requests_deferred",
            "llamacpp:prompt_tokens_cached"} <= set(first)


@pytest.mark.anyio
async def test_running_and_waiting_gauges_under_load(make_spec) -> None:  # type: ignore[no-untyped-def]
    server = SimServer(make_spec("vllm", time_scale=5.0, overrides={"max_seqs": 2}))
    await server.start()
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            async def one() -> None:
                await c.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 1000,
                                                                   "ignore_eos": True})

            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(one)
                await until(lambda: server.stats.waiting == 3, "three requests waiting")
                fams = families((await c.get(server.url + "/metrics")).text)
                tg.cancel_scope.cancel()
        assert fams["vllm:num_requests_running"][1] == [2.0]
        assert fams["vllm:num_requests_waiting"][1] == [3.0]
        assert fams["vllm:kv_cache_usage_perc"][1][0] > 0
    finally:
        await server.stop()
