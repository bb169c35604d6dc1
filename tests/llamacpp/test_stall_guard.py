"""The stall guard on a real llama-server: a grammar whose parse goes many ways at once slows the loop every request
on the server shares (sweeps 22-28 found, each time, a form the static checks missed). Here the static checks are
taken out of the way (the backend is said to take any grammar), so the guard alone stands between one key's grammar
and the others: the request is stopped within a few of the loop's steps, and that key's requests with a grammar
are kept from llama.cpp; another key's are not."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.llamacpp.server import LlamaServer
from tests.conftest import serve_in_thread
from tests.llamacpp.conftest import start_servers
from tests.waiting import wait_until

pytestmark = pytest.mark.system


def alternatives(longest: int) -> str:
    """`root ::= s+` with ``longest`` alternatives of a's: after n a's, ~n ways at once (300: ~0.7 s a token here;
    4: ~0.4 ms)."""
    return "root ::= s+\ns ::= " + " | ".join('"' + "a" * k + '"' for k in range(1, longest + 1)) + "\n"


@pytest.fixture(scope="module")
def server(llama_binary: Any, tiny_model: Any) -> Iterator[LlamaServer]:
    (one,) = start_servers(llama_binary, tiny_model, 1, slots=3, ctx=4096)
    yield one
    one.stop()


def key(name: str) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest()}


def test_a_grammar_that_stalls_llama_server_is_stopped_and_kept_from_it(server: LlamaServer) -> None:
    settings = settings_from_mapping({
        "backends": [{"name": "l", "engine": "llamacpp", "url": server.url}],
        "scrape": {"interval": 0.2},
        "auth": {"keys": [key("attacker"), key("victim"), key("bystander")]},
        # (the threshold stall_seconds: the loop's step alone, 3 ms here, would put it at the 0.1 s floor, which
        # this tiny model's steps pass on a machine busy beside the test; measured below, on its own)
        "structured_output": {"stall_guard": {"measure_alone": False}},
    })
    app = create_app(settings)
    with serve_in_thread(app) as gateway:
        backend = app.gateway.pool.get("l")
        # (a form the static checks miss: the backend is said to take any grammar, as if the checks had passed it)
        backend.spec = dataclasses.replace(backend.spec, many_parses=True)
        wait_until(lambda: httpx.get(gateway.url + "/ready").status_code == 200, "the gateway ready", within=30)
        attacker = httpx.Client(base_url=gateway.url, timeout=120, headers={"Authorization": "Bearer sk-attacker"})
        victim = httpx.Client(base_url=gateway.url, timeout=120, headers={"Authorization": "Bearer sk-victim"})
        model = victim.get("/v1/models").json()["data"][0]["id"]
        slow = {"model": model, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "grammar": alternatives(300)}
        small = {"model": model, "prompt": "hi", "max_tokens": 8, "grammar": alternatives(4)}

        # a bystander's plain answers all along, one after another: each answered (and the engine at work for
        # others, which is what a verdict compares with)
        bystander = httpx.Client(base_url=gateway.url, timeout=120, headers={"Authorization": "Bearer sk-bystander"})
        statuses: list[int] = []
        done = threading.Event()

        def plain() -> None:
            while not done.is_set():
                r = bystander.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
                statuses.append(r.status_code)

        beside = threading.Thread(target=plain)
        beside.start()
        try:
            stopped = attacker.post("/v1/completions", json=slow)
            # (unstopped: 400 tokens at ~0.7 s each, the others' answers as slow; stopped after two slow readings)
            assert stopped.status_code == 503, stopped.text
            assert stopped.json()["error"]["code"] == "engine_stalled", stopped.text
            # its key's requests with a grammar held from llama.cpp at once (until the verdict, then struck for
            # strike_seconds if it was the cause: tests/proxy/test_stall_guard.py), its plain ones not
            again = attacker.post("/v1/completions", json=slow)
            assert again.status_code == 429, again.text
            assert again.json()["error"]["code"] == "constraint_stalled_engine", again.text
            assert int(again.headers["retry-after"]) >= 1, again.headers
            other = attacker.post("/v1/completions", json=small)
            assert other.status_code == 429 and "this key" in other.json()["error"]["message"], other.text
            plain_answer = attacker.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4})
            assert plain_answer.status_code == 200, plain_answer.text
            # another key's grammar still goes to llama.cpp
            fine = victim.post("/v1/completions", json=small)
            assert fine.status_code == 200 and set(fine.json()["choices"][0]["text"]) <= {"a"}, fine.text
        finally:
            done.set()
            beside.join()
        assert statuses and set(statuses) == {200}, statuses
        for client in (attacker, victim, bystander):
            client.close()


def test_an_idle_llama_servers_step_alone_is_measured_and_sets_the_threshold(server: LlamaServer) -> None:
    """Sweep 30: before any request taught the guard a usual its threshold was stall_seconds, and a grammar
    holding every step at 0.2-0.7 s ran unstopped. The idle engine's step alone, as llama-server times a few
    tokens of a plain request, sets it until then."""
    app = create_app(settings_from_mapping({"backends": [{"name": "l", "engine": "llamacpp", "url": server.url}],
                                            "scrape": {"interval": 0.2}}))
    with serve_in_thread(app):
        backend = app.gateway.pool.get("l")
        wait_until(lambda: backend.step_alone is not None, "the loop's step alone measured", within=30)
        alone = backend.step_alone
        assert alone is not None and 0 < alone < 1.0, alone
        assert app.gateway.dispatcher.guard.stall("l") == pytest.approx(min(1.0, max(0.1, 8 * alone)))
