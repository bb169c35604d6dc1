"""Two gateway replicas on the same engines' KV events: do they decide alike without sharing anything?

Two routers (each its own :class:`~gateway.kvcache.subscriber.EventHub` subscribed to every engine, its own
tokenizer, its own ``precise-prefix`` pipeline) run in this process and see the same request stream: for each
request both decide, replica A's choice is sent to the engine, and each replica records its own choice (its
speculative entries follow its own decisions, as they would behind a load balancer). They share the backends'
load view (the in-flight count of what A sent), so a disagreement comes from what each replica's event index
held at that moment: events reach two subscribers at slightly different times. Reported: the share of
requests on which both picked the same backend, overall and by the plugin that made A's decision.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from gateway.bench.routing.stack import SIM_MODEL, Log, PortPool, Stack
from gateway.bench.workload import build_workload

if TYPE_CHECKING:
    from gateway.bench.routing.kv_events import KvEventsConfig, Workload


async def _drive(servers: list[dict[str, Any]], urls: list[str], requests: list[Any], tokenizer: Path,
                 concurrency: int) -> dict[str, Any]:
    from gateway.engines.registry import ENGINES
    from gateway.kvcache.subscriber import EventHub, StreamSettings
    from gateway.kvcache.tokenizer import PromptTokenizer
    from gateway.pool.backend import Backend
    from gateway.pool.state import Health, Probe
    from gateway.routing.policies import build_pipeline
    from gateway.routing.request import Outcome, RouteRequest
    from gateway.routing.state import RoutingState

    backends = []
    for server, url in zip(servers, urls, strict=True):
        b = Backend(server["name"], "vllm", url, spec=ENGINES["vllm"])
        b.models = frozenset({SIM_MODEL})
        b.record_probe(Probe(Health.READY))
        backends.append(b)
    replicas = []
    for _ in range(2):
        hub = EventHub()
        hub.sync([(b, StreamSettings(s["kv_events"]["endpoint"], s["kv_events"]["replay_endpoint"],
                                     s["kv_events"]["topic"]))
                  for b, s in zip(backends, servers, strict=True)])
        state = RoutingState(events=hub, tokenizers={SIM_MODEL: PromptTokenizer.from_dir(tokenizer)})
        replicas.append((hub, build_pipeline("precise-prefix", state)))
    deadline = time.monotonic() + 30
    while not all(hub.live_index(b) for hub, _ in replicas for b in backends):
        if time.monotonic() > deadline:
            raise RuntimeError("the replicas' event streams did not become live within 30 s")
        await asyncio.sleep(0.05)
    agree = 0
    by_reason: Counter[str] = Counter()
    agree_by_reason: Counter[str] = Counter()
    failed = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        nonlocal agree, failed
        async with gate:
            decisions = []
            asked = []
            for _, pipeline in replicas:
                request = RouteRequest(route="chat", model=SIM_MODEL, stream=False,
                                       max_tokens=body.get("max_tokens"), body=body)
                decision = pipeline.route(request, backends)
                pipeline.routed(request, decision.ranked[0])
                decisions.append(decision)
                asked.append(request)
            chosen = decisions[0].ranked[0]
            reason = decisions[0].reason
            by_reason[reason] += 1
            if decisions[1].ranked[0] is chosen:
                agree += 1
                agree_by_reason[reason] += 1
            chosen.in_flight += 1
            ok = True
            try:
                response = await client.post(f"{chosen.url}/v1/chat/completions", json={**body, "model": SIM_MODEL})
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            finally:
                chosen.in_flight -= 1
            failed += 0 if ok else 1
            for (_, pipeline), request, decision in zip(replicas, asked, decisions, strict=True):
                pipeline.observe(Outcome(request, decision.ranked[0].name, 1, ok), decision.ranked[0])

    try:
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(one(client, r.body) for r in requests))
    finally:
        for hub, _ in replicas:
            await hub.stop()
    streams = [{name: {"events": s.counters.events, "gaps": s.counters.gaps, "resets": dict(s.counters.resets)}
                for name, s in hub.streams.items()} for hub, _ in replicas]
    return {"requests": len(requests), "failed": failed, "agreement": agree / len(requests) if requests else None,
            "by_reason": {r: {"decisions": n, "agreement": agree_by_reason[r] / n} for r, n in by_reason.items()},
            "streams": streams}


def run_replicas(cfg: KvEventsConfig, work: Workload, tokenizer: Path, ports: PortPool, log: Log) -> dict[str, Any]:
    from dataclasses import replace

    from gateway.bench.routing.kv_events import fleet, measure_prompts

    requests = build_workload(replace(work.config, count=cfg.replica_count))
    kv = measure_prompts(requests, tokenizer, work.cache_share).kv_capacity_tokens
    workdir = cfg.out / "kv-events" / "replicas"
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(workdir, log, cfg.scrape_interval)
    try:
        servers = fleet(cfg, ports, kv, tokenizer, "replicas")
        urls = stack.fleet("replicas", servers)
        log(f"replicas: {len(requests)} requests of the {work.name} workload, two routers on the same events")
        result = asyncio.run(_drive(servers, urls, requests, tokenizer, cfg.concurrency))
    finally:
        stack.stop()
    result["workload"] = work.name
    return result
