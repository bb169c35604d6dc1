"""The emulator's own cost: how many concurrent streams and tokens/s one emulator process sustains on one core.

``python -m gateway.sim bench [--streams 500] [--tokens 200] [--step-ms 20]`` starts one emulated vLLM server
(flat step time: every running stream gets a token each ``step-ms``) in its own process, pinned to one CPU
where possible, and a load generator (aiohttp) in another process that opens all streams at once and counts
token events. It reports the tokens/s delivered, the streams held open, and the emulator's CPU seconds per
1,000 tokens (from /proc). Ideal rate: streams / step. A benchmark, not a test.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _loadgen(url: str, streams: int, tokens: int) -> dict[str, float]:
    import aiohttp

    body = {"model": "sim-llama-2-7b", "prompt": "benchmark prompt", "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    counts = [0] * streams
    open_now = 0
    peak = 0
    first: list[float] = []

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal open_now, peak
        async with session.post(url + "/v1/completions", json=body) as resp:
            open_now += 1
            peak = max(peak, open_now)
            async for data in resp.content.iter_any():
                if not first:
                    first.append(time.perf_counter())
                counts[i] += data.count(b'"finish_reason":null')
            open_now -= 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, session) for i in range(streams)))
        t1 = time.perf_counter()
    total = sum(counts)
    start = first[0] if first else t0
    return {"tokens": total, "seconds": t1 - start, "tokens_per_s": total / (t1 - start), "peak_streams": peak,
            "complete_streams": sum(1 for c in counts if c == tokens)}


def _wait_ready(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"emulator at {url} did not come up")


def run_bench(streams: int, tokens: int, step_ms: float, port: int) -> int:
    url = f"http://127.0.0.1:{port}"
    sets = {"max_seqs": streams + 16, "decode_base_s": step_ms / 1000, "decode_growth": 0, "knee_growth": 0,
            "kv_capacity_tokens": 10_000_000, "context_length": 1_000_000, "prefill_tok_s": 1e7}
    cmd = [sys.executable, "-m", "gateway.sim", "serve", "--engine", "vllm", "--port", str(port)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    if hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", "0", *cmd] if _has_taskset() else cmd
    emu = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        _wait_ready(url)
        cpu0 = _cpu_seconds(emu.pid)
        gen = subprocess.run([sys.executable, "-m", "gateway.sim.bench", "loadgen", url, str(streams), str(tokens)],
                             capture_output=True, text=True, check=True)
        cpu1 = _cpu_seconds(emu.pid)
    finally:
        emu.terminate()
        emu.wait(10)
    res = json.loads(gen.stdout)
    cpu = cpu1 - cpu0
    res.update({"emulator_cpu_s": cpu, "cpu_s_per_1k_tokens": 1000 * cpu / max(1, res["tokens"]),
                "emulator_cpu_share": cpu / res["seconds"], "ideal_tokens_per_s": streams / (step_ms / 1000)})
    print(json.dumps(res, indent=2))
    return 0


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "loadgen":
    try:
        import uvloop

        result = uvloop.run(_loadgen(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    except ImportError:
        result = asyncio.run(_loadgen(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    print(json.dumps(result))
