"""A request of several generations (``n`` or llama.cpp's ``n_cmpl`` choices, a completions list of prompts) and a
real llama-server: the server answers it with the usage of one generation (checked first, on the server itself),
so the gateway could not charge it, and runs each generation in a slot of its own while the gateway would count
one. Sweep 19: a key ran 8x (n=8) to ~490x (512 prompts) its token budget and held every slot. Such a request is
refused where only llama.cpp serves the model, naming the field."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.engines.sampling import NAMES, SAMPLERS, whole_vocabulary
from gateway.llamacpp.server import LlamaServer
from gateway.structured.syntax import parse_grammar
from gateway.structured.syntax.parses import most_parses
from tests.conftest import serve_in_thread
from tests.llamacpp.conftest import start_servers

pytestmark = pytest.mark.system

ASK = [{"role": "user", "content": "Tell me about the gateway."}]


@pytest.fixture(scope="module")
def server(llama_binary: Any, tiny_model: Any) -> Iterator[LlamaServer]:
    (one,) = start_servers(llama_binary, tiny_model, 1, slots=4, ctx=4096)
    yield one
    one.stop()


def test_the_server_reports_the_usage_of_one_generation(server: LlamaServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        two = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "n": 2,
                                                   "ignore_eos": True}).json()
        assert len(two["choices"]) == 2 and two["usage"]["completion_tokens"] == 8, two["usage"]
        listed = c.post("/v1/completions", json={"prompt": ["one", "two", "three"], "max_tokens": 8,
                                                 "ignore_eos": True}).json()
        assert len(listed["choices"]) == 3 and listed["usage"]["completion_tokens"] == 8, listed["usage"]


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("chat/completions", {"messages": ASK, "n": 2}, "n"),
    ("chat/completions", {"messages": ASK, "n_cmpl": 4}, "n"),
    ("completions", {"prompt": ["one", "two"]}, "prompt"),
    ("completions", {"prompt": [[1, 2], [3, 4]]}, "prompt"),
])
def test_several_generations_are_refused_where_only_llamacpp_serves_the_model(
        server: LlamaServer, route: str, extra: dict[str, Any], param: str) -> None:
    settings = settings_from_mapping({"backends": [{"name": "l", "engine": "llamacpp", "url": server.url}]})
    with serve_in_thread(create_app(settings)) as gateway, httpx.Client(base_url=gateway.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        refused = c.post(f"/v1/{route}", json={"model": model, "max_tokens": 8, **extra})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == param and "one generation per request" in error["message"], error
        one = c.post(f"/v1/{route}", json={"model": model, "max_tokens": 8,
                                           **({"messages": ASK} if route == "chat/completions" else {"prompt": "one"})})
        assert one.status_code == 200, one.text


def test_llama_server_reads_the_sampler_names_as_the_gateway_does(server: LlamaServer) -> None:
    """The gateway judges a client's sampler chain (gateway.engines.sampling) by llama.cpp's names; the server says
    which samplers it built from them (generation_settings). Its own default chain, and its default top_k, are
    ones the gateway lets through."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for name, letter in SAMPLERS.items():
            for spelt in (name, name.upper()):
                built = c.post("/completion", json={"prompt": "hi", "n_predict": 1, "samplers": [spelt]}).json()
                assert [NAMES[s] for s in built["generation_settings"]["samplers"]] == [letter], (spelt, built)
        skipped = c.post("/completion", json={"prompt": "hi", "n_predict": 1, "samplers": ["typical_p"]}).json()
        assert skipped["generation_settings"]["samplers"] == [], "a name llama.cpp does not know is skipped"
        default = c.get("/props").json()["default_generation_settings"]["params"]
    assert whole_vocabulary({"samplers": default["samplers"], "top_k": default["top_k"]}) is None, default


@pytest.mark.parametrize("field", [{"top_k": 0}, {"top_k": -1}, {"samplers": "pk"}, {"samplers": ["typ_p", "top_k"]},
                                   {"mirostat": 2}], ids=["top_k-0", "top_k-1", "p-first", "typical-first", "mirostat"])
def test_sampling_the_whole_vocabulary_is_refused_where_only_llamacpp_serves(server: LlamaServer,
                                                                            field: dict[str, Any]) -> None:
    """Sweep 21: with top_k 0 and typical_p, or a chain with typical_p before top_k, llama-server sorts the whole
    vocabulary at every token on the loop every slot shares (a 128k vocabulary: another key's stream from 393 to
    46 tokens/s). The server takes such a request (checked first); the gateway refuses it, naming the field, and
    takes the same sampler with top_k first."""
    body = {"prompt": "hi", "max_tokens": 4, "typical_p": 0.99, **field}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
    settings = settings_from_mapping({"backends": [{"name": "l", "engine": "llamacpp", "url": server.url}]})
    with serve_in_thread(create_app(settings)) as gateway, httpx.Client(base_url=gateway.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        refused = c.post("/v1/completions", json={"model": model, **body})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == next(iter(field)) and "whole vocabulary" in error["message"], error
        fine = c.post("/v1/completions", json={"model": model, **body, "top_k": 40, "samplers": "kyt", "mirostat": 0})
        assert fine.status_code == 200, fine.text


@pytest.mark.parametrize("field", [{"grammar_triggers": [{"type": 9, "value": "x"}]}, {"chat_format": 99999}],
                         ids=["grammar_triggers", "chat_format"])
def test_a_field_that_aborts_llama_server_never_reaches_it(llama_binary: Any, tiny_model: Any,
                                                           field: dict[str, Any]) -> None:
    """Sweep 20: on /v1/completions llama-server reads a client's grammar_triggers (an unknown trigger type hits an
    assertion) and chat_format (an unknown format throws) and aborts; through the gateway one request of one key
    took every llama.cpp backend of the model down (the failover carried it to the next). The fields are set by
    llama.cpp's own chat templates: the gateway refuses them. The server's own behaviour is checked last (for
    the trigger)."""
    (fresh,) = start_servers(llama_binary, tiny_model, 1, slots=1, ctx=1024)
    try:
        settings = settings_from_mapping({"backends": [{"name": "l", "engine": "llamacpp", "url": fresh.url}]})
        with serve_in_thread(create_app(settings)) as gateway, httpx.Client(base_url=gateway.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            refused = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4, **field})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(field)), refused.text
            assert c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4}).is_success
        assert fresh.proc is not None and fresh.proc.poll() is None, "the server is still up"
        if "grammar_triggers" in field:  # (chat_format's abort came later in the sweep's runs: not waited for here)
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(fresh.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, **field}, timeout=30)
            assert fresh.proc.wait(timeout=30) != 0, "sent directly, the field ends llama-server"
    finally:
        fresh.kill()


def test_llama_server_pays_for_every_stack_the_gateway_counts(server: LlamaServer) -> None:
    """Sweep 22: llama.cpp checks every candidate token against each way its grammar's parse may go on (a stack),
    on the loop every slot shares; `root ::= s+` with 60 alternatives of a's cost 649 ms a token with a 128k
    vocabulary. The gateway counts the stacks as llama.cpp keeps them: here the real server's time a token grows
    with that count (1,831 stacks against 11: ~50-80x measured on 2 cores), and the gateway sends the grammar past
    its bound to no llama.cpp backend (a 400 naming where, when only llama.cpp serves), and passes the other."""
    def alternatives(longest: int) -> str:
        return "root ::= s+\ns ::= " + " | ".join('"' + "a" * k + '"' for k in range(1, longest + 1)) + "\n"

    few, many = alternatives(4), alternatives(60)
    assert [most_parses(parse_grammar(g, "gbnf"), 10**6, limit=10**6).count for g in (few, many)] == [11, 1831]

    def per_token(grammar: str) -> float:
        body = {"prompt": "hi", "n_predict": 48, "ignore_eos": True, "grammar": grammar, "cache_prompt": False}
        times = []
        for _ in range(2):
            answer = httpx.post(server.url + "/completion", json=body, timeout=300).json()
            assert answer["timings"]["predicted_n"] == 48 and set(answer["content"]) == {"a"}, answer
            times.append(answer["timings"]["predicted_per_token_ms"])
        return min(times)

    assert per_token(many) > 8 * per_token(few)
    settings = settings_from_mapping({"backends": [{"name": "l", "engine": "llamacpp", "url": server.url}]})
    with serve_in_thread(create_app(settings)) as gateway, httpx.Client(base_url=gateway.url, timeout=120) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        refused = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4, "grammar": many})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "grammar" and error["code"] == "constraint_too_large", error
        assert "ways at once (" in error["message"], error
        fine = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4, "grammar": few})
        assert fine.status_code == 200 and set(fine.json()["choices"][0]["text"]) <= {"a"}, fine.text
