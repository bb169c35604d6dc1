"""Precise prefix routing end to end: emulated vLLM and SGLang servers publishing their KV events in each
engine's wire format and tokenizing with the generated tokenizer, the gateway subscribing and routing."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.bench.workload import words
from gateway.config import settings_from_mapping
from gateway.kvcache.index import request_keys
from gateway.kvcache.tokenizer import PromptTokenizer
from gateway.sim import FleetThread, SimServer, SimSpec
from gateway.sim.tokenizer_files import ensure_tokenizer
from tests.conftest import serve_in_thread
from tests.waiting import until, wait_until

MODEL = "m"
SYSTEM = "You are assistant seven." + " kalo mine ruta wenso bade fezu" * 60


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def spec(engine: str, name: str, tokenizer: Path, **kv: Any) -> SimSpec:
    return SimSpec(engine=engine, model=MODEL, name=name, time_scale=50.0, tokenizer=str(tokenizer),  # type: ignore[arg-type]
                   kv_events={"replay_endpoint": "tcp://127.0.0.1:*", **kv})


def settings(servers: list[SimServer], tokenizer: Path, **routing: Any) -> Any:
    backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url,
                 "kv_events": {"endpoint": s.kv_events_endpoint, "replay_endpoint": s.kv_replay_endpoint}}
                for s in servers]
    return settings_from_mapping({"backends": backends, "scrape": {"interval": 0.1, "timeout": 1.0},
                                  "routing": {"tokenizers": {MODEL: str(tokenizer)}, **routing}})


def chat(user: str, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "system", "content": system},
                                                           {"role": "user", "content": user}]}


BODIES = [
    chat("hello there"),
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                                {"type": "text", "text": "part two"}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "héllo wörld ☃ 12 34"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    {"model": MODEL, "messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": None,
                                   "tool_calls": [{"id": "c", "type": "function",
                                                   "function": {"name": "f", "arguments": "{}"}}]},
                                  {"role": "tool", "content": "42", "tool_call_id": "c"}]},
]


def test_gateway_and_emulator_tokenize_alike(tokenizer: Path) -> None:
    """The gateway's token ids for a chat request are the ones the emulated vLLM computes (its /tokenize,
    and the prompt_tokens it bills)."""
    gateway = PromptTokenizer.from_dir(tokenizer)
    with FleetThread([spec("vllm", "v", tokenizer)]) as fleet:
        url = fleet.fleet["v"].url
        for body in BODIES:
            ids = gateway.chat(body)
            assert ids is not None
            engine = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
            assert ids == engine
            usage = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2}).json()["usage"]
            assert usage["prompt_tokens"] == len(ids)
        prompt = "kalo mine 12"
        assert gateway.completion(prompt) == httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": prompt}
                                                        ).json()["tokens"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_event_index_matches_the_engines_cache_through_evictions(engine: str, tokenizer: Path) -> None:
    """Requests straight to one emulated engine with a small cache (it evicts all the time): afterwards, for
    every prompt sent, the gateway's index of the engine's events holds exactly the leading blocks the
    engine's cache holds."""
    from gateway.kvcache.subscriber import EventHub, StreamSettings
    from gateway.pool.backend import Backend
    from gateway.pool.state import Health, Probe

    gateway = PromptTokenizer.from_dir(tokenizer)
    systems = [f"System {g}." + words(random.Random(g), 80) for g in range(12)]
    prompts = [chat(f"question {i}", system=systems[i % 12]) for i in range(36)]
    with FleetThread([SimSpec(engine=engine, model=MODEL, name="e", time_scale=50.0, tokenizer=str(tokenizer),  # type: ignore[arg-type]
                              kv_events={"replay_endpoint": "tcp://127.0.0.1:*"},
                              overrides={"kv_capacity_tokens": 1000})]) as fleet:
        server = fleet.fleet["e"]
        backend = Backend("e", engine, server.url)
        backend.record_probe(Probe(Health.READY))

        async def follow() -> list[tuple[int, int]]:
            hub = EventHub()
            assert server.kv_events_endpoint is not None
            hub.sync([(backend, StreamSettings(server.kv_events_endpoint, server.kv_replay_endpoint))])
            async with httpx.AsyncClient(base_url=server.url) as client:
                for body in prompts:
                    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            stream = hub.streams["e"]
            await until(lambda: server.kv_events is None or stream.counters.batches >= server.kv_events.seq,
                        "the engine's KV events applied by the subscriber")
            assert stream.live()
            out = []
            for body in prompts:
                ids = gateway.chat(body)
                assert ids is not None and stream.index.chunk is not None
                held = int(stream.index.match(request_keys(ids, stream.index.chunk)) * stream.index.chunk)
                out.append((held, truth(server, ids[:-1], stream.index.chunk)))
            removed = stream.counters.events
            await hub.stop()
            assert removed > len(prompts)
            return out

        pairs = fleet.call(follow())
    assert any(h for h, _ in pairs) and any(not h for h, _ in pairs), "some prompts held, some evicted"
    assert [h for h, _ in pairs] == [t for _, t in pairs]


def truth(server: SimServer, tokens: list[int], chunk: int) -> int:
    """The leading tokens the emulated engine's cache holds (without touching it), in whole chunks of the
    gateway's own keys."""
    held: int = server.scheduler.cache.held(tokens)  # type: ignore[attr-defined]
    return held // chunk * chunk


def settle(fleet: Any, app: Any) -> None:
    """Return once the gateway has applied every KV-event batch the engines published (a gap's by replay)."""
    streams = app.gateway.kv_events.streams

    def caught_up() -> bool:
        return all(s.spec.name in streams and streams[s.spec.name].counters.batches >= s.kv_events.seq
                   for s in fleet.fleet.servers if s.kv_events is not None)

    wait_until(caught_up, "the engines' KV events applied by the gateway")


@pytest.fixture(scope="module")
def routed(tokenizer: Path) -> Iterator[tuple[Any, Any, Any]]:
    specs = [spec("vllm", "v1", tokenizer), spec("vllm", "v2", tokenizer), spec("sglang", "s1", tokenizer)]
    with FleetThread(specs) as fleet:
        app = create_app(settings(fleet.fleet.servers, tokenizer, policy="precise-prefix"))
        with serve_in_thread(app) as gateway:
            streams = app.gateway.kv_events.streams
            # each engine's stream subscribed and its history replayed: a batch from now on reaches the gateway live
            wait_until(lambda: all(s.spec.name in streams and streams[s.spec.name].state == "live"
                                   for s in fleet.fleet.servers), "the engines' KV-event streams live")
            yield fleet, gateway, app


def test_requests_sharing_a_prefix_follow_the_engine_whose_events_hold_it(routed: tuple[Any, Any, Any]) -> None:
    fleet, gateway, app = routed
    first = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat("first question"))
    assert first.status_code == 200
    home = first.headers["x-gateway-backend"]
    settle(fleet, app)  # its blocks announced
    for i in range(5):
        r = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat(f"question number {i}"),
                       headers={"x-gateway-debug": "route"})
        assert r.headers["x-gateway-backend"] == home
        assert r.headers["x-gateway-route-reason"].startswith("precise-prefix")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
    metrics = httpx.get(f"{gateway.url}/metrics").text
    for backend in ("v1", "v2", "s1"):
        assert f'gateway_kv_events_live{{backend="{backend}"}} 1.0' in metrics
    assert f'gateway_prefix_predicted_cached_tokens_total{{backend="{home}",index="events"}}' in metrics
    assert f'gateway_kv_event_index_blocks{{backend="{home}"}}' in metrics


def test_a_restarted_engine_is_forgotten_and_a_dropped_batch_replayed(routed: tuple[Any, Any, Any]) -> None:
    fleet, gateway, app = routed
    server: SimServer = fleet.fleet["v1"]
    assert server.kv_events is not None
    server.kv_events.drop_next = 1  # the next batch is numbered and buffered, never sent
    body = chat("a prompt for v1 only", system="Another system prompt." + " zuba feso" * 50)
    httpx.post(f"{server.url}/v1/chat/completions", json=body)  # straight to the engine
    httpx.post(f"{server.url}/v1/chat/completions", json=chat("x", system="Third." + " hogi" * 40))
    settle(fleet, app)  # the hole the dropped batch left is seen at the next one, and filled by a replay
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'gateway_kv_event_gaps_total{backend="v1"} 1.0' in metrics
    assert 'gateway_kv_event_replays_total{backend="v1",result="complete"}' in metrics
    # the old process numbered 60 batches more: the new one, numbering from 0 again, stays behind it for as many
    # of its own (the restart is seen as numbers going back) while the subscriber reconnects; a new process
    # that had numbered past the old one before it reconnected would look like a hole, not a restart
    for n in range(60):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat(f"before {n}", system=f"Old {n}." + " kel" * 40))
    fleet.call(server.stop())
    fleet.call(server.start())  # a fresh process on the same ports: numbering starts again at 0
    i = 0
    # The new process is noticed either by its numbering from 0 again (reason="restart") or, when a health probe
    # (every 0.1 s here) saw the backend down and up first, by its health epoch (reason="epoch"): both clear the
    # index and replay the new process's history. The numbering path alone is tested in test_subscriber.
    noticed = [f'gateway_kv_event_index_resets_total{{backend="v1",reason="{r}"}} 1.0' for r in ("restart", "epoch")]

    def restart_noticed() -> bool:
        # the subscriber reconnects on its own; a batch published before it has is replayed once it notices
        nonlocal metrics, i
        metrics = httpx.get(f"{gateway.url}/metrics").text
        if any(line in metrics for line in noticed):
            return True
        httpx.post(f"{server.url}/v1/chat/completions", json=chat("after", system=f"Fresh {i}." + " wen" * 40))
        i += 1
        return False

    wait_until(restart_noticed, "the restarted engine noticed: its index reset (restart or epoch)")
    blocks = float(metrics.split('gateway_kv_event_index_blocks{backend="v1"} ')[1].split()[0])
    assert 0 < blocks < 13 * (i + 1)  # what the new process stored since, not what the old one held
