"""Each engine's OpenAI API through the official OpenAI SDK: sync and async, streamed and not."""

from __future__ import annotations

import openai
import pytest

from gateway.sim import Fleet, FleetThread, default_fleet_specs
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import Tokenizer
from tests.sim.conftest import ask_usage

ENGINES = ("llamacpp", "vllm", "sglang", "tabbyapi")
MODEL = "sim-llama-2-7b"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello, please."}]


def client(fleet: FleetThread, engine: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.fleet[f"sim-{engine}"].url + "/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_chat_non_streamed_usage_is_exact(fleet: FleetThread, engine: str) -> None:
    with client(fleet, engine) as c:
        out = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7,  # type: ignore[arg-type]
                                        extra_body=ask_usage(engine))
    expected_prompt = len(Tokenizer().encode(render_chat(MESSAGES)))
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content
    assert out.usage is not None
    assert out.usage.prompt_tokens == expected_prompt
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == expected_prompt + 7


@pytest.mark.parametrize("engine", ENGINES)
def test_chat_streamed_with_usage_chunk(fleet: FleetThread, engine: str) -> None:
    with client(fleet, engine) as c:
        stream = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, stream=True,  # type: ignore[arg-type]
                                           stream_options={"include_usage": True})
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage_chunks = [ch for ch in chunks if ch.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert usage_chunks[0].usage is not None and usage_chunks[0].usage.completion_tokens == 9
    assert len(Tokenizer.pieces(text)) == 9
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    if engine == "tabbyapi":  # TabbyAPI's usage chunk keeps a choice (carrying the finish reason)
        assert len(usage_chunks[0].choices) == 1
    else:
        assert usage_chunks[0].choices == []


@pytest.mark.parametrize("engine", ENGINES)
def test_stream_without_include_usage_has_no_usage(fleet: FleetThread, engine: str) -> None:
    with client(fleet, engine) as c:
        chunks = list(c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True))
    assert all(ch.usage is None for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ENGINES)
async def test_async_sdk_streamed_and_not(engine: str) -> None:
    fleet = Fleet(default_fleet_specs(base_port=0, time_scale=50)[ENGINES.index(engine):][:1])
    await fleet.start()
    try:
        async with openai.AsyncOpenAI(base_url=fleet.servers[0].url + "/v1", api_key="x", max_retries=0) as c:
            whole = await c.completions.create(model=MODEL, prompt="Tell me", max_tokens=5,
                                               extra_body=ask_usage(engine))
            assert whole.usage is not None and whole.usage.completion_tokens == 5
            stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True)  # type: ignore[arg-type]
            pieces = [ch.choices[0].delta.content async for ch in stream if ch.choices and ch.choices[0].delta.content]
            assert len(pieces) == 6
            models = await c.models.list()
            assert [m.id for m in models.data] == [MODEL]
            emb = await c.embeddings.create(model=MODEL, input=["a b c", "d"])
            assert len(emb.data) == 2 and abs(sum(v * v for v in emb.data[0].embedding) - 1.0) < 1e-6
    finally:
        await fleet.stop()


def test_vllm_unknown_model_is_404_in_vllm_shape(fleet: FleetThread) -> None:
    with client(fleet, "vllm") as c, pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and "does not exist" in body["message"] and body["code"] == 404


@pytest.mark.parametrize("engine", ["llamacpp", "tabbyapi", "sglang"])
def test_engines_that_ignore_the_model_field(fleet: FleetThread, engine: str) -> None:
    with client(fleet, engine) as c:
        out = c.chat.completions.create(model="whatever", messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                                        extra_body=ask_usage(engine))
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_context_overflow_is_a_400(fleet: FleetThread) -> None:
    long_prompt = "word " * 5000
    for engine in ENGINES:
        with client(fleet, engine) as c, pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5)
