"""A request slower than ``timeouts.first_byte`` on a backend that answers other requests meanwhile is the
request's doing (a long non-streamed generation), not the backend's: it does not count against the backend's
breaker. Sweep 9: one key's long non-streamed requests, 8 in flight, kept both backends of a model ejected while
another key's requests got 503. A backend that answers nothing meanwhile (stuck) still counts."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator

import httpx
import orjson

from gateway.app import GatewayApp, create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.conftest import ServerThread, serve_in_thread
from tests.waiting import wait_until

SLOW = {"model": "m", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400,
        "ignore_eos": True}
FAST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@contextlib.contextmanager
def _slow_vllm() -> Iterator[tuple[GatewayApp, ServerThread]]:
    """A gateway in front of one vLLM emulator at real speed: first_byte 1 s, ejected after 2 failures."""
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=1.0)]) as fleet:
        settings = settings_from_mapping({
            "backends": [{"name": "v", "engine": "vllm", "url": fleet.fleet.servers[0].url}],
            "timeouts": {"first_byte": 1.0}, "breaker": {"consecutive_failures": 2},
            "scrape": {"interval": 0.2, "timeout": 1.0}})
        app = create_app(settings)
        with serve_in_thread(app) as gw:
            yield app, gw


def test_slow_requests_on_a_backend_answering_others_do_not_eject_it() -> None:
    with _slow_vllm() as (app, gw), httpx.Client(timeout=30) as client:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            slow = [pool.submit(client.post, gw.url + "/v1/chat/completions", json=SLOW) for _ in range(3)]
            fast = client.post(gw.url + "/v1/chat/completions", json=FAST)  # (answered while they wait)
            assert fast.status_code == 200, fast.text
            assert [s.result().status_code for s in slow] == [504, 504, 504]
        assert app.gateway.pool.get("v").breaker.state.value == "closed"
        assert client.post(gw.url + "/v1/chat/completions", json=FAST).status_code == 200


def test_slow_requests_on_a_quiet_models_only_backend_passing_its_health_checks_do_not_eject_it() -> None:
    """Sweep 13: with nothing else sent to a model's only backend, one key's requests slower than first_byte
    ejected it (nothing answered meanwhile), and its next slow request, as the half-open probe, kept the backend
    from everyone until it timed out too. Its health checks passing meanwhile say it is up."""
    with _slow_vllm() as (app, gw), httpx.Client(timeout=30) as client:
        for _ in range(3):  # one after another: the backend serves nothing else meanwhile
            assert client.post(gw.url + "/v1/chat/completions", json=SLOW).status_code == 504
        assert app.gateway.pool.get("v").breaker.state.value == "closed"
        assert client.post(gw.url + "/v1/chat/completions", json=FAST).status_code == 200


def test_a_models_only_backend_answering_500_to_some_requests_is_not_ejected_by_them() -> None:
    """Sweep 10: llama.cpp answers 500 to a JSON-constrained answer cut short by max_tokens; with two backends the
    same 500 from both says the request is the cause, but a model's only backend had nothing to compare with, and
    one key's such requests (72 a minute) kept it ejected: everyone else got 503. A 5xx it answers now counts
    against neither; a backend that cannot be reached still does."""
    from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

    with ScriptedUpstream(mode="script", model="m") as upstream:
        upstream.script = lambda headers: (500, "application/json", [b'{"error": {"message": "boom", "code": 500}}'])
        app, server = gateway_over(upstream, backend={"engine": "llamacpp"}, breaker={"consecutive_failures": 2})
        with server as gw, httpx.Client(timeout=30) as client:
            statuses = [client.post(gw.url + "/v1/chat/completions", json=FAST).status_code for _ in range(6)]
            assert statuses == [500] * 6
            assert app.gateway.pool.get("scripted").breaker.state.value == "closed"


def test_a_half_open_probe_is_settled_when_the_backend_answers_not_when_its_stream_ends() -> None:
    """Sweep 11: after an ejection's cooldown the first request is the probe, and no other is routed there until
    it is settled; settled at the end of the attempt, one key's long stream as the probe kept a model's only
    backend from everyone for as long as it ran."""
    from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

    with ScriptedUpstream(mode="stream", model="m", tokens=20, every=0.1) as upstream:
        app, server = gateway_over(upstream, breaker={"consecutive_failures": 1, "cooldown_seconds": 0.05})
        breaker = app.gateway.pool.get("scripted").breaker
        with server as gw, httpx.Client(timeout=30) as client:

            async def eject() -> None:
                breaker.record(False)

            gw.call(eject())
            assert breaker.state.value == "open"
            wait_until(breaker.available, "the ejection's cooldown over")
            stream = {**FAST, "stream": True}
            with client.stream("POST", gw.url + "/v1/chat/completions", json=stream) as probe:
                assert probe.status_code == 200
                next(probe.iter_bytes())  # (the probe's stream has begun, and runs on)
                assert breaker.state.value == "closed" and not breaker.probing
                other = client.post(gw.url + "/v1/chat/completions", json=stream)
                assert other.status_code == 200, other.text


def test_every_backend_a_request_failed_over_from_with_a_5xx_is_charged_to_its_key() -> None:
    """Sweep 11: a request every engine answers 500 (llama.cpp's JSON answer cut short) was tried on each backend
    and charged once: N backends' prompt work for one charge."""
    import hashlib

    from gateway.app import create_app as make_app
    from tests.proxy.scripted_upstream import ScriptedUpstream

    error = (500, "application/json", [b'{"error": {"message": "boom", "code": 500}}'])
    with ScriptedUpstream(mode="script", model="m") as a, ScriptedUpstream(mode="script", model="m") as b:
        a.script = b.script = lambda headers: error
        key = {"name": "k", "key_sha256": hashlib.sha256(b"sk-k").hexdigest(), "tokens_per_minute": 60_000}
        settings = settings_from_mapping({
            "backends": [{"name": n, "engine": "vllm", "url": u.url} for n, u in (("a", a), ("b", b))],
            "auth": {"keys": [key]}, "scrape": {"interval": 0.2, "timeout": 1.0}})
        app = make_app(settings)
        with serve_in_thread(app) as gw:
            body = {"model": "m", "messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 1}
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-k"},
                           timeout=30)
            assert r.status_code == 500 and a.posts + b.posts == 2
            tokens = next(c for _, c in app.gateway.keys._clients if c.name == "k").tokens
            assert tokens is not None
            body_tokens = len(orjson.dumps(body)) // 4
            # both prompts charged (the bucket refills 1,000 a second meanwhile: some slack)
            assert 60_000 - tokens.level >= 2 * body_tokens - 300, (60_000 - tokens.level, body_tokens)


def test_one_keys_requests_that_backends_answer_500_eject_none_of_them_for_the_others() -> None:
    """Sweep 13: with ``retries.max_attempts: 1`` nothing compared backends, and one key's requests that both
    of a model's backends answered 500 (llama.cpp's JSON answer cut short) counted against each: both ejected,
    and another key got 503. An answered 5xx now counts only when another key met one too (or nothing else was
    answered for a while: see Breaker.corroborated)."""
    import hashlib

    from tests.proxy.scripted_upstream import ScriptedUpstream

    answer = orjson.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def scripted(upstream: ScriptedUpstream) -> Callable[[dict[str, str]], tuple[int, str, list[bytes]]]:
        def script(headers: dict[str, str]) -> tuple[int, str, list[bytes]]:
            if b'"crafted"' in upstream.seen_body:  # (the attacker's request: the engine's error, every time)
                return 500, "application/json", [b'{"error": {"message": "boom", "code": 500}}']
            return 200, "application/json", [answer]
        return script

    keys = [{"name": n, "key_sha256": hashlib.sha256(f"sk-{n}".encode()).hexdigest()} for n in ("attacker", "victim")]
    with ScriptedUpstream(mode="script", model="m") as a, ScriptedUpstream(mode="script", model="m") as b:
        a.script, b.script = scripted(a), scripted(b)
        settings = settings_from_mapping({
            "backends": [{"name": n, "engine": "vllm", "url": u.url} for n, u in (("a", a), ("b", b))],
            "auth": {"keys": keys}, "routing": {"policy": "round-robin"}, "retries": {"max_attempts": 1},
            "breaker": {"consecutive_failures": 2}, "scrape": {"interval": 0.2, "timeout": 1.0}})
        app = create_app(settings)
        with serve_in_thread(app) as gw, httpx.Client(timeout=30) as client:
            def ask(key: str) -> int:
                body = {**FAST, "user": "crafted" if key == "attacker" else "plain"}
                return client.post(gw.url + "/v1/chat/completions", json=body,
                                   headers={"authorization": f"Bearer sk-{key}"}).status_code

            # bursts of the attacker's (two in a row on each backend) between the victim's
            rounds = [([ask("attacker") for _ in range(4)], [ask("victim") for _ in range(2)]) for _ in range(6)]
            assert all(attacks == [500] * 4 and served == [200] * 2 for attacks, served in rounds), rounds
            breakers = {n: app.gateway.pool.get(n).breaker.state.value for n in ("a", "b")}
            assert breakers == {"a": "closed", "b": "closed"}
