"""The truth check: under emulated load, the gateway's TTFT, inter-token latency, tokens/s and queue-wait
figures agree with what the client measured and what the emulator knows it did, within 2 ms or 5%.

The emulators run in real time (time_scale 1) so the engine's own figures and the wall clock coincide.
Emulators, gateway and client each run in their own process, so none of them skews another's clock.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port_block


def close(gateway: float, truth: float, what: str) -> None:
    assert abs(gateway - truth) <= max(0.002, 0.05 * abs(truth)), f"{what}: gateway {gateway:.5f} vs {truth:.5f}"


def histogram(text: str, name: str, **labels: str) -> tuple[float, float]:
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                if sample.name == f"{name}_sum":
                    total += sample.value
                elif sample.name == f"{name}_count":
                    count += sample.value
    return total, count


async def stream_one(session: aiohttp.ClientSession, url: str, model: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    sent: dict[str, float] = {}
    times: list[float] = []
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", json=body, trace_request_ctx=sent) as response:
        buffer = b""
        async for data in response.content.iter_any():
            now = time.perf_counter()
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {") and (b'"content":"' in event and b'"content":""' not in event):
                    times.append(now)
                if b'"usage":{' in event:
                    import orjson

                    usage = orjson.loads(event[6:])["usage"]
    return {"ttft": times[0] - sent["at"], "gaps": [b - a for a, b in itertools.pairwise(times)],
            "tokens": usage["completion_tokens"], "decode": times[-1] - times[0]}


async def load(url: str, model: str, n: int) -> list[dict[str, Any]]:
    # the client's clock starts when the request body has left, not when the coroutine was scheduled:
    # twelve connections opening at once on a 2-core machine would otherwise count as TTFT
    async def body_sent(session: Any, ctx: Any, params: Any) -> None:
        ctx.trace_request_ctx["at"] = time.perf_counter()

    tracing = aiohttp.TraceConfig()
    tracing.on_request_chunk_sent.append(body_sent)
    async with aiohttp.ClientSession(trace_configs=[tracing]) as session:
        return list(await asyncio.gather(*(stream_one(session, url, model) for _ in range(n))))


@contextmanager
def process(args: list[str], url: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url, timeout=1).status_code < 500:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, f"{args} did not start"
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_gateway_figures_match_the_client_and_the_emulator(tmp_path: Path) -> None:
    # Each in its own process, as users run them: the emulators (a vLLM-like engine running 4 sequences at a
    # time, so 12 requests queue in it; a llama.cpp-like one with a single slot, so 6 queue), the gateway,
    # and the client (this test).
    base = free_port_block(3)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"host": "127.0.0.1", "servers": [
        {"engine": "vllm", "model": "v", "name": "vllm", "port": base, "set": {"max_seqs": 4}},
        {"engine": "llamacpp", "model": "l", "name": "llama", "port": base + 1, "set": {"max_seqs": 1}}]}))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "server": {"host": "127.0.0.1", "port": base + 2},
        "backends": [{"name": "vllm", "engine": "vllm", "url": f"http://127.0.0.1:{base}"},
                     {"name": "llama", "engine": "llamacpp", "url": f"http://127.0.0.1:{base + 1}"}],
        "scrape": {"interval": 0.2}, "access_log": {"enabled": False}}))
    url = f"http://127.0.0.1:{base + 2}"
    with process(["gateway.sim", "fleet", "--config", str(tmp_path / "fleet.yaml")],
                 f"http://127.0.0.1:{base}/health"), \
            process(["gateway", "serve", "--config", str(tmp_path / "gateway.yaml"), "--log-level", "warning"],
                    url + "/ready"):
        results = {"vllm": asyncio.run(load(url, "v", 12)), "llama": asyncio.run(load(url, "l", 6))}
        time.sleep(0.6)  # a scrape of the engines' own histograms after the load
        text = httpx.get(url + "/metrics").text
        stats = {name: httpx.get(f"http://127.0.0.1:{port}/sim/stats").json()
                 for name, port in (("vllm", base), ("llama", base + 1))}

    for backend, runs in results.items():
        # TTFT: the client's includes loopback both ways, the gateway's does not
        total, count = histogram(text, "gateway_time_to_first_token_seconds", backend=backend)
        assert count == len(runs)
        close(total / count, statistics.fmean(r["ttft"] for r in runs), f"{backend} TTFT")
        # inter-token latency: mean gap between text events
        gaps = [g for r in runs for g in r["gaps"]]
        total, count = histogram(text, "gateway_inter_token_latency_seconds", backend=backend)
        assert count == len(gaps)
        close(total / count, statistics.fmean(gaps), f"{backend} ITL")
        # per-request output tokens/s
        total, count = histogram(text, "gateway_output_tokens_per_second", backend=backend)
        client = statistics.fmean((r["tokens"] - 1) / r["decode"] for r in runs)
        close(total / count, client, f"{backend} tokens/s")
        # queue wait in the engine: what the emulator recorded
        truth = stats[backend]
        total, count = histogram(text, "gateway_queue_wait_seconds", backend=backend, stage="engine")
        assert count == truth["queue_count"] == len(runs)
        assert truth["queue_seconds_sum"] > 0.05 * len(runs), "the load did queue in the engine"
        close(total, truth["queue_seconds_sum"], f"{backend} engine queue wait (sum over requests)")
