"""What a real llama-server tells of its prompt cache on request, kept from a key of another cache domain.

llama.cpp keeps one cache for every request, so where keys have cache domains of their own the gateway takes its
cache figures out of the answers, and does not send the request fields that ask the server for more of them:
``verbose`` (the answer's ``__verbose`` carries ``tokens_cached`` and the prompt's ``timings``), ``return_progress``
(``prompt_progress.cache``), ``timings_per_token`` and ``response_fields`` (which pick fields of ``__verbose``).
Sweep 19 read a 4-digit PIN another key kept sending, in 60 guesses, through ``verbose``; and, with the server
configured as a plain ``openai`` engine, through ``return_progress``. The server's own answers are checked first:
each field does report the cache there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.llamacpp.server import LlamaServer
from tests.conftest import serve_in_thread
from tests.llamacpp.conftest import start_servers

pytestmark = pytest.mark.system

REPORTS = {"verbose": True, "return_progress": True, "timings_per_token": True,
           "response_fields": ["tokens_cached", "timings/cache_n"]}
SYSTEM = "You are the bank's assistant. " + "The vault opens at nine and the branch closes at five. " * 12


@pytest.fixture(scope="module")
def server(llama_binary: Any, tiny_model: Any) -> Iterator[LlamaServer]:
    (one,) = start_servers(llama_binary, tiny_model, 1, slots=1, ctx=2048)
    yield one
    one.stop()


def body(stream: bool) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 2, "stream": stream, **REPORTS,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]}


def events(response: httpx.Response) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: {")]


def tells_the_cache(doc: dict[str, Any]) -> set[str]:
    """What of ``doc`` (an answer, or a streamed chunk) says how much of the prompt the server had cached."""
    told = {k for k in ("__verbose", "prompt_progress", "tokens_cached", "timings/cache_n") if k in doc}
    timings = doc.get("timings") or {}
    told |= {f"timings.{k}" for k in ("cache_n", "prompt_n", "prompt_ms") if k in timings}
    details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
    told |= {"cached_tokens"} if "cached_tokens" in details else set()
    return told


def test_the_server_itself_reports_its_cache_when_asked(server: LlamaServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/v1/chat/completions", json=body(False))  # (cached now)
        answer = c.post("/v1/chat/completions", json=body(False)).json()
        assert {"__verbose", "timings.cache_n", "cached_tokens"} <= tells_the_cache(answer), answer.keys()
        assert answer["__verbose"]["tokens_cached"] > 0 or answer["__verbose"].get("timings/cache_n", 0) > 0
        streamed = set().union(*(tells_the_cache(e) for e in events(c.post("/v1/chat/completions",
                                                                            json=body(True)))))
        assert {"__verbose", "prompt_progress"} <= streamed, streamed


@pytest.mark.parametrize("engine", ["llamacpp", "openai"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_key_of_another_domain_is_told_nothing_of_the_cache_whatever_it_asks(
        server: LlamaServer, engine: str, stream: bool) -> None:
    keys = [{"name": n, "key_sha256": hashlib.sha256(n.encode()).hexdigest()} for n in ("tenant-a", "tenant-b")]
    settings = settings_from_mapping({"backends": [{"name": "l", "engine": engine, "url": server.url}],
                                      "auth": {"keys": keys}})
    with serve_in_thread(create_app(settings)) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as c:
        model = c.get("/v1/models", headers={"authorization": "Bearer tenant-a"}).json()["data"][0]["id"]
        ask = {**body(stream), "model": model}
        assert c.post("/v1/chat/completions", json=ask, headers={"authorization": "Bearer tenant-a"}).is_success
        response = c.post("/v1/chat/completions", json=ask, headers={"authorization": "Bearer tenant-b"})
        assert response.status_code == 200, response.text
        docs = events(response) if stream else [response.json()]
        assert docs and all(not tells_the_cache(d) for d in docs), [tells_the_cache(d) for d in docs]
