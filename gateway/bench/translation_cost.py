"""What translating an agent API costs: the gateway's added TTFT for a translated Anthropic ``/v1/messages``
stream against a native chat stream, in the same run (a phase of ``gateway bench overhead``).

The gateway under test fronts one ``openai`` backend, an engine without its own ``/v1/messages``, so every
Messages request is translated to chat completions on its way in and each chat event back into Messages events
on its way out. Three targets, interleaved round by round at one concurrency (16 streams by default): the
backend directly (chat), the gateway (chat), the gateway (``/v1/messages``, the same messages and
``max_tokens``). Time to first token is the first event carrying generated output in each API (a chat delta
with content; a ``content_block_delta``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from gateway.bench.client import Target
from gateway.bench.report import build_report
from gateway.bench.runner import Arrival, run
from gateway.bench.workload import BenchRequest

MESSAGES = "gateway /v1/messages"


def _ms(v: float | None) -> float | None:
    return None if v is None else 1000 * v


def translation_row(doc: dict[str, Any], direct: str, native: str, translated: str) -> dict[str, Any]:
    """From one report: each target's TTFT p50/p99, the gateway's added TTFT (over ``direct``) natively and
    translated, and what translation adds on top (ms, and translated / native)."""
    ttft = {name: t["metrics"]["ttft_s"] for name, t in doc["targets"].items()}
    out: dict[str, Any] = {"targets": {name: {"ttft_ms_p50": _ms(v["p50"]), "ttft_ms_p99": _ms(v["p99"]),
                                              "requests": doc["targets"][name]["requests"],
                                              "errors": doc["targets"][name]["errors"]}
                                       for name, v in ttft.items()}}
    base = ttft[direct]
    for key, name in (("native", native), ("translated", translated)):
        for q in ("p50", "p99"):
            a, b = ttft[name][q], base[q]
            out[f"{key}_added_ttft_ms_{q}"] = None if a is None or b is None else 1000 * (a - b)
    n, t = out["native_added_ttft_ms_p50"], out["translated_added_ttft_ms_p50"]
    out["translation_ms_p50"] = None if n is None or t is None else t - n
    out["translated_over_native_x"] = None if n is None or t is None or n <= 0 else t / n
    return out


async def measure_translation(direct: Target, gateway: Target, requests: list[BenchRequest], concurrency: int,
                              per_round: int, log: Any) -> dict[str, Any]:
    """The phase: ``requests`` (chat bodies: messages and max_tokens only) to the three targets at
    ``concurrency`` streams, ``per_round`` requests per target per round."""
    messages = replace(gateway, name=MESSAGES, api="messages")
    started = time.perf_counter()
    result = await run([direct, gateway, messages], requests, Arrival(concurrency=concurrency),
                       round_size=per_round, warmup=concurrency, request_timeout=120)
    doc = build_report(result, {"level": concurrency}, include_requests=False)
    row = translation_row(doc, direct.name, gateway.name, MESSAGES)
    row["concurrency"] = concurrency
    log(f"  translation at {concurrency} streams: {time.perf_counter() - started:5.1f} s  added TTFT p50: chat "
        f"{_f(row['native_added_ttft_ms_p50'])} ms, /v1/messages {_f(row['translated_added_ttft_ms_p50'])} ms")
    return row


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
