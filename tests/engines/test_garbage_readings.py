"""Every reading of an engine's endpoints treats garbage as no reading (httpx.MockTransport): NaN, Inf, negative
or huge numbers, wrong types, HTML where JSON belongs, answers too large to be what they say. The security
sweep's gateway would not start in front of a vLLM reporting ``vllm:num_requests_running NaN`` or a llama.cpp
answering ``/slots`` with an HTML page."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.engines.base import BackendError
from gateway.engines.exposition import MAX_SAMPLES
from gateway.engines.readings import MAX_ANSWER_BYTES, MAX_MODELS
from gateway.engines.registry import create_adapter
from tests.engines.test_adapters import client_for

pytestmark = pytest.mark.unit

GARBAGE_NUMBERS = ["NaN", "+Inf", "-Inf", "-1", "-1e308", "1e308", "1e30"]


@pytest.mark.anyio
@pytest.mark.parametrize("value", GARBAGE_NUMBERS)
async def test_a_vllm_gauge_that_is_no_count_is_no_reading(value: str) -> None:
    metrics = (f"vllm:num_requests_running {value}\nvllm:num_requests_waiting 3\n"
               f"vllm:kv_cache_usage_perc {value}\n")
    load = await create_adapter("vllm").read_load(client_for({"/metrics": httpx.Response(200, text=metrics)}))
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (None, 3, None), "the sound figure is kept"
    assert set(load.rejected) == {"running", "kv_usage"}


@pytest.mark.anyio
async def test_a_kv_share_outside_zero_to_one_is_no_reading() -> None:
    metrics = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 87.5\n"
    load = await create_adapter("vllm").read_load(client_for({"/metrics": httpx.Response(200, text=metrics)}))
    assert load is not None and (load.running, load.kv_usage, load.rejected) == (1, None, ("kv_usage",))


@pytest.mark.anyio
async def test_an_engine_queue_histogram_with_nan_counts_is_left_out() -> None:
    metrics = ("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n"
               'vllm:request_queue_time_seconds_bucket{le="0.1"} NaN\n'
               'vllm:request_queue_time_seconds_bucket{le="+Inf"} 4\n'
               "vllm:request_queue_time_seconds_sum 0.2\nvllm:request_queue_time_seconds_count 4\n")
    load = await create_adapter("vllm").read_load(client_for({"/metrics": httpx.Response(200, text=metrics)}))
    assert load is not None and load.queue_histogram is None and load.rejected == ("queue_histogram",)
    assert (load.running, load.kv_usage) == (1, 0.5)


@pytest.mark.anyio
async def test_an_exposition_of_more_wanted_samples_than_an_engine_writes_is_refused_unread_past_the_bound() -> None:
    """Sweep 16: 4 MiB of the queue histogram's bucket lines (70,000, each a new bound) were read, every one, at
    every scrape: ~0.3 s of the event loop each time, for every tenant. Reading stops at MAX_SAMPLES: the line
    after it, not a sample at all, is never reached; a large real one (8 engine ranks x 4 models) reads whole."""
    head = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    lines = "".join(f'vllm:request_queue_time_seconds_bucket{{le="{i}.5"}} 1\n' for i in range(MAX_SAMPLES + 1))
    hostile = head + lines + "vllm:request_queue_time_seconds_bucket{le=\"x\"} not-a-number\n"
    with pytest.raises(BackendError, match=f"more than {MAX_SAMPLES} lines"):
        await create_adapter("vllm").read_load(client_for({"/metrics": httpx.Response(200, text=hostile)}))
    # (sweep 17: lines that start with a wanted name and are no sample were skipped uncounted, ~90 ms a scrape)
    nameonly = head + "vllm:kv_cache_usage_perc\n" * (MAX_SAMPLES + 1) + "vllm:kv_cache_usage_perc x\n"
    with pytest.raises(BackendError, match=f"more than {MAX_SAMPLES} lines"):
        await create_adapter("vllm").read_load(client_for({"/metrics": httpx.Response(200, text=nameonly)}))
    real = head + "".join(
        f'vllm:request_queue_time_seconds_bucket{{engine="{rank}",model_name="m{m}",le="{le}"}} {n}\n'
        for rank in range(8) for m in range(4) for n, le in enumerate(
            ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "20.0", "40.0", "+Inf"]))
    load = await create_adapter("vllm").read_load(client_for({"/metrics": httpx.Response(200, text=real)}))
    assert load is not None and load.queue_histogram is not None and load.queue_histogram[0][-1] == ("+Inf", 352)


@pytest.mark.anyio
async def test_llamacpp_slots_answering_html_is_a_failed_reading_not_a_crash() -> None:
    client = client_for({"/slots": httpx.Response(200, text="<html>maintenance</html>",
                                                  headers={"content-type": "text/html"})})
    with pytest.raises(BackendError, match="/slots did not answer JSON"):
        await create_adapter("llamacpp").read_load(client)


@pytest.mark.anyio
async def test_llamacpp_slots_and_metrics_of_the_wrong_shape_are_no_reading() -> None:
    slots = [{"id": 0, "is_processing": "yes"}, {"id": 1, "is_processing": 1}, "slot", None,
             {"id": 2, "is_processing": True}]
    client = client_for({
        "/slots": httpx.Response(200, json=slots),
        "/metrics": httpx.Response(200, text="llamacpp:requests_deferred -4\nllamacpp:requests_processing 1\n"),
    })
    load = await create_adapter("llamacpp").read_load(client)
    assert load is not None and (load.running, load.waiting, load.rejected) == (1, None, ("waiting",))


@pytest.mark.anyio
@pytest.mark.parametrize("slots", ["4", True, -1, 0, 10**400, 1.5e300, None])
async def test_capacity_figures_of_the_wrong_type_or_size_are_unknown(slots: object) -> None:
    # (Python's JSON writes an integer of 400 digits; float() of it raises OverflowError)
    props = json.dumps({"total_slots": slots, "default_generation_settings": {"n_ctx": slots}})
    client = client_for({"/props": httpx.Response(200, content=props.encode()),
                         "/v1/model": httpx.Response(200, json={"id": "m", "parameters": {"max_seq_len": -8}})})
    for engine in ("llamacpp", "tabbyapi"):
        capacity = await create_adapter(engine).read_capacity(client)
        assert (capacity.slots, capacity.context_length, capacity.cache_tokens) == (None, None, None), engine


@pytest.mark.anyio
async def test_vllm_capacity_ignores_garbage_lengths_and_block_counts() -> None:
    client = client_for({
        "/metrics": httpx.Response(200, text='vllm:cache_config_info{block_size="16",num_gpu_blocks="'
                                             + "9" * 40 + '"} 1\n'),
        "/v1/models": httpx.Response(200, json={"data": [{"id": "a", "max_model_len": -5},
                                                         {"id": "b", "max_model_len": True},
                                                         {"id": "c", "max_model_len": 8192}]}),
    })
    capacity = await create_adapter("vllm").read_capacity(client)
    assert (capacity.context_length, capacity.cache_tokens) == (8192, None)


@pytest.mark.anyio
@pytest.mark.parametrize("running", [True, -3, "2", 10**30, 2.5e300])
async def test_sglang_loads_of_the_wrong_type_or_size_are_no_reading(running: object) -> None:
    loads = {"loads": [{"num_running_reqs": running, "num_waiting_reqs": 1, "token_usage": 0.5},
                       {"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 7}]}
    client = client_for({"/v1/loads": httpx.Response(200, content=json.dumps(loads).encode()),
                         "/metrics": httpx.Response(404)})
    load = await create_adapter("sglang").read_load(client)
    assert load is not None
    assert (load.running, load.waiting, load.kv_usage) == (None, 2, None), "one rank's garbage is no total"
    assert set(load.rejected) == {"running", "kv_usage"}


@pytest.mark.anyio
async def test_tabbyapi_naming_no_usable_model_is_a_backend_error() -> None:
    for card in ({"id": 42}, {"id": ""}, {"id": "x" * 5000}, ["m"]):
        client = client_for({"/v1/model": httpx.Response(200, json=card)})
        with pytest.raises(BackendError, match="names no loaded model"):
            await create_adapter("tabbyapi").list_models(client)


@pytest.mark.anyio
@pytest.mark.parametrize("declared", [True, False])
async def test_an_answer_larger_than_any_reading_is_refused_unread(declared: bool) -> None:
    big = b"vllm:num_requests_running 1\n" + b"#" * MAX_ANSWER_BYTES

    async def pieces() -> AsyncIterator[bytes]:  # (chunked: no Content-Length to refuse it by)
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    def stream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=big if declared else pieces())

    with pytest.raises(BackendError, match="more than"):
        await create_adapter("vllm").read_load(client_for({"/metrics": stream}))


@pytest.mark.anyio
async def test_a_model_list_is_read_up_to_one_more_than_the_pool_keeps() -> None:
    data = [{"id": 7}, {"id": "x" * 5000}, *({"id": f"m-{i}"} for i in range(5000))]
    names = await create_adapter("openai").list_models(client_for({"/v1/models": httpx.Response(200, json={
        "data": data})}))
    assert names == [f"m-{i}" for i in range(MAX_MODELS + 1)]


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_compressed_answer_is_refused_undecoded() -> None:
    """Sweep 13: httpx asks for gzip by default and decodes each piece whole before the size bound is checked:
    64 KiB of gzip became ~67 MB in one piece (~110 ms of the event loop each, and memory piling up), on every
    scrape of a hostile llama-server. The gateway asks for no encoding, and refuses one it gets, unread: here a
    real server's gzip bomb (16 MiB of zeros in 16 KiB) on /metrics."""
    import gzip

    from gateway.engines.base import get
    from tests.conftest import serve_in_thread

    bomb = gzip.compress(b"\0" * (16 << 20), compresslevel=9)
    asked: list[bytes] = []

    async def engine(scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        asked.append(dict(scope["headers"]).get(b"accept-encoding", b""))
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-encoding", b"gzip"), (b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": bomb})  # type: ignore[operator]

    with serve_in_thread(engine) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            with pytest.raises(BackendError, match="compressed"):
                await get(client, "/metrics")
            with pytest.raises(BackendError, match="compressed"):
                await create_adapter("vllm").read_load(client)
    assert asked and all(a == b"identity" for a in asked)
