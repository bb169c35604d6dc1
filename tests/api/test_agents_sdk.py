"""The OpenAI Agents SDK, as released (``openai-agents`` from PyPI), with its defaults through the gateway: one
``@function_tool`` (strict by default), a tool round trip with a reasoning model on every engine kind of the
emulated agent fleet and with a real llama-server (its generated agent model calls the tool llama.cpp's grammar
lets it), on the Responses API (the SDK's default) and on chat completions, run whole and streamed.

Issue 42 found it failing on every self-hosted engine: ``strict: true`` with ``tool_choice: auto`` was refused,
and with ``required`` the second turn failed. Only the client and base URL are set here (and tracing off: the
SDK would export traces to api.openai.com, and tests reach loopback only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import agents
import pytest

from gateway.app import create_app
from gateway.llamacpp.server import LlamaServer
from gateway.sim import FleetThread, agent_fleet_specs
from tests.api.conftest import ENGINES, TIME_SCALE, gateway_settings
from tests.conftest import AGENT_LLAMA, ServerThread, serve_in_thread

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def gateway(agent_llama: LlamaServer) -> Iterator[ServerThread]:
    # one model per engine, so each request reaches the engine it names
    specs = [replace(s, model=f"agent-{s.engine}") for s in agent_fleet_specs(base_port=0, time_scale=TIME_SCALE)]
    with FleetThread(specs) as fleet:
        settings = gateway_settings(fleet.fleet.servers, real={"llama-agent": agent_llama.url})
        with serve_in_thread(create_app(settings)) as gw:
            yield gw


MODELS = {**{engine: f"agent-{engine}" for engine in ENGINES}, "llama-server": AGENT_LLAMA}


async def _round_trip(url: str, model: str, api: str, streamed: bool) -> tuple[list[str], Any]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        agents.set_tracing_disabled(True)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api(api)
        asked: list[str] = []

        @agents.function_tool
        def get_weather(city: str) -> str:
            """The weather in a city."""
            asked.append(city)
            return f"sunny in {city}"

        agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", model=model,
                             tools=[get_weather])
        if streamed:
            result: Any = agents.Runner.run_streamed(agent, "What is the weather in Oslo?", max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
    return asked, result


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("engine", MODELS)
def test_a_function_tool_round_trip_on_every_engine(gateway: ServerThread, engine: str, api: str,
                                                    streamed: bool) -> None:
    asked, result = asyncio.run(_round_trip(gateway.url, MODELS[engine], api, streamed))
    assert len(asked) == 1 and isinstance(asked[0], str)  # the tool ran once, with the model's arguments
    assert isinstance(result.final_output, str) and result.final_output  # then the model answered
    # the model reasons, calls, reads the result (its reasoning sent back as the SDK keeps it), reasons, answers
    assert [item.type for item in result.new_items] == [
        "reasoning_item", "tool_call_item", "tool_call_output_item", "reasoning_item", "message_output_item"]
