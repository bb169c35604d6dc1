"""Priority scheduling in the vLLM and SGLang emulators, as the engines do it: vLLM orders its waiting queue by
``priority`` (lower first) with --scheduling-policy priority and refuses any other value than 0 without it;
SGLang orders by it (higher first) with --enable-priority-scheduling and ignores it without."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.sim import FleetThread, SimSpec


def spec(engine: str, scheduling: bool) -> SimSpec:
    return SimSpec(engine=engine, model="m", name=engine, time_scale=2.0, priority_scheduling=scheduling,  # type: ignore[arg-type]
                   overrides={"max_seqs": 1})


def order(url: str, priorities: list[int | None]) -> list[int]:
    """Send a long request, then one request per priority while it runs: the order they finish in."""

    async def scenario() -> list[int]:
        finished: list[int] = []
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def ask(i: int, priority: int | None, tokens: int) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                        **({"priority": priority} if priority is not None else {})}
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                finished.append(i)

            first = asyncio.create_task(ask(-1, None, 300))  # (~0.8 s: the others queue behind it)
            await asyncio.sleep(0.1)
            rest = []
            for i, priority in enumerate(priorities):
                rest.append(asyncio.create_task(ask(i, priority, 4)))
                await asyncio.sleep(0.01)
            await asyncio.gather(first, *rest)
        return finished[1:]

    return asyncio.run(scenario())


@pytest.mark.parametrize(("engine", "expected"), [("vllm", [2, 1, 0]), ("sglang", [0, 1, 2])])
def test_with_priority_scheduling_the_waiting_queue_follows_priority(engine: str, expected: list[int]) -> None:
    with FleetThread([spec(engine, True)]) as fleet:
        assert order(fleet.fleet[engine].url, [5, 0, -5]) == expected


def test_without_it_both_ignore_the_priority() -> None:
    """vLLM 0.34 no longer refuses a priority other than 0 without its priority policy: it ignores it."""
    with FleetThread([spec("vllm", False), spec("sglang", False)]) as fleet:
        for engine in ("vllm", "sglang"):
            assert order(fleet.fleet[engine].url, [5, 0, -5]) == [0, 1, 2]  # arrival order


def test_priority_scheduling_is_only_for_vllm_and_sglang() -> None:
    with pytest.raises(ValueError, match="does not schedule by priority"):
        SimSpec(engine="tabbyapi", model="m", priority_scheduling=True)
