"""A gateway in front of an engine that answers garbage on its control plane (a raw scripted backend): the
security sweep's findings on the gateway -> engine boundary, end to end."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import httpx
import orjson
import pytest

from gateway.engines.readings import MAX_MODELS
from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over
from tests.waiting import wait_until

NAN = b"vllm:num_requests_running NaN\nvllm:num_requests_waiting -1e308\nvllm:kv_cache_usage_perc NaN\n"


def test_a_backend_whose_load_turns_to_nan_and_then_goes_down_is_marked_down() -> None:
    with ScriptedUpstream() as upstream:
        upstream.get_answers["/metrics"] = (200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        _app, server = gateway_over(upstream, backend={"engine": "vllm"})
        with server as gw:
            assert httpx.get(gw.url + "/ready").json()["backends"]["scripted"]["routable"] is True
            upstream.get_answers["/metrics"] = (200, NAN)
            seen = upstream.gets.get("/metrics", 0)

            def scrape_errors() -> float:
                found = re.search(r'gateway_backend_scrape_errors_total\{backend="scripted",engine="vllm"\} (\S+)',
                                  httpx.get(gw.url + "/metrics").text)
                return float(found[1]) if found else 0.0

            # the engine counts a read when asked, the gateway its error once the answer is parsed: wait for both
            wait_until(lambda: upstream.gets.get("/metrics", 0) >= seen + 3 and scrape_errors() >= 3,
                       "the NaN load read three times, each counted an error", within=20)
            ready = httpx.get(gw.url + "/ready")
            assert ready.status_code == 200 and ready.json()["backends"]["scripted"]["routable"] is True

            upstream.get_answers["/health"] = (503, b'{"error": "engine dead"}')
            wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 503, "/ready says not ready", within=20)
            assert httpx.get(gw.url + "/ready").json()["backends"]["scripted"]["health"] == "down"
            r = httpx.post(gw.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503, r.text


def test_a_gateway_starts_in_front_of_an_engine_reporting_nan_load() -> None:
    with ScriptedUpstream() as upstream:
        upstream.get_answers["/metrics"] = (200, NAN)
        _app, server = gateway_over(upstream, backend={"engine": "vllm"})
        with server as gw:
            assert httpx.get(gw.url + "/ready").status_code == 200
            r = httpx.post(gw.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert r.status_code == 200 and "data: [DONE]" in r.text


def keyed(tokens_per_minute: int) -> dict[str, Any]:
    return {"auth": {"keys": [{"name": "team", "key_sha256": hashlib.sha256(b"sk-team").hexdigest(),
                               "tokens_per_minute": tokens_per_minute}]}}


def test_a_backend_reporting_negative_usage_does_not_refill_the_keys_token_budget() -> None:
    """The sweep's backend answered ``prompt_tokens: -1000000``: settling against it refilled the key's token
    bucket to the full, whatever the key had spent. No reading, it is charged the gateway's own count (the most its
    prompt can cost, a token a byte of its body: more than the 30 tokens left; tests/proxy/test_garbage_usage.py)."""
    honest = {"prompt_tokens": 82, "completion_tokens": 8, "total_tokens": 90}  # (no more than max_tokens)
    with ScriptedUpstream(mode="complete", tokens=8) as upstream:
        _app, server = gateway_over(upstream, **keyed(300))
        with server as gw:
            def ask() -> int:
                return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-team"},
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 8}).status_code

            upstream.usage = honest
            spent = [ask() for _ in range(3)]  # 270 of the key's 300 tokens
            upstream.usage = {"prompt_tokens": -1_000_000, "completion_tokens": 8, "total_tokens": -999_992}
            hostile = ask()
            upstream.usage = honest
            after = [ask() for _ in range(6)]
    assert spent == [200] * 3 and hostile == 200
    # the key in debt: 429 until it has refilled; refilled to 300 by the hostile answer, the key had four more
    assert after == [429] * 6, after


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("usage", [(2**27, 2**27), (5, 2**27), (2**27, 5), (5, 2**27, "no max_tokens")],
                         ids=["both", "completion", "prompt", "completion-no-max-tokens"])
def test_usage_a_request_could_not_have_cost_is_no_reading(stream: bool, usage: tuple[Any, ...]) -> None:
    """Sweep 22: an engine answering a request of max_tokens 5 with 134 million tokens of usage (each figure
    within what a usage figure may be) put a key of a million tokens a minute 4.5 hours in debt, streamed too.
    A prompt more than twice its body's bound, or a completion past max_tokens, is no reading: the key is charged
    the gateway's own count, and keeps being served. Sweep 23: without max_tokens, on a backend that lists no
    context (a plain openai one), the completion was not bounded at all: it is by limits.max_tokens."""
    bounded = {"max_tokens": 5} if len(usage) == 2 else {}
    with ScriptedUpstream(mode="stream" if stream else "complete", tokens=3) as upstream:
        _app, server = gateway_over(upstream, **keyed(100_000))
        with server as gw:
            def ask() -> int:
                return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-team"},
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                        **bounded, "stream": stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {})},
                                  timeout=30).status_code

            upstream.usage = {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                              "total_tokens": usage[0] + usage[1]}
            hostile = [ask() for _ in range(3)]
            upstream.usage = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43}
            after = [ask() for _ in range(3)]
    assert hostile == [200] * 3 and after == [200] * 3, (hostile, after)


def test_a_backend_listing_many_models_is_served_for_a_thousand_and_one_listing_300000_is_no_backend() -> None:
    many = orjson.dumps({"object": "list", "data": [{"id": f"m-{i:06d}", "object": "model"} for i in range(5000)]})
    flood = orjson.dumps({"object": "list", "data": [{"id": f"m-{i:09d}", "object": "model"}
                                                     for i in range(300_000)]})
    with ScriptedUpstream() as upstream:
        upstream.get_answers["/v1/models"] = (200, many)
        _app, server = gateway_over(upstream)
        with server as gw:
            listed = httpx.get(gw.url + "/v1/models").json()["data"]
            assert len(listed) == MAX_MODELS and listed[0]["id"] == "m-000000"
            upstream.get_answers["/v1/models"] = (200, flood)  # ~11 MB: more than any models answer may be
            wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 503,
                       "the flooding backend is down", within=20)
            assert httpx.get(gw.url + "/v1/models").json()["data"] == []


@pytest.mark.parametrize("status", [204, 304, 302, 201, 600, 999])
def test_a_status_no_inference_api_answers_is_a_502_and_the_clients_connection_goes_on(status: int) -> None:
    """Sweep 19: a 204 or 304 was relayed with the engine's JSON body (the next request on that connection met
    the body: "illegal status line"), and a status past 599 crashed the gateway's own status line: the client's
    connection closed with no answer and no failover. They are the backend failing now: 502, and a next backend
    tried where there is one."""
    body = b'{"error": {"message": "odd"}}'
    with ScriptedUpstream(mode="script") as upstream:
        upstream.script = lambda _headers: (status, "application/json", [body])
        _app, server = gateway_over(upstream, retries={"max_attempts": 1})
        with server as gw, httpx.Client(base_url=gw.url) as client:
            ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            odd = client.post("/v1/chat/completions", json=ask)
            assert odd.status_code == 502 and odd.json()["error"]["code"] == "upstream_failed", odd.text
            assert client.get("/v1/models").status_code == 200  # (the same connection: nothing left on it)


@pytest.mark.parametrize("dies", [True, False], ids=["engine-gone-after", "engine-still-up"])
def test_a_request_after_which_two_engines_stopped_answering_is_not_sent_to_a_third(dies: bool) -> None:
    """Sweep 20: a request that aborted its llama-server was failed over to the next backend, which it aborted too:
    one request took every backend of the model down. An engine that stops answering after a request most often
    died of its own (killed, out of memory), and the request goes on to the next backend; when a second one stops
    answering after the same request, it is sent to no third (a 502 saying so). Backends that still answer hand it
    on as before."""
    from gateway.app import create_app
    from gateway.config import settings_from_mapping
    from tests.conftest import serve_in_thread

    with ScriptedUpstream(mode="script") as a, ScriptedUpstream(mode="script") as b, \
            ScriptedUpstream(mode="script") as c:
        def poisoned(upstream: ScriptedUpstream) -> Any:
            def answer(_headers: dict[str, str]) -> tuple[int, str, list[bytes]]:
                if dies:  # (its health check fails from now on, as an engine that aborted)
                    upstream.get_answers["/v1/models"] = (503, b'{"error": "gone"}')
                return 999, "application/json", [b"{}"]
            return answer

        upstreams = {"a": a, "b": b, "c": c}
        for upstream in upstreams.values():
            upstream.script = poisoned(upstream)
        settings = settings_from_mapping({
            "backends": [{"name": name, "engine": "openai", "url": u.url} for name, u in upstreams.items()],
            "scrape": {"interval": 0.1, "timeout": 1.0}, "retries": {"max_attempts": 3}})
        with serve_in_thread(create_app(settings)) as gw:
            wait_until(lambda: len(httpx.get(gw.url + "/ready").json()["models"]["m"]["backends"]) == 3,
                       "the three backends ready")
            answer = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 502, answer.text
    posts = sorted(u.posts for u in upstreams.values())
    if dies:
        assert posts == [0, 1, 1] and "it is not sent to another" in answer.text, (posts, answer.text)
    else:
        assert posts == [1, 1, 1], "failed over to each, which failed it too"


def test_a_path_token_echoed_in_an_error_of_a_200_body_is_redacted() -> None:
    """Sweep 21: with a token in the backend URL's path, an engine's 200 body holding an error that names the path
    reached the client whole (such a body was scrubbed for credentials only, as an answer is); it fails as an
    engine's error now (sweep 22), its message scrubbed, the backend's address and path included."""
    from gateway.app import create_app
    from gateway.config import settings_from_mapping
    from tests.conftest import serve_in_thread

    with ScriptedUpstream(mode="script") as upstream:
        upstream.script = lambda _headers: (200, "application/json", [orjson.dumps(
            {"error": {"message": "upstream /t/TOKSECRETPATH123/v1/chat/completions failed"}})])
        settings = settings_from_mapping({"backends": [{"name": "p", "engine": "openai",
                                                        "url": upstream.url + "/t/TOKSECRETPATH123"}],
                                          "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(settings)) as gw:
            wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 200, "the backend ready")
            answer = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 502 and "TOKSECRETPATH123" not in answer.text, answer.text
    assert "upstream backend p/v1/chat/completions failed" in answer.text, answer.text


ERROR_SHAPES = {"error": {"error": {"message": "engine is sad", "type": "InternalError"}},
                "beside-empty-choices": {"error": {"message": "engine is sad"}, "choices": []},
                "beside-null-data": {"error": "engine is sad", "data": None},
                "old-vllm": {"object": "error", "message": "engine is sad", "type": "InternalServerError"},
                "detail": {"detail": "engine is sad"},
                "huge": {"error": {"message": "engine is sad " + "x" * 20_000_000}}}
# sweep 23: no error, and no answer either (an engine answering this at once drew a latency-led policy's traffic)
NO_CHOICE = {"empty-choices": {"id": "c1", "object": "chat.completion", "choices": []},
             "no-choices": {"id": "c1", "object": "chat.completion", "usage": {"prompt_tokens": 1}}}


@pytest.mark.parametrize("shape", [*ERROR_SHAPES, *NO_CHOICE])
def test_an_engine_answering_200_with_an_error_fails_over_like_one_that_says_so(shape: str) -> None:
    """Sweep 22: a 200 body holding an error and no answer was relayed as the answer: never failed over (half the
    requests of a model another backend served got the error), and a 60 MB one was scrubbed whole on the event
    loop (another key's requests stalled 3.7 s). It is an engine's failure now: the request goes to the next
    backend, and where none is left the client gets a 502 with an excerpt of the engine's message. So is a chat
    answer with no choice (sweep 23)."""
    from gateway.app import create_app
    from gateway.config import settings_from_mapping
    from tests.conftest import serve_in_thread

    body = orjson.dumps(ERROR_SHAPES[shape] if shape in ERROR_SHAPES else NO_CHOICE[shape])
    with ScriptedUpstream(mode="script") as failing, ScriptedUpstream(mode="complete", tokens=3) as good:
        failing.script = lambda _headers: (200, "application/json", [body])
        backends = [{"name": "bad", "engine": "vllm", "url": failing.url},
                    {"name": "good", "engine": "vllm", "url": good.url}]
        settings = settings_from_mapping({"backends": backends, "routing": {"policy": "round-robin"},
                                          "scrape": {"interval": 0.1, "timeout": 1.0}})
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        with serve_in_thread(create_app(settings)) as gw:
            wait_until(lambda: httpx.get(gw.url + "/ready").json()["backends"]["bad"]["routable"]
                       and httpx.get(gw.url + "/ready").json()["backends"]["good"]["routable"], "both ready")
            answers = [httpx.post(gw.url + "/v1/chat/completions", json=ask, timeout=30) for _ in range(6)]
            assert [a.status_code for a in answers] == [200] * 6, [a.text[:200] for a in answers]
            assert all(a.json()["choices"] for a in answers)
            assert failing.posts >= 1, "round-robin sent some to the failing backend first"
        settings = settings_from_mapping({"backends": backends[:1], "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(settings)) as gw:
            wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 200, "the backend ready")
            alone = httpx.post(gw.url + "/v1/chat/completions", json=ask, timeout=30)
    assert alone.status_code == 502, alone.text[:300]
    message = alone.json()["error"]["message"]
    said = "answered 200 with an error and no answer: engine is sad" if shape in ERROR_SHAPES else \
        'answered 200 with no choice: {"id":"c1"'
    assert said in message and len(message) < 600, message


def test_a_failover_is_charged_a_prompt_the_request_could_have_cost() -> None:
    """Sweep 23: a request failed over from a backend is charged its prompt for that backend too, as the engine
    that answered counted it, unchecked: an answer claiming 134 million prompt tokens put the key hours in debt.
    A figure past the prompt's bound is no reading there either."""
    from gateway.app import create_app
    from gateway.config import settings_from_mapping
    from tests.conftest import serve_in_thread

    with ScriptedUpstream(mode="script") as failing, ScriptedUpstream(mode="complete", tokens=3) as answering:
        failing.script = lambda _h: (500, "application/json", [b'{"error": {"message": "down"}}'])
        answering.usage = {"prompt_tokens": 2**27, "completion_tokens": 3, "total_tokens": 2**27 + 3}
        settings = settings_from_mapping({
            "backends": [{"name": "a", "engine": "vllm", "url": failing.url},
                         {"name": "b", "engine": "vllm", "url": answering.url}],
            "routing": {"policy": "round-robin"}, "scrape": {"interval": 0.1, "timeout": 1.0},
            "breaker": {"consecutive_failures": 1000, "min_requests": 1000}, **keyed(100_000)})
        app = create_app(settings)
        with serve_in_thread(app) as gw:
            wait_until(lambda: all(b.routable for b in app.gateway.pool.backends), "both ready")
            statuses = [httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": "Bearer sk-team"},
                                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 3}, timeout=30).status_code for _ in range(8)]
    assert failing.posts >= 2, "some requests were failed over"
    assert statuses == [200] * 8, statuses


@pytest.mark.parametrize("failing", ["stream-error", "404"])
def test_an_engine_failing_every_request_inside_a_200_stream_or_with_404_is_ejected(failing: str) -> None:
    """Sweep 23: an engine whose every stream was a 200 with an error event (or that answered 404 to everything)
    counted as succeeding: failing at once it looked fastest, drew nearly every request (748 errors to 1 answer)
    and was never ejected. Such answers count against it now, as a 5xx does."""
    from gateway.app import create_app
    from gateway.config import settings_from_mapping
    from tests.conftest import serve_in_thread

    error_event = b'data: {"error": {"message": "engine is sad", "type": "InternalError"}}\n\n'
    with ScriptedUpstream(mode="script") as bad, ScriptedUpstream(mode="stream", tokens=2) as good:
        bad.script = (lambda _h: (200, "text/event-stream", [error_event])) if failing == "stream-error" else (
            lambda _h: (404, "application/json", [b'{"error": {"message": "no such route"}}']))
        settings = settings_from_mapping({
            "backends": [{"name": "bad", "engine": "vllm", "url": bad.url},
                         {"name": "good", "engine": "vllm", "url": good.url}],
            "routing": {"policy": "round-robin"}, "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(settings)) as gw:
            wait_until(lambda: all(b["routable"] for b in httpx.get(gw.url + "/ready").json()["backends"].values()),
                       "both ready")
            ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
            served = [httpx.post(gw.url + "/v1/chat/completions", json=ask, timeout=30).headers.get(
                "x-gateway-backend") for _ in range(30)]
    assert bad.posts <= 8, (bad.posts, served)  # (5 in a row open the breaker; a half-open probe or two)
    assert served[-10:] == ["good"] * 10, served


def test_an_answer_whose_error_is_null_is_relayed_as_written() -> None:
    """Sweep 22: a Responses answer carries "error": null (OpenAI's shape); it was taken for an error and scrubbed
    as one, every mention of the backend's host in the generated text rewritten, for every tenant."""
    from gateway.app import create_app
    from gateway.config import settings_from_mapping
    from tests.conftest import serve_in_thread

    with ScriptedUpstream(mode="script") as upstream:
        text = f"the host is 127.0.0.1, see {upstream.url}/docs"
        answer = {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m",
                  "error": None, "incomplete_details": None,
                  "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                  "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}}
        upstream.script = lambda _headers: (200, "application/json", [orjson.dumps(answer)])
        settings = settings_from_mapping({"backends": [{"name": "p", "engine": "vllm", "url": upstream.url}],
                                          "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(settings)) as gw:
            wait_until(lambda: httpx.get(gw.url + "/ready").status_code == 200, "the backend ready")
            got = httpx.post(gw.url + "/v1/responses", timeout=30, json={"model": "m", "input": "hi", "store": False})
    assert got.status_code == 200, got.text
    assert got.json()["output"][0]["content"][0]["text"] == text, "passed through natively, as written"
