"""Fields a prefill/decode router sets reach no engine from a client: vLLM's ``kv_transfer_params`` (where a
decode instance pulls a prompt's KV blocks from: host, port and block ids) and SGLang's ``bootstrap_*``. On an
engine run with a KV connector they would steer its transfers to another request's blocks or to any host."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

STEERING = {"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 5600,
                                   "remote_block_ids": [1, 2, 3], "remote_engine_id": "prefill-0"},
            "bootstrap_host": "10.0.0.9", "bootstrap_port": 8998, "bootstrap_room": 42}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_a_clients_prefill_decode_fields_reach_no_engine(engine: str, route: str) -> None:
    ask = ({"messages": [{"role": "user", "content": "hi"}]} if route == "chat/completions" else {"prompt": "hi"})
    with ScriptedUpstream(mode="complete", tokens=2) as upstream:
        upstream.get_answers["/ready"] = (404, b"")  # (an SGLang before 0.5.20: its models list says ready)
        upstream.get_answers["/v1/loads"] = (200, b'{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}')
        _app, server = gateway_over(upstream, backend={"engine": engine})
        with server as gw:
            answer = httpx.post(f"{gw.url}/v1/{route}", json={"model": "m", "max_tokens": 2, **ask, **STEERING})
            assert answer.status_code == 200, answer.text
            sent = orjson.loads(upstream.seen_body)
    assert not set(STEERING) & set(sent), sent
    assert sent["max_tokens"] == 2  # (the rest as the client sent it)


@pytest.mark.parametrize(("field", "value"), [
    ("lora_path", "tenant-a-adapter"), ("custom_logit_processor", "gASV..."),
    ("logits_processors", ["my.module.Processor"]), ("session_params", {"id": "s-1", "rid": "r-1"}),
    ("session_id", "s-1"), ("input_ids", [1, 2, 3]), ("lora", [{"id": 0, "scale": 1.0}]),
    ("grammar_triggers", [{"type": 9, "value": "x"}]), ("chat_format", 99999),
    # sweep 22: a prompt in place of the one checked and charged, a template of the client's own, and TabbyAPI's
    # second prompt (400,000 characters charged 16 tokens)
    ("prompt_embeds", "AAAA"), ("chat_template", "{{ messages }}"), ("negative_prompt", "x" * 1000),
])
def test_an_engine_field_that_picks_weights_runs_code_or_reopens_a_session_is_a_400(field: str, value: object) -> None:
    """Sweep 19: a key allowed only the base model named another tenant's adapter in SGLang's lora_path (which
    SGLang serves, whatever the model says); custom_logit_processor is code SGLang runs where it is enabled, and
    logits_processors code vLLM loads. Dropped, the client would be served as if they had been honoured: a 400."""
    with ScriptedUpstream(mode="complete", tokens=2) as upstream:
        _app, server = gateway_over(upstream)
        with server as gw:
            answer = httpx.post(f"{gw.url}/v1/chat/completions", json={
                "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], field: value})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
    assert upstream.posts == 0


def test_a_clients_own_llamacpp_slot_reaches_no_engine() -> None:
    """The gateway places a llama.cpp request in a slot (id_slot) where its prefix routing says; a client's own
    id_slot pinned any tenant's slot, evicting the prompt cached there. Without a placement of the gateway's,
    the engine chooses."""
    from gateway.app import create_app
    from gateway.sim import FleetThread, SimSpec
    from tests.api.conftest import gateway_settings
    from tests.conftest import serve_in_thread

    with FleetThread([SimSpec(engine="llamacpp", model="m", name="l", time_scale=40.0)]) as fleet:
        settings = gateway_settings(fleet.fleet.servers, routing={"policy": "round-robin"})
        with serve_in_thread(create_app(settings)) as gw:
            answer = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
                "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "id_slot": 1})
            assert answer.status_code == 200, answer.text
            sent = [q.body for q in list(fleet.fleet["l"].received) if q.path == "/v1/chat/completions"]
    assert sent and all("id_slot" not in body for body in sent), sent
