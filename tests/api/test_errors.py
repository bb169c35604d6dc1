"""Every error is OpenAI-shaped with the right status: the gateway's own and the backends'."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import create_app
from tests.api.conftest import Running, gateway_settings
from tests.conftest import serve_in_thread
from tests.waiting import wait_until

CHAT = "/v1/chat/completions"


def assert_envelope(response: httpx.Response, status: int, *, param: str | None = None,
                    code: str | None = None) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    assert response.headers.get("x-request-id")
    error: dict[str, object] = body["error"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m-vllm"}', "messages"),
        (b'{"model": "m-vllm", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m-vllm", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "m-vllm", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"model": "m-vllm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (b'{"model": "m-vllm", "messages": [{"role": "user", "content": "x"}], "stream_options": {}}',
         "stream_options"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(engines: Running, body: bytes, param: str | None) -> None:
    response = httpx.post(engines.url + CHAT, content=body, headers={"content-type": "application/json"})
    assert_envelope(response, 400, param=param)


def test_route_specific_fields(engines: Running) -> None:
    assert_envelope(httpx.post(engines.url + "/v1/completions", json={"model": "m-vllm"}), 400, param="prompt")
    assert_envelope(httpx.post(engines.url + "/v1/embeddings", json={"model": "m-vllm", "input": []}), 400,
                    param="input")


def test_unknown_model_is_404_model_not_found(engines: Running) -> None:
    c = openai.OpenAI(base_url=engines.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"


def test_unknown_path_and_wrong_method(engines: Running) -> None:
    assert_envelope(httpx.get(engines.url + "/v1/nothing-here"), 404)
    response = httpx.get(engines.url + CHAT)
    assert_envelope(response, 405)
    assert response.headers["allow"] == "POST"


def test_body_over_the_limit_is_413(engines: Running) -> None:
    settings = gateway_settings(engines.fleet.fleet.servers, server={"max_body_bytes": 1000})
    with serve_in_thread(create_app(settings)) as gateway:
        big = {"model": "m-vllm", "messages": [{"role": "user", "content": "x" * 2000}]}
        assert_envelope(httpx.post(gateway.url + CHAT, json=big), 413)

        def chunks():  # no content-length: the limit holds while reading
            yield b'{"model": "m-vllm", "messages": [{"role": "user", "content": "'
            for _ in range(20):
                yield b"y" * 100
            yield b'"}]}'

        assert_envelope(httpx.post(gateway.url + CHAT, content=chunks()), 413)


@pytest.mark.parametrize("status", [500, 503])
def test_upstream_errors_keep_their_status_in_the_envelope(pair: Running, status: int) -> None:
    for server in pair.fleet.fleet.servers:
        server.faults.update({"error_rate": 1.0, "error_status": status})
    response = httpx.post(pair.url + CHAT, json={"model": "shared", "messages": [{"role": "user", "content": "x"}]})
    assert_envelope(response, status)
    assert response.headers["x-gateway-backend"] in {"vllm-a", "vllm-b"}


@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang", "tabbyapi"])
def test_an_engine_400_is_passed_back_as_400_in_openai_terms(engines: Running, engine: str) -> None:
    # each emulated engine, like the real one, rejects max_tokens beyond its context, in its own error shape
    # (4090 + the prompt's tokens is just past 4096: too close for the gateway's own estimate to refuse);
    # llama.cpp only a prompt that fills its context (it stops generating when the context is full)
    ask = ({"messages": [{"role": "user", "content": "word " * 4200}]} if engine == "llamacpp" else
           {"max_tokens": 4090, "messages": [{"role": "user", "content": "x"}]})
    response = httpx.post(engines.url + CHAT, json={"model": f"m-{engine}", **ask})
    error = assert_envelope(response, 400)
    assert error["type"] == "invalid_request_error"
    message = str(error["message"])
    assert message.endswith(f"(backend sim-{engine})")
    assert "context" in message or "max_seq_len" in message


def test_llamacpp_serves_max_tokens_past_its_context_and_the_answer_says_where_it_stops(engines: Running) -> None:
    """llama-server refuses only a prompt that fills its context and stops generating when the context is full
    (server-context.cpp): Claude Code's every request, ~12k tokens with max_tokens 32,000, was refused by the
    gateway in front of 32k llama.cpp slots that serve it (issue 42). vLLM refuses prompt plus max_tokens."""
    ask = {"max_tokens": 100_000, "messages": [{"role": "user", "content": "x"}]}
    served = httpx.post(engines.url + CHAT, json={"model": "m-llamacpp", **ask})
    assert served.status_code == 200, served.text
    assert served.headers["x-gateway-context-limit"] == "4096"
    refused = httpx.post(engines.url + CHAT, json={"model": "m-vllm", **ask})
    assert_envelope(refused, 400, param="max_tokens", code="context_length_exceeded")
    within = httpx.post(engines.url + CHAT, json={"model": "m-llamacpp", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "x"}]})
    assert within.status_code == 200 and "x-gateway-context-limit" not in within.headers


def test_a_request_no_backend_context_can_hold_is_refused_by_the_gateway(engines: Running) -> None:
    response = httpx.post(engines.url + CHAT, json={"model": "m-vllm", "max_tokens": 100_000,
                                                    "messages": [{"role": "user", "content": "x"}]})
    error = assert_envelope(response, 400, param="max_tokens", code="context_length_exceeded")
    assert "largest: 4096" in str(error["message"])
    # without max_tokens the prompt alone is too long: it is the field named, as OpenAI names it
    response = httpx.post(engines.url + CHAT, json={"model": "m-vllm",
                                                    "messages": [{"role": "user", "content": "word " * 20_000}]})
    error = assert_envelope(response, 400, param="messages", code="context_length_exceeded")
    assert "(its prompt)" in str(error["message"])


def test_no_backend_available_is_503_with_retry_after(pair: Running) -> None:
    for server in pair.fleet.fleet.servers:
        pair.fleet.call(server.stop())
    replies: list[httpx.Response] = []

    def unavailable() -> bool:  # (each refused request takes its backend out of rotation)
        replies.append(httpx.post(pair.url + CHAT, json={"model": "shared", "messages": [{"role": "user",
                                                                                           "content": "x"}]}))
        return replies[-1].status_code == 503

    wait_until(unavailable, "a 503 once both backends are stopped")
    response = replies[-1]
    assert_envelope(response, 503, code="no_backend_available")
    assert response.headers["retry-after"] == "1"
    # how many backends, in what state; not which (a DNS replica is named by its address: sweep 24)
    message = response.json()["error"]["message"]
    assert "of 2:" in message and "vllm-a" not in message and "vllm-b" not in message, message
    assert httpx.get(pair.url + "/ready").status_code == 503
    assert httpx.get(pair.url + "/health").status_code == 200
