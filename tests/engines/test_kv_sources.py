"""Reading where vLLM and SGLang publish their KV events (``kv_events: discover``), one adapter at a time."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import BackendSettings
from gateway.engines.base import BackendError
from gateway.engines.sglang import SGLangAdapter
from gateway.engines.vllm import VLLMAdapter
from gateway.pool.state import KvEventSource

pytestmark = pytest.mark.unit


def read(adapter: Any, path: str, status: int, doc: Any, url: str = "http://10.0.0.5:8000") -> KvEventSource:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=doc) if request.url.path == path else httpx.Response(404)

    async def go() -> KvEventSource:
        async with httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(answer)) as client:
            result: KvEventSource = await adapter.read_kv_events(client)
            return result
    return asyncio.run(go())


def vllm_rank(**config: Any) -> dict[str, Any]:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
            "topic": "kv", **config}


def test_vllm_wildcard_hosts_become_the_backends_and_its_own_host_stays() -> None:
    got = read(VLLMAdapter(), "/kv_event_sources", 200, {"0": vllm_rank()})
    assert got == KvEventSource("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv")
    got = read(VLLMAdapter(), "/kv_event_sources", 200,
               {"0": vllm_rank(endpoint="tcp://0.0.0.0:6000", replay_endpoint=None)}, url="http://[fd00::5]:8000")
    assert got == KvEventSource("tcp://[fd00::5]:6000", None, "kv")
    got = read(VLLMAdapter(), "/kv_event_sources", 200, {"0": vllm_rank(endpoint="tcp://10.0.0.5:7000")})
    assert got.endpoint == "tcp://10.0.0.5:7000"
    got = read(VLLMAdapter(), "/kv_event_sources", 200, {"0": vllm_rank(endpoint="tcp://localhost:7000")},
               url="http://127.0.0.1:8000")
    assert got.endpoint == "tcp://localhost:7000"  # (a backend on this machine: any loopback address)


ECHO = "Bearer sk-backendSECRET-0123456789"


@pytest.mark.parametrize(("rank", "url", "said"), [
    # the final sweep, as a hostile engine: another machine, or another backend's socket there
    ({"endpoint": "tcp://10.9.9.9:7000"}, None, "not on the backend's own host 10.0.0.5"),
    ({"replay_endpoint": "tcp://10.9.9.9:7001"}, None, "not on the backend's own host"),
    # a topic ZMQ would keep as a trie of 200,000 nodes (closing the socket crashed the process)
    ({"topic": "x" * 200_000}, None, "at most 256 printable characters"),
    ({"topic": "a\nb"}, None, "printable"),
    # the credential it was sent, echoed as a host (a DNS lookup would carry it off the machine) or a path
    ({"endpoint": f"tcp://{ECHO}:5557"}, None, "no host name or address"),
    ({"replay_endpoint": "tcp://a b:49336"}, None, "no host name or address"),
    ({"replay_endpoint": "ipc:///tmp/x"}, None, "not on this one"),
    ({"replay_endpoint": "ipc:///tmp/" + "x" * 200}, "http://127.0.0.1:8000", "at most 107"),
    ({"endpoint": "tcp://*:99999999"}, None, "names no port"),
    ({"endpoint": "tcp://*:\u0664\u0669\u0668\u0663\u0665"}, None, "names no port"),  # (Arabic-Indic digits)
    ({"replay_endpoint": "ipc://@abstract-sock"}, "http://127.0.0.1:8000", "not an absolute path"),
    ({"replay_endpoint": "ipc://rel/x"}, "http://127.0.0.1:8000", "not an absolute path"),
])
def test_an_engine_names_no_address_but_its_own_and_no_unbounded_topic(rank: dict[str, Any], url: str | None,
                                                                         said: str) -> None:
    with pytest.raises(BackendError, match=said):
        read(VLLMAdapter(), "/kv_event_sources", 200, {"0": vllm_rank(**rank)},
             **({"url": url} if url else {}))
    kv = {"publisher": "zmq", "endpoint_host": "10.9.9.9", "endpoint_port_base": 5557, "dp_size": 1}
    with pytest.raises(BackendError, match="not on the backend's own host"):
        read(SGLangAdapter(), "/server_info", 200, {"kv_events": kv})
    with pytest.raises(BackendError, match="printable"):
        read(SGLangAdapter(), "/server_info", 200, {"kv_events": {**kv, "endpoint_host": "*", "topic": ECHO}})


@pytest.mark.parametrize(("status", "doc", "said"), [
    (404, {"detail": "Not Found"}, "404"),  # a release before the route
    (200, {}, "without --kv-events-config"),
    (200, {"0": vllm_rank(), "1": vllm_rank(endpoint="tcp://*:5558")}, "2 data-parallel ranks"),
    (200, {"0": vllm_rank(endpoint="inproc://cache")}, "cannot be reached"),
])
def test_vllm_showing_no_usable_source_says_why(status: int, doc: Any, said: str) -> None:
    with pytest.raises(BackendError, match=said):
        read(VLLMAdapter(), "/kv_event_sources", status, doc)


def test_sglang_reads_server_info_and_refuses_what_it_cannot_follow() -> None:
    kv = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "", "block_size": 16,
          "dp_size": 1, "replay_endpoint_port_base": 5558}
    got = read(SGLangAdapter(), "/server_info", 200, {"kv_events": kv, "version": "0.5.23"})
    assert got == KvEventSource("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "", 16)
    without_replay = {k: v for k, v in kv.items() if k != "replay_endpoint_port_base"}
    assert read(SGLangAdapter(), "/server_info", 200, {"kv_events": without_replay}).replay_endpoint is None
    for doc, said in (({"kv_events": None}, "without --kv-events-config"), ({}, "shows no"),
                      ({"kv_events": {**kv, "dp_size": 2}}, "data-parallel")):
        with pytest.raises(BackendError, match=said):
            read(SGLangAdapter(), "/server_info", 200, doc)


def test_discover_is_a_setting_of_its_own() -> None:
    entry = {"name": "v", "engine": "vllm", "url": "http://h:8000"}
    kv = BackendSettings.model_validate({**entry, "kv_events": "discover"}).kv_events
    assert kv is not None and kv.discover
    with pytest.raises(ValidationError, match="discover reads endpoint"):
        BackendSettings.model_validate({**entry, "kv_events": {"discover": True, "endpoint": "tcp://h:1"}})
    with pytest.raises(ValidationError, match="publishes no KV-cache events"):
        BackendSettings.model_validate({**entry, "engine": "tabbyapi", "kv_events": "discover"})
