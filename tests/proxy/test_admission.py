"""The admission queue: bounded, time-limited, fair across API keys."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import AdmissionSettings
from gateway.pool.backend import Backend
from gateway.proxy.admission import Admission, QueueFull, QueueTimeout


def backend() -> Backend:
    b = Backend("b", "vllm", "http://b")
    b.models = frozenset({"m"})
    return b


@pytest.mark.anyio
async def test_a_flooding_key_does_not_starve_another() -> None:
    admission = Admission(AdmissionSettings(queue_size=100, max_wait_seconds=5))
    order: list[str] = []

    async def wait(key: str) -> None:
        await admission.wait("m", key, time.monotonic() + 5)
        order.append(key)

    tasks = [asyncio.create_task(wait("flood")) for _ in range(6)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(wait("polite")))
    await asyncio.sleep(0)
    b = backend()
    for _ in range(7):
        admission.released(b)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order.index("polite") <= 1, order  # served at its key's first turn, not after the flood


@pytest.mark.anyio
async def test_full_queue_and_timeout() -> None:
    admission = Admission(AdmissionSettings(queue_size=1, max_wait_seconds=0.1))
    first = asyncio.create_task(admission.wait("m", "k", time.monotonic() + 0.1))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await admission.wait("m", "k", time.monotonic() + 0.1)
    with pytest.raises(QueueTimeout):
        await first
    assert admission.waiting == 0


@pytest.mark.anyio
async def test_a_slot_wakes_only_a_waiter_whose_model_the_backend_serves() -> None:
    admission = Admission(AdmissionSettings(queue_size=10, max_wait_seconds=1))
    other = asyncio.create_task(admission.wait("other-model", "k", time.monotonic() + 0.2))
    mine = asyncio.create_task(admission.wait("m", "k", time.monotonic() + 1))
    await asyncio.sleep(0)
    admission.released(backend())
    await mine
    with pytest.raises(QueueTimeout):
        await other
