"""Cheap checks first: a request's key, its model allow-list, its ``max_in_flight`` and its rate limits are
checked before anything costly is done for it (translating an agent API, validating the body, validating a
constraint in a worker process). A hostile sweep found a key allowed no model at all, at 1 request/min, raising
another tenant's schema request from 0.02 s to 12-15 s, then 503, with distinct 127 KB grammars from 30
connections: they went to the validation workers before the key was refused."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import gateway.api.agent_apis as agent_apis
import gateway.api.proxy_endpoint as proxy_endpoint
import gateway.server_protocol as server_protocol
from gateway.app import create_app
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings, streaming
from tests.api.test_bounded_validation import long_grammar
from tests.conftest import free_port, serve_in_thread
from tests.state.conftest import RedisServer

pytestmark = pytest.mark.system

ASK: Any = [{"role": "user", "content": "Answer."}]


def key(name: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest(), **limits}


KEYS = [
    key("victim"),
    key("no-model", models=["some-other-model"], requests_per_minute=1),
    key("slow", requests_per_minute=1),
    key("one-at-a-time", max_in_flight=1),
    key("few-tokens", tokens_per_minute=1000),
]


@pytest.fixture(scope="module", params=["in-process", "shared"])
def keyed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """The same checks with the key budgets kept in this process and kept in a real Redis (``state.url``)."""
    specs = [SimSpec(engine="vllm", model="m", name="v0", time_scale=TIME_SCALE),
             SimSpec(engine="vllm", model="m-slow", name="v1", time_scale=1.0)]  # (a stream that stays open)
    with contextlib.ExitStack() as stack:
        extra: dict[str, Any] = {}
        if request.param == "shared":
            redis = RedisServer(free_port(), tmp_path_factory.mktemp("redis")).start()
            stack.callback(redis.kill)
            extra["state"] = {"url": redis.url, "heartbeat_seconds": 0.2}
        fleet = stack.enter_context(FleetThread(specs))
        app = create_app(gateway_settings(fleet.fleet.servers, auth={"keys": KEYS}, **extra))
        gateway = stack.enter_context(serve_in_thread(app))
        yield Running(fleet, gateway, app)


class Work:
    """Counts the costly steps requests reached: parsing a body, translating an agent API request, validating
    a constraint in a worker."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, running: Running) -> None:
        self.done: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._local = threading.local()
        workers = running.app.gateway.validation_workers

        def counting(step: str, function: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                with self._lock:
                    self.done[(step, "any")] += 1
                return function(*args, **kwargs)
            return counted

        validate = workers.validate

        async def validated(constraint: Any, *owner: str) -> Any:
            with self._lock:
                self.done[("validate", "any")] += 1
            return await validate(constraint, *owner)

        monkeypatch.setattr(proxy_endpoint, "parse_body", counting("parse", proxy_endpoint.parse_body))
        monkeypatch.setattr(agent_apis, "responses_to_chat", counting("translate", agent_apis.responses_to_chat))
        monkeypatch.setattr(agent_apis, "messages_to_chat", counting("translate", agent_apis.messages_to_chat))
        monkeypatch.setattr(workers, "validate", validated)

    def total(self) -> int:
        return sum(self.done.values())


def post(running: Running, name: str, body: dict[str, Any], path: str = "/v1/chat/completions",
         **headers: str) -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60,
                      headers={"authorization": f"Bearer sk-{name}", **headers})


def wide_grammar(tag: str) -> str:
    """~127 KB in 1,900 rules, within every limit (so it goes to a worker), distinct per ``tag``."""
    lines = ["root ::= r1"] + [f'r{i} ::= "{tag}-word-{i}-{"x" * 11}" [a-z]* ("," [0-9]+)? r{i + 1}'
                               for i in range(1, 1_900)]
    return "\n".join([*lines, 'r1900 ::= "."']) + "\n"


def heavy(i: int = 0) -> dict[str, Any]:
    """A chat request with a ~60 KB grammar: validated in a worker process, not on the event loop."""
    return {"model": "m", "messages": ASK, "max_tokens": 2, "grammar": long_grammar(1_300, f'"x{i}"')}


def test_a_key_refused_by_its_own_checks_costs_the_gateway_no_parse_translation_or_validation(
        keyed: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    work = Work(monkeypatch, keyed)
    refusals = [
        ("no-model", heavy(), "/v1/chat/completions", 403, "model_not_allowed"),
        ("no-model", {"model": "m", "max_output_tokens": 4, "input": [{"role": "user", "content": "x"}] * 50},
         "/v1/responses", 403, "model_not_allowed"),
        ("no-model", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}] * 50},
         "/v1/messages", 403, None),  # (Anthropic's error shape: no code)
        ("nobody", heavy(), "/v1/chat/completions", 401, "invalid_api_key"),
    ]
    for name, body, path, status, code in refusals:
        reply = post(keyed, name, body, path)
        assert reply.status_code == status, reply.text
        if code is not None:
            assert reply.json()["error"]["code"] == code
    assert work.total() == 0, work.done

    # a key whose budget is spent: its first request is served, the next refused before anything is done for it
    assert post(keyed, "slow", {"model": "m", "messages": ASK, "max_tokens": 2}).status_code == 200
    parsed = work.done[("parse", "any")]
    reply = post(keyed, "slow", heavy())
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "rate_limit_requests"
    assert work.done[("parse", "any")] == parsed and work.done[("validate", "any")] == 0


def test_a_key_at_its_max_in_flight_is_refused_before_its_constraint_is_validated(
        keyed: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    work = Work(monkeypatch, keyed)
    body = {"model": "m-slow", "messages": ASK, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with streaming(keyed.url, "sk-one-at-a-time", body):  # the key's one place is taken
        reply = post(keyed, "one-at-a-time", heavy(1))
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "concurrency_limit"
    assert work.done[("validate", "any")] == 0 and work.done[("parse", "any")] == 1


def test_a_spent_token_budget_refuses_before_validation(keyed: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    work = Work(monkeypatch, keyed)
    # a prompt of ~3,000 tokens overdraws a 1,000 tokens/min budget
    first = post(keyed, "few-tokens", {"model": "m", "messages": [{"role": "user", "content": "word " * 3000}],
                                       "max_tokens": 2})
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] > 1000
    parsed = work.done[("parse", "any")]
    reply = post(keyed, "few-tokens", heavy(3))
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "rate_limit_tokens"
    assert work.done[("parse", "any")] == parsed and work.done[("validate", "any")] == 0


def test_the_grammar_flood_of_a_key_allowed_no_model_never_reaches_the_workers(
        keyed: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack as it was run: 30 connections sending distinct large grammars for a key allowed no model at
    1 request/min, while another tenant asks for its own schema-constrained answer."""
    work = Work(monkeypatch, keyed)
    stop = threading.Event()
    statuses: Counter[int] = Counter()

    def flood(connection: int) -> None:
        with httpx.Client(base_url=keyed.url, timeout=60,
                          headers={"authorization": "Bearer sk-no-model"}) as client:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": "m", "messages": ASK, "max_tokens": 2, "grammar": wide_grammar(f"c{connection}-{i}")}
                statuses[client.post("/v1/chat/completions", json=body).status_code] += 1

    with ThreadPoolExecutor(30) as pool:
        for connection in range(30):
            pool.submit(flood, connection)
        try:
            for i in range(3):  # (~2.7 KB each: past what the event loop checks, a worker's in ~10 ms; a 60 KB grammar
                # takes up to the 0.4 s of a core llama.cpp's stack search may spend, a load this test does not measure)
                victim = {"model": "m", "messages": ASK, "max_tokens": 2, "grammar": long_grammar(60, f'"v{i}"')}
                reply = post(keyed, "victim", victim)
                assert reply.status_code == 200, reply.text
        finally:
            stop.set()
    assert set(statuses) == {403} and sum(statuses.values()) >= 30, statuses
    assert work.done[("validate", "any")] == 3  # the victim's, and only those


def _open_body(running: Running, key: str, declared: int) -> socket.socket:
    """A connection that has sent a request's head and the first byte of a body of ``declared`` bytes."""
    connection = socket.create_connection(("127.0.0.1", running.gateway.port), timeout=30)
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer sk-" + key.encode() + b"\r\nContent-Length: "
                       + str(declared).encode() + b"\r\n\r\n{")
    return connection


def test_a_key_trickling_bodies_holds_no_more_than_its_max_in_flight_connections(
        keyed: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key's max_in_flight place is taken before its body is read: a key sending bodies a byte at a time (each
    gap under server.body_timeout) held every connection the gateway had, and its refused connections stayed
    open for as long as it trickled the rest of the body nobody read."""
    monkeypatch.setattr(server_protocol, "LINGER_SECONDS", 0.5)
    held = _open_body(keyed, "one-at-a-time", 1000)
    refused = _open_body(keyed, "one-at-a-time", 1000)
    try:
        answer = refused.recv(65536)
        assert answer.startswith(b"HTTP/1.1 429") and b"concurrency_limit" in answer, answer[:200]
        refused.sendall(b" " * 10)  # the client goes on trickling the body nobody reads: the connection ends anyway
        assert refused.recv(65536) == b""  # (closed LINGER_SECONDS after the answer, not after body_timeout)
    finally:
        held.close()
        refused.close()


def test_a_refused_upload_gets_its_answer_not_a_reset(keyed: Running) -> None:
    """The rest of a body is read and dropped after an early refusal, so the client still sending it reads the
    answer (closing with its bytes unread would reset the connection under it)."""
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 4_000_000}]}
    reply = post(keyed, "nobody", big)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
