"""The KV-cache prompt-leak attack, re-run against the gateway: one key tries to read another key's system
prompt through the shared prefix caches (the engines' and the gateway's own indexes), guessing a secret and
watching what the answers say about cache hits.

Key A's system prompt carries a 4-digit PIN. Key B sends the same system prompt with guesses: a warm-up guess,
then the right PIN and a new wrong one. Whatever B can observe of its answers (the gateway's headers, usage,
llama.cpp's timings, the backend chosen) must be the same for the right guess and the wrong one. Two keys that
an operator put in one ``cache_domain`` still share each other's cached prefixes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimServer, SimSpec
from gateway.sim.tokenizer_files import ensure_tokenizer
from tests.api.conftest import TIME_SCALE
from tests.conftest import serve_in_thread
from tests.waiting import wait_until

MODEL = "m"
PIN = "4821"
FILLER = " kalo mine ruta wenso bade fezu"


def secret_prompt(pin: str, owner: str = "bank") -> str:
    # the PIN past the opening kilobyte (the opening alone decides ties: see MaxScorePicker) and well before
    # the end, so the right guess would match many more cache blocks than a wrong one
    return f"You are the {owner}'s assistant." + FILLER * 40 + f" The customer's PIN is {pin}." + FILLER * 40


def keys(**extra: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name in ("tenant-a", "tenant-b", *extra):
        out.append({"name": name, "key_sha256": hashlib.sha256(name.encode()).hexdigest(), **extra.get(name, {})})
    return out


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(url: str, key: str, system: str, question: str, **kwargs: Any) -> tuple[httpx.Headers, dict[str, Any]]:
    raw = client(url, key).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "system", "content": system},
                                             {"role": "user", "content": question}], **kwargs)
    return raw.headers, raw.parse().model_dump()


def observed(headers: httpx.Headers, body: dict[str, Any]) -> dict[str, Any]:
    """What a client sees of an answer that could depend on other keys' prompts: every header but the
    request id, the usage, and llama.cpp's timings fields (their values are clocks: only which are there)."""
    return {"headers": {k: v for k, v in headers.items() if k not in ("x-request-id", "date", "content-length")},
            "usage": body.get("usage"), "timings": sorted((body.get("timings") or {}).keys())}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


class Mixed:
    """The gateway in front of a fleet whose vLLM emulators publish KV events."""

    def __init__(self, url: str, servers: list[SimServer], app: Any) -> None:
        self.url = url
        self.servers = servers
        self.app = app

    def settle(self) -> None:
        """Return once the gateway has applied every KV event the engines published (the last answer's)."""
        streams = self.app.gateway.kv_events.streams

        def caught_up() -> bool:
            return all(s.spec.name in streams and streams[s.spec.name].counters.batches >= s.kv_events.seq
                       for s in self.servers if s.kv_events is not None)

        wait_until(caught_up, "the engines' KV events applied by the gateway")


@pytest.fixture(scope="module")
def mixed(tokenizer: Path) -> Iterator[Mixed]:
    """Two vLLM emulators publishing KV events and a llama.cpp emulator, one model, behind a gateway with the
    default policy (precise-prefix among its scorers), two tenants and two keys sharing a cache domain."""
    events = {"replay_endpoint": "tcp://127.0.0.1:*"}
    specs = [SimSpec(engine="vllm", model=MODEL, name="v0", time_scale=TIME_SCALE, tokenizer=str(tokenizer),
                     kv_events=dict(events)),
             SimSpec(engine="vllm", model=MODEL, name="v1", time_scale=TIME_SCALE, tokenizer=str(tokenizer),
                     kv_events=dict(events)),
             SimSpec(engine="llamacpp", model=MODEL, name="l0", time_scale=TIME_SCALE, tokenizer=str(tokenizer))]
    with FleetThread(specs) as fleet:
        servers: list[SimServer] = fleet.fleet.servers
        backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url,
                     **({"kv_events": {"endpoint": s.kv_events_endpoint, "replay_endpoint": s.kv_replay_endpoint}}
                        if s.kv_events_endpoint else {})} for s in servers]
        settings = settings_from_mapping({
            "backends": backends, "scrape": {"interval": 0.1, "timeout": 1.0},
            "routing": {"tokenizers": {MODEL: str(tokenizer)}},
            "auth": {"keys": keys(**{"team-c": {"cache_domain": "team"}, "team-d": {"cache_domain": "team"},
                                     "operator": {"scopes": ["inference", "admin"]}})}})
        app = create_app(settings)
        with serve_in_thread(app) as gateway:
            yield Mixed(gateway.url, servers, app)


def test_a_guessed_pin_looks_the_same_as_a_wrong_one_on_a_mixed_fleet(mixed: Mixed) -> None:
    ask(mixed.url, "tenant-a", secret_prompt(PIN), "What can you do for me?")
    mixed.settle()
    ask(mixed.url, "tenant-b", secret_prompt("0000"), "hello")  # the attacker's own warm-up
    mixed.settle()
    right = observed(*ask(mixed.url, "tenant-b", secret_prompt(PIN), "hello"))
    mixed.settle()
    wrong = observed(*ask(mixed.url, "tenant-b", secret_prompt("7305"), "hello"))
    assert right == wrong
    assert "x-gateway-route-reason" not in right["headers"]


def test_routing_internals_only_for_an_admin_key_that_asks(mixed: Mixed) -> None:
    debug = {"x-gateway-debug": "route"}
    tenant, _ = ask(mixed.url, "tenant-b", "short", "hi", extra_headers=debug)
    assert "x-gateway-route-reason" not in tenant and "x-gateway-policy" not in tenant
    unasked, _ = ask(mixed.url, "operator", "short", "hi")
    assert "x-gateway-route-reason" not in unasked and "x-gateway-policy" not in unasked
    told, _ = ask(mixed.url, "operator", "short", "hi", extra_headers=debug)
    assert told["x-gateway-policy"] == "default"
    assert told["x-gateway-route-reason"].split(":")[0] in {"precise-prefix", "engine-shape", "least-load", "tie"}


def test_keys_sharing_a_cache_domain_share_cached_prefixes(mixed: Mixed) -> None:
    system = "You are the team's assistant." + " zuba feso lint" * 120
    headers, _ = ask(mixed.url, "team-c", system, "first question")
    mixed.settle()
    for i in range(3):
        again, body = ask(mixed.url, "team-d", system, f"question {i}")
        assert again["x-gateway-backend"] == headers["x-gateway-backend"]
        if headers["x-gateway-backend"].startswith("v"):  # (vLLM: its own salted cache, its own figure)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 300


@pytest.fixture(scope="module", params=["llamacpp", "vllm", "sglang"])
def single(request: pytest.FixtureRequest, tokenizer: Path) -> Iterator[tuple[str, SimServer]]:
    """One emulated engine behind a gateway with two tenants: llama.cpp (no cache isolation of its own), vLLM and
    SGLang (isolation by cache_salt)."""
    engine = request.param
    spec = SimSpec(engine=engine, model=MODEL, name="e0", time_scale=TIME_SCALE, tokenizer=str(tokenizer))
    with FleetThread([spec]) as fleet:
        server: SimServer = fleet.fleet["e0"]
        settings = settings_from_mapping({
            "backends": [{"name": "e0", "engine": engine, "url": server.url}],
            "scrape": {"interval": 0.1, "timeout": 1.0}, "auth": {"keys": keys()}})
        with serve_in_thread(create_app(settings)) as gateway:
            yield gateway.url, server


def probe(url: str, server: SimServer, pin: str, stream: bool) -> tuple[dict[str, Any], int]:
    """Tenant A's request, then B's guess (llama.cpp reuses the idle slot holding the most similar prompt, so
    A's prompt is in a slot each time B probes): what B observes, and the tokens the engine served B from its
    cache."""
    owner = "clinic" if stream else "bank"  # (a secret of its own per mode: B never sent the right one before)
    ask(url, "tenant-a", secret_prompt(PIN, owner), "What can you do for me?")
    before = server.stats.cached_tokens
    if not stream:
        seen = observed(*ask(url, "tenant-b", secret_prompt(pin, owner), "hello"))
        return seen, server.stats.cached_tokens - before
    c = client(url, "tenant-b")
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, max_tokens=4, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": secret_prompt(pin, owner)}, {"role": "user", "content": "hello"}]
    ) as response:
        chunks = [chunk.model_dump() for chunk in response.parse()]
        headers = response.headers
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    timings = next((c["timings"] for c in chunks if c.get("timings")), {})
    return observed(headers, {"usage": usage, "timings": timings}), server.stats.cached_tokens - before


@pytest.mark.parametrize("stream", [False, True])
def test_one_engine_answers_the_right_guess_as_a_wrong_one(single: tuple[str, SimServer], stream: bool) -> None:
    """All of B's guesses reach the one engine holding A's prompt. vLLM and SGLang get each tenant's salt: B's
    guesses hit only B's own cached prefix (the part before the PIN, from its warm-up), and they say so. llama.cpp
    reuses A's prompt for the right guess, so its cache figures are taken out of B's answers."""
    url, server = single
    probe(url, server, "0000", stream)
    right, right_hit = probe(url, server, PIN, stream)
    wrong, wrong_hit = probe(url, server, "7305", stream)
    assert right == wrong
    cached = (right["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    if server.spec.engine == "llamacpp":
        assert right_hit > wrong_hit + 100, "the engine itself served the right guess from tenant A's prompt"
        assert cached is None
        assert not {"cache_n", "prompt_n", "prompt_ms"} & set(right["timings"])
    else:
        assert right_hit == wrong_hit == cached and cached > 100, "B's own prefix, reported; never A's"


def probe_messages(url: str, pin: str) -> tuple[str, dict[str, Any]]:
    """Tenant A's request, then B's guess, both Anthropic Messages requests: the way B's went, and its usage."""
    def send(key: str, system: str, question: str) -> Any:
        c = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        return c.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=system,
                                                   messages=[{"role": "user", "content": question}])

    send("tenant-a", secret_prompt(PIN, "hotel"), "What can you do for me?")
    raw = send("tenant-b", secret_prompt(pin, "hotel"), "hello")
    return raw.headers["x-gateway-agent-api"], raw.parse().usage.model_dump()


def test_an_agent_api_goes_natively_only_where_the_engine_keeps_it_to_the_domain(
        single: tuple[str, SimServer]) -> None:
    """vLLM's own /v1/messages takes cache_salt: passed through, salted. llama.cpp's cannot be isolated and
    SGLang's drops the salt: translated to chat, whose answer the gateway cleans."""
    url, server = single
    probe_messages(url, "0000")
    way, right = probe_messages(url, PIN)
    _, wrong = probe_messages(url, "7305")
    assert right == wrong
    assert way == ("native" if server.spec.engine == "vllm" else "translated")


def test_a_clients_own_salt_partitions_its_domain_and_a_bad_one_is_refused(single: tuple[str, SimServer]) -> None:
    url, server = single
    if server.spec.engine == "llamacpp":
        pytest.skip("llama.cpp takes no salt (the field is ignored, as the engine ignores it)")
    system = "You answer questions about salts." + FILLER * 30

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        _, body = ask(url, "tenant-b", system, "hi", extra_body=extra)
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    # (SGLang reuses any shared token: B's earlier prompts share the template's first few under B's salt)
    assert cached("mine") < 16 and cached("mine") > 100
    assert cached(None) < 16 and cached("other") < 16, "the client's salt partitions its domain's cache"
    with pytest.raises(openai.BadRequestError) as refused:
        ask(url, "tenant-b", system, "hi", extra_body={"cache_salt": ""})
    assert refused.value.status_code == 400 and "cache_salt" in str(refused.value)
