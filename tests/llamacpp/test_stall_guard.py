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
        "auth": {"keys": [key("attacker"), key("victim"), key("streamer"), key("bystander")]},
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
            # once the loop answered promptly, the bystander's requests still running there, it was found the cause
            wait_until(lambda: 'gateway_stall_guard_stops_total{backend="l",verdict="cause"} 1.0'
                       in httpx.get(gateway.url + "/metrics").text, "the stall found caused by it",
                       within=60)  # (the verdict waits up to 21.5 s for the engine to let the request go)
            again = attacker.post("/v1/completions", json=slow)
            assert again.status_code == 429, again.text
            assert again.json()["error"]["code"] == "constraint_stalled_engine", again.text
            assert int(again.headers["retry-after"]) > 500, again.headers
            other = attacker.post("/v1/completions", json=small)
            assert other.status_code == 429, other.text
            assert "this key" in other.json()["error"]["message"], other.text
            plain_answer = attacker.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4})
            assert plain_answer.status_code == 200, plain_answer.text  # (only requests with a grammar are kept)
            # another key's grammar still goes to llama.cpp, the same one too (a grammar is kept from the key that
            # sent it, never from every key): stopped in its turn
            fine = victim.post("/v1/completions", json=small)
            assert fine.status_code == 200 and set(fine.json()["choices"][0]["text"]) <= {"a"}, fine.text
            same = victim.post("/v1/completions", json=slow)
            assert same.status_code == 503 and same.json()["error"]["code"] == "engine_stalled", same.text

            # streamed: the stream ends with the error (the verdict after, as above: tests/proxy/test_stall_guard.py)
            streamer = httpx.Client(base_url=gateway.url, timeout=120,
                                    headers={"Authorization": "Bearer sk-streamer"})
            with streamer.stream("POST", "/v1/completions",
                                 json={**slow, "grammar": alternatives(301), "stream": True}) as streamed:
                assert streamed.status_code == 200
                events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
            assert '"code":"engine_stalled"' in events[-2].replace(" ", ""), events[-3:]
            assert events[-1] == "data: [DONE]" and len(events) > 3, events[-3:]
        finally:
            done.set()
            beside.join()
        assert statuses and set(statuses) == {200}, statuses
        for client in (attacker, victim, streamer, bystander):
            client.close()
