"""Measuring a llama.cpp server (real or emulated) over HTTP: prompts of exact token counts, the workload."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from gateway.llamacpp.calibrate.common import (
    CACHED_PREFIXES,
    DECODE_TOKENS,
    FLOOR_LENGTH,
    LENGTHS,
    MODEL_NAME,
    QUEUE_PROMPT,
    QUEUE_REQUESTS,
    QUEUE_STAGGER_S,
    QUEUE_TOKENS,
    SWEEP_TOKENS,
    WORDS,
    Run,
    Workload,
)


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Client:
    """Streams requests to one server (real or emulated) and builds prompts with its own tokenizer."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = url
        # llama-server may close a connection after a stream; a fresh connection per request avoids reuse races
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=120))

    async def close(self) -> None:
        await self.session.close()

    async def tokenize(self, text: str, pieces: bool = False) -> list[Any]:
        body = {"content": text, "add_special": not pieces, "with_pieces": pieces}
        async with self.session.post(self.url + "/tokenize", json=body) as r:
            r.raise_for_status()
            return list((await r.json())["tokens"])

    async def count(self, text: str) -> int:
        return len(await self.tokenize(text))

    async def pieces(self, text: str) -> list[str]:
        return [t["piece"] if isinstance(t["piece"], str) else "" for t in await self.tokenize(text, pieces=True)]

    async def exact(self, head: str, seed: int, target: int) -> str:
        """``head`` followed by words until the prompt is exactly ``target`` tokens (BOS included)."""
        if head and await self.count(head) >= target:
            raise ValueError("head is already too long")
        tail = await self.pieces((" " if head else "") + words(seed, target + 16))
        k = target - (await self.count(head) if head else 1)
        for _ in range(12):
            text = head + "".join(tail[: max(0, k)])
            got = await self.count(text)
            if got == target:
                return text
            k += target - got
        raise RuntimeError(f"could not build a prompt of exactly {target} tokens at {self.url}")

    async def stream(self, prompt: str, max_tokens: int) -> Run:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = last = math.nan
        chunks = 0
        final: dict[str, Any] = {}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        first = now
                    last = now
                    chunks += 1
                if "usage" in obj or "timings" in obj:
                    final.update(obj)
        usage = final.get("usage") or {}
        timings = final.get("timings") or {}
        tokens = int(usage.get("completion_tokens", chunks))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n", 0))
        return Run(ttft=first - t0, itl=(last - first) / (tokens - 1) if tokens > 1 and chunks > 1 else math.nan,
                   tokens=tokens, prompt_tokens=int(usage.get("prompt_tokens", 0)), cached=int(cached or 0),
                   server_prompt_ms=timings.get("prompt_ms"), chunks=chunks)


async def run_workload(client: Client, round_no: int, lengths: Sequence[int] = LENGTHS,
                       prefixes: Sequence[int] = CACHED_PREFIXES) -> Workload:
    """One round. Seeds depend on the round, so no prompt is cached from an earlier round."""
    seed = 1_000_003 * (round_no + 10)
    longest = max(lengths)
    floor = await client.stream(await client.exact("", seed, FLOOR_LENGTH), SWEEP_TOKENS)
    sweep: dict[int, Run] = {}
    for i, n in enumerate(lengths):
        sweep[n] = await client.stream(await client.exact("", seed + 10 + i, n), SWEEP_TOKENS)
    cached: dict[int, Run] = {}
    for i, n in enumerate(prefixes):
        head = await client.exact("", seed + 100 + i, n)
        first = await client.exact(head, seed + 200 + i, longest)
        second = await client.exact(head, seed + 300 + i, longest)
        await client.stream(first, 2)
        cached[n] = await client.stream(second, SWEEP_TOKENS)
    decode1 = await client.stream(await client.exact("", seed + 400, FLOOR_LENGTH), DECODE_TOKENS)
    pair = [await client.exact("", seed + 410 + i, FLOOR_LENGTH) for i in range(2)]
    decode2 = list(await asyncio.gather(*(client.stream(p, DECODE_TOKENS) for p in pair)))
    batch = [await client.exact("", seed + 500 + i, QUEUE_PROMPT) for i in range(QUEUE_REQUESTS)]
    async def later(i: int, prompt: str) -> Run:
        await asyncio.sleep(i * QUEUE_STAGGER_S)
        return await client.stream(prompt, QUEUE_TOKENS)  # TTFT from its own send time

    queue = list(await asyncio.gather(*(later(i, p) for i, p in enumerate(batch))))
    return Workload(floor=floor, sweep=sweep, cached=cached, decode1=decode1, decode2=decode2, queue=queue)


# -- the report -----------------------------------------------------------------------------------------------------
