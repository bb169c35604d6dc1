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
