from __future__ import annotations

import time
from typing import Any

from gateway.engines.registry import ENGINES
from gateway.pool.backend import Backend
from gateway.pool.state import Capacity, Health, LoadRecord, Probe
from gateway.routing.request import RouteRequest


def backend(name: str, *, engine: str = "vllm", models: tuple[str, ...] = ("m",), health: Health = Health.READY,
            slots: int | None = 4, running: int | None = None, waiting: int | None = None, in_flight: int = 0,
            age: float = 0.0, context: int | None = None, cache_tokens: int | None = None,
            max_concurrency: int | None = None, page_tokens: int | None = None) -> Backend:
    b = Backend(name, engine, f"http://{name}", stale_after=5.0, max_concurrency=max_concurrency,
                spec=ENGINES[engine])
    b.models = frozenset(models)
    b.record_probe(Probe(health))
    b.capacity = Capacity(slots=slots, context_length=context, cache_tokens=cache_tokens, page_tokens=page_tokens)
    if running is not None or waiting is not None:
        b.record_load(LoadRecord(running, waiting, None, time.monotonic() - age))
    b.in_flight = in_flight
    return b


def chat(system: str, user: str, *, model: str = "m", max_tokens: int | None = None, session: str | None = None,
         **extra: Any) -> RouteRequest:
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            **extra}
    return RouteRequest(route="chat", model=model, stream=True, max_tokens=max_tokens, body=body,
                        session_key=session)
