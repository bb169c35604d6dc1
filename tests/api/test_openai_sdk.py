"""Every OpenAI route through the gateway with the official SDK, sync and async, streaming and not, on
each emulated engine."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import ENGINES, Running
from tests.waiting import wait_until

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="client-key", max_retries=0)


def counter(running: Running, name: str, **labels: str) -> float:
    import httpx

    text = httpx.get(running.url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_models_are_the_union_of_healthy_backends(engines: Running) -> None:
    ids = sorted(m.id for m in client(engines).models.list())
    assert ids == sorted(f"m-{e}" for e in ENGINES)
    assert client(engines).models.retrieve("m-vllm").id == "m-vllm"
    with pytest.raises(openai.NotFoundError):
        client(engines).models.retrieve("nope")


@pytest.mark.parametrize("engine", ENGINES)
def test_chat_non_streaming_and_streaming_agree_on_usage(engines: Running, engine: str) -> None:
    c = client(engines)
    raw = c.chat.completions.with_raw_response.create(model=f"m-{engine}", messages=MESSAGES, max_tokens=12,
                                                      extra_headers={"x-request-id": "req-123"})
    assert raw.headers["x-gateway-backend"] == f"sim-{engine}"
    assert raw.headers["x-request-id"] == "req-123"
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage is not None
    assert 0 < reply.usage.completion_tokens <= 12

    chunks = list(c.chat.completions.create(model=f"m-{engine}", messages=MESSAGES, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    usage_chunks = [ch for ch in chunks if ch.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)


@pytest.mark.parametrize("engine", ENGINES)
def test_usage_is_counted_even_when_the_client_did_not_ask_for_it(engines: Running, engine: str) -> None:
    c = client(engines)
    model = f"m-{engine}"
    expected_prompt = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    before = counter(engines, "gateway_prompt_tokens_total", backend=f"sim-{engine}")
    chunks = list(c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, stream=True))
    assert all(ch.usage is None for ch in chunks), "the usage chunk the gateway asked for is removed"
    assert all(ch.choices for ch in chunks)
    # accounted right after the last byte is sent (the whole request in one step): once
    wait_until(lambda: counter(engines, "gateway_prompt_tokens_total", backend=f"sim-{engine}") - before
               >= expected_prompt, "the stream's usage accounted")
    assert counter(engines, "gateway_prompt_tokens_total", backend=f"sim-{engine}") - before == expected_prompt


@pytest.mark.parametrize("engine", ENGINES)
def test_completions_streaming_and_not(engines: Running, engine: str) -> None:
    c = client(engines)
    reply = c.completions.create(model=f"m-{engine}", prompt="Once upon a time", max_tokens=6)
    assert reply.choices[0].text and reply.usage is not None and reply.usage.completion_tokens <= 6
    chunks = list(c.completions.create(model=f"m-{engine}", prompt="Once upon a time", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


@pytest.mark.parametrize("engine", ENGINES)
def test_embeddings(engines: Running, engine: str) -> None:
    result = client(engines).embeddings.create(model=f"m-{engine}", input=["hello", "world"])
    assert len(result.data) == 2 and len(result.data[0].embedding) > 0


@pytest.mark.anyio
async def test_async_client_streams_concurrently(engines: Running) -> None:
    import asyncio

    c = openai.AsyncOpenAI(base_url=engines.url + "/v1", api_key="x", max_retries=0)

    async def one(engine: str) -> str:
        stream = await c.chat.completions.create(model=f"m-{engine}", messages=MESSAGES, max_tokens=10, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    texts = await asyncio.gather(*(one(e) for e in ENGINES for _ in range(3)))
    assert all(texts)
    reply = await c.chat.completions.create(model="m-sglang", messages=MESSAGES, max_tokens=4)
    assert reply.choices[0].message.content
    await c.close()


def test_backend_keys_are_used_and_client_keys_never_forwarded(engines: Running) -> None:
    client(engines).chat.completions.create(model="m-tabbyapi", messages=MESSAGES, max_tokens=2)
    client(engines).chat.completions.create(model="m-vllm", messages=MESSAGES, max_tokens=2)
    tabby = [r for r in list(engines.server("sim-tabbyapi").received) if r.path == "/v1/chat/completions"][-1]
    vllm = [r for r in list(engines.server("sim-vllm").received) if r.path == "/v1/chat/completions"][-1]
    assert tabby.headers.get("x-api-key") == "key-tabbyapi"
    assert vllm.headers.get("authorization") == "Bearer key-vllm"
    for recorded in (tabby, vllm):
        assert "client-key" not in str(recorded.headers)
        assert len(recorded.headers.get("x-request-id", "")) >= 16, "the request id travels upstream"
