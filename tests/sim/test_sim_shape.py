"""Performance shape: per-user speed at 1 vs 64 users, as ratios measured in one run.

Speeds are read from the engine's own inter-token latency record, which runs on the emulator's simulated clock
(each step advances it by the modelled step time), so a slow or busy host cannot distort the ratios.
"""

from __future__ import annotations

import anyio
import httpx
import pytest

from gateway.sim import SimServer


async def mean_itl(server: SimServer, users: int, tokens: int = 12) -> float:
    """Mean inter-token latency (simulated seconds) seen by ``users`` concurrent streams."""
    itl = server.lat.itl
    n0, s0 = sum(itl.counts), itl.sum
    limits = httpx.Limits(max_connections=users + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        async def one(i: int) -> None:
            body = {"model": "sim-llama-2-7b", "prompt": f"user {i} says hi", "max_tokens": tokens, "stream": True,
                    "ignore_eos": True}
            async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass

        async with anyio.create_task_group() as tg:
            for i in range(users):
                tg.start_soon(one, i)
    itl = server.lat.itl
    return (itl.sum - s0) / (sum(itl.counts) - n0)


@pytest.mark.anyio
async def test_exllamav2_wins_alone_and_loses_at_64_users_vllm_the_opposite(make_spec) -> None:  # type: ignore[no-untyped-def]
    exl = SimServer(make_spec("tabbyapi", time_scale=20.0))
    vll = SimServer(make_spec("vllm", time_scale=20.0))
    await exl.start()
    await vll.start()
    try:
        exl_1, vll_1 = await mean_itl(exl, 1), await mean_itl(vll, 1)
        exl_64, vll_64 = await mean_itl(exl, 64), await mean_itl(vll, 64)
        exl_2, exl_4 = await mean_itl(exl, 2), await mean_itl(exl, 4)
    finally:
        await exl.stop()
        await vll.stop()
    assert 1 / exl_1 > 1 / vll_1  # exllamav2 is the faster single stream
    assert 190 < 1 / exl_1 < 230 and 150 < 1 / vll_1 < 195  # anchored to ~211 and just under ~186 tok/s
    assert exl_64 / exl_1 > 20  # each user's speed collapses with 64 users
    assert vll_64 / vll_1 < 2.5  # nearly flat
    assert (64 / vll_64) / (1 / vll_1) > 20  # vLLM aggregate throughput many times higher at 64 users
    assert 1 / vll_64 > 1 / exl_64 * 10  # at 64 users vLLM's users are far faster
    assert 1.6 < exl_2 / exl_1 < 2.2 and 1.6 < exl_4 / exl_2 < 2.2  # users double -> per-user speed ~halves


@pytest.mark.anyio
async def test_llamacpp_queues_beyond_its_slots(make_spec) -> None:  # type: ignore[no-untyped-def]
    server = SimServer(make_spec("llamacpp", time_scale=20.0))
    await server.start()
    try:
        await mean_itl(server, 8)
        waited = server.lat.queue
        delayed = sum(waited.counts[1:])  # queued longer than the first bucket (1 ms)
        assert delayed >= 4  # 8 users, 4 slots: half of them waited for a slot
    finally:
        await server.stop()
