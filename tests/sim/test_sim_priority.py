"""Priority scheduling in the vLLM and SGLang emulators, as the engines do it: vLLM orders its waiting queue by
``priority`` (lower first) with --scheduling-policy priority and refuses any other value than 0 without it;
SGLang orders by it (higher first) with --enable-priority-scheduling and ignores it without."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from gateway.sim import FleetThread, SimServer, SimSpec
from tests.waiting import until


def spec(engine: str, scheduling: bool) -> SimSpec:
    return SimSpec(engine=engine, model="m", name=engine, time_scale=2.0, priority_scheduling=scheduling,  # type: ignore[arg-type]
                   overrides={"max_seqs": 1})


def order(server: SimServer, priorities: list[int | None]) -> list[int]:
    """Send a long request, then one request per priority while it runs, each queued before the next is sent;
    then let the long one go (its client leaves): the order the others finish in."""

    async def scenario() -> list[int]:
        finished: list[int] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def ask(i: int, priority: int | None, tokens: int) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                        **({"priority": priority} if priority is not None else {})}
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                finished.append(i)

            first = asyncio.create_task(ask(-1, None, 1000))  # (the one slot, held: the others queue behind it)
            await until(lambda: server.stats.active_sequences == 1, "the first request running")
            rest = []
            for i, priority in enumerate(priorities):
                rest.append(asyncio.create_task(ask(i, priority, 4)))
                await until(lambda: server.stats.waiting == len(rest), f"request {i} queued")
            first.cancel()  # (the engine aborts it when its connection closes: the slot is free)
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await asyncio.gather(*rest)
        return finished

    return asyncio.run(scenario())


@pytest.mark.parametrize(("engine", "expected"), [("vllm", [2, 1, 0]), ("sglang", [0, 1, 2])])
def test_with_priority_scheduling_the_waiting_queue_follows_priority(engine: str, expected: list[int]) -> None:
    with FleetThread([spec(engine, True)]) as fleet:
        assert order(fleet.fleet[engine], [5, 0, -5]) == expected


def test_without_it_both_ignore_the_priority() -> None:
    """vLLM 0.34 no longer refuses a priority other than 0 without its priority policy: it ignores it."""
    with FleetThread([spec("vllm", False), spec("sglang", False)]) as fleet:
        for engine in ("vllm", "sglang"):
            assert order(fleet.fleet[engine], [5, 0, -5]) == [0, 1, 2]  # arrival order


def test_priority_scheduling_is_only_for_vllm_and_sglang() -> None:
    with pytest.raises(ValueError, match="does not schedule by priority"):
        SimSpec(engine="tabbyapi", model="m", priority_scheduling=True)
