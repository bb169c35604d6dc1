"""Each engine adapter against canned engine answers (httpx.MockTransport): health, load, capacity, models."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from gateway.engines.base import BackendError
from gateway.engines.registry import create_adapter
from gateway.pool.state import Health

pytestmark = pytest.mark.unit

Routes = dict[str, httpx.Response | Callable[[httpx.Request], httpx.Response]]


def client_for(routes: Routes, seen: list[httpx.Request] | None = None) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        answer = routes.get(request.url.path)
        if answer is None:
            return httpx.Response(404, json={"error": "no such route"})
        return answer(request) if callable(answer) else answer

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://backend")


LLAMACPP_METRICS = """# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234
"""

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048",hash_algo="sha256"} 1.0
"""


@pytest.mark.anyio
async def test_llamacpp_loading_is_not_ready_and_slots_give_load() -> None:
    loading = client_for({"/health": httpx.Response(
        503, json={"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})})
    assert (await create_adapter("llamacpp").probe(loading)).health is Health.LOADING

    slots = [{"id": i, "n_ctx": 4096, "is_processing": i < 2} for i in range(4)]
    client = client_for({
        "/health": httpx.Response(200, json={"status": "ok"}),
        "/slots": httpx.Response(200, json=slots),
        "/metrics": httpx.Response(200, text=LLAMACPP_METRICS),
        "/props": httpx.Response(200, json={"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}}),
    })
    adapter = create_adapter("llamacpp")
    assert (await adapter.probe(client)).health is Health.READY
    load = await adapter.read_load(client)
    assert load is not None and (load.running, load.waiting, load.kv_usage) == (2, 3, None)
    capacity = await adapter.read_capacity(client)
    assert (capacity.slots, capacity.context_length) == (4, 4096)


@pytest.mark.anyio
async def test_llamacpp_without_metrics_flag_still_reads_slots() -> None:
    seen: list[httpx.Request] = []
    client = client_for({
        "/slots": httpx.Response(200, json=[{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]),
        "/metrics": httpx.Response(501, json={"error": {"code": 501, "message": "This server does not support "
                                                        "metrics endpoint.", "type": "not_supported_error"}}),
    }, seen)
    adapter = create_adapter("llamacpp")
    load = await adapter.read_load(client)
    assert load is not None and (load.running, load.waiting) == (1, None)
    seen.clear()
    await adapter.read_load(client)
    assert [r.url.path for r in seen] == ["/slots"], "a 501 /metrics is not asked again"


@pytest.mark.anyio
async def test_vllm_metrics_are_summed_across_engines_and_capacity_from_models() -> None:
    client = client_for({
        "/health": httpx.Response(200),
        "/metrics": httpx.Response(200, text=VLLM_METRICS),
        "/v1/models": httpx.Response(200, json={"object": "list", "data": [
            {"id": "m", "object": "model", "max_model_len": 8192}]}),
    })
    adapter = create_adapter("vllm")
    load = await adapter.read_load(client)
    assert load is not None and (load.running, load.waiting, load.kv_usage) == (7, 4, 0.25)
    capacity = await adapter.read_capacity(client)
    assert (capacity.slots, capacity.context_length, capacity.cache_tokens) == (1024, 8192, 2048 * 16)
    assert capacity.page_tokens == 16  # (its block size: 64 by default from 0.34)
    assert await adapter.list_models(client) == ["m"]


@pytest.mark.anyio
async def test_sglang_is_probed_without_its_generating_health_endpoint() -> None:
    seen: list[httpx.Request] = []
    loads = {"timestamp": "t", "loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 1, "token_usage": 0.5,
         "max_running_requests": 48, "max_total_num_tokens": 100000},
        {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.7,
         "max_running_requests": 48, "max_total_num_tokens": 100000},
    ], "aggregate": {}}
    client = client_for({
        "/v1/models": httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 32768}]}),
        "/v1/loads": httpx.Response(200, json=loads),
    }, seen)
    adapter = create_adapter("sglang")
    assert (await adapter.probe(client)).health is Health.READY
    load = await adapter.read_load(client)
    assert load is not None and (load.running, load.waiting, load.kv_usage) == (4, 1, 0.7)
    capacity = await adapter.read_capacity(client)
    assert (capacity.slots, capacity.context_length) == (96, 32768)
    assert "/health" not in [r.url.path for r in seen]


@pytest.mark.anyio
async def test_tabbyapi_has_no_load_and_reports_the_loaded_model_only() -> None:
    seen: list[httpx.Request] = []
    client = client_for({
        "/health": httpx.Response(200, json={"status": "healthy", "issues": []}),
        "/v1/models": httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}, {"id": "c"}]}),
        "/v1/model": httpx.Response(200, json={"id": "b", "object": "model",
                                               "parameters": {"max_seq_len": 16384, "cache_size": 16384}}),
        "/props": httpx.Response(200, json={"total_slots": 6, "default_generation_settings": {"n_ctx": 16384}}),
    }, seen)
    adapter = create_adapter("tabbyapi")
    assert await adapter.read_load(client) is None
    assert await adapter.list_models(client) == ["b"]
    capacity = await adapter.read_capacity(client)
    assert (capacity.slots, capacity.context_length) == (6, 16384)
    assert adapter.spec.auth_headers("k") == {"x-api-key": "k"}


@pytest.mark.anyio
async def test_unreachable_backend_maps_to_backend_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse), base_url="http://backend")
    for engine in ("llamacpp", "vllm", "sglang", "tabbyapi", "openai"):
        with pytest.raises(BackendError, match="refused"):
            await create_adapter(engine).probe(client)


@pytest.mark.anyio
async def test_garbage_metrics_is_a_backend_error() -> None:
    client = client_for({"/metrics": httpx.Response(200, text="vllm:num_requests_running{ 1 2 3\n")})
    with pytest.raises(BackendError):
        await create_adapter("vllm").read_load(client)


def test_streaming_requests_always_ask_for_usage() -> None:
    adapter = create_adapter("vllm")
    body = adapter.prepare_body("chat", {"model": "m", "stream": True, "stream_options": {"foo": 1}})
    assert body["stream_options"] == {"foo": 1, "include_usage": True}
    assert "stream_options" not in adapter.prepare_body("chat", {"model": "m"})
