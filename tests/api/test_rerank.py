"""/v1/rerank (and the aliases the engines use) through the gateway, routed like embeddings, on each emulated
engine: native on llama.cpp, vLLM and SGLang (each answering in its own shape; the gateway serves one), refused
for a model only TabbyAPI serves. The emulators serve exactly the rerank routes their engines do
(``gateway/sim/rerank.py``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.engines.sglang import rerank_answer
from tests.api.conftest import Running

DOCS = ["cats purr on the sofa", "the gateway routes requests to engines", "a gateway"]
QUERY = "which gateway routes requests"
NATIVE = ("llamacpp", "vllm", "sglang")


def rerank(running: Running, path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    return httpx.post(running.url + path, json=body, headers={"authorization": "Bearer client-key"})


@pytest.mark.parametrize("engine", NATIVE)
def test_rerank_ranks_on_every_engine_that_has_it_in_one_shape(engines: Running, engine: str) -> None:
    reply = rerank(engines, model=f"m-{engine}", query=QUERY, documents=DOCS, top_n=2)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-gateway-backend"] == f"sim-{engine}"
    doc = reply.json()
    # the engine's ranking (documents by the query's words they hold), best first, top_n kept; SGLang's bare
    # list came back in the shape the others answer
    assert [r["index"] for r in doc["results"]] == [1, 2]
    assert doc["results"][0]["relevance_score"] > doc["results"][1]["relevance_score"] > 0
    assert doc["usage"]["total_tokens"] > 0
    received = [r for r in list(engines.server(f"sim-{engine}").received) if "rerank" in r.path][-1]
    assert received.path == "/v1/rerank"


@pytest.mark.parametrize(("engine", "path"), [("vllm", "/rerank"), ("vllm", "/v2/rerank"),
                                              ("llamacpp", "/v1/reranking"), ("sglang", "/rerank")])
def test_the_engines_own_rerank_paths_are_served_too(engines: Running, engine: str, path: str) -> None:
    reply = rerank(engines, path, model=f"m-{engine}", query=QUERY, documents=DOCS)
    assert reply.status_code == 200, reply.text
    assert [r["index"] for r in reply.json()["results"]] == [1, 2, 0]


def test_document_objects_reach_the_engine_as_the_strings_it_takes(engines: Running) -> None:
    reply = rerank(engines, model="m-sglang", query=QUERY, documents=[{"text": d} for d in DOCS])
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert results[0] == {"index": 1, "relevance_score": 0.75, "document": {"text": DOCS[1]}}
    received = [r for r in list(engines.server("sim-sglang").received) if "rerank" in r.path][-1]
    assert received.body["documents"] == DOCS


def test_sglang_is_asked_for_every_result_so_the_key_pays_for_every_document_scored(engines: Running) -> None:
    """Sweep 17: SGLang scores every document, answers only ``top_n``, each with its own token count: a request
    of 200 documents and ``top_n: 1`` was charged 1/200 of the engine's work (~600x a key's tokens per minute).
    It is asked for all of them; the gateway keeps the best ``top_n`` and counts every one."""
    whole = rerank(engines, model="m-sglang", query=QUERY, documents=DOCS).json()
    best = rerank(engines, model="m-sglang", query=QUERY, documents=DOCS, top_n=1)
    assert best.status_code == 200, best.text
    assert [r["index"] for r in best.json()["results"]] == [1]
    assert best.json()["usage"] == whole["usage"] and whole["usage"]["total_tokens"] > 0
    received = [r for r in list(engines.server("sim-sglang").received) if "rerank" in r.path][-1]
    assert "top_n" not in received.body


def test_rerank_is_counted_under_its_route(engines: Running) -> None:
    rerank(engines, model="m-vllm", query=QUERY, documents=DOCS)
    metrics = httpx.get(engines.url + "/metrics").text
    assert 'gateway_requests_total{backend="sim-vllm",model="m-vllm",outcome="success",route="rerank"' in metrics


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m-vllm", "documents": DOCS}, "query"),
    ({"model": "m-vllm", "query": "q", "documents": []}, "documents"),
    ({"model": "m-vllm", "query": "q", "documents": ["a", 3]}, "documents[1]"),
    ({"model": "m-vllm", "query": "q", "documents": DOCS, "top_n": 0}, "top_n"),
    ({"model": "m-vllm", "query": "q", "documents": DOCS, "stream": True}, "stream"),
])
def test_a_bad_rerank_request_is_a_400_naming_the_field(engines: Running, body: dict[str, Any], param: str) -> None:
    reply = rerank(engines, **body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_too_many_documents_are_refused_before_any_engine_sees_them(engines: Running) -> None:
    reply = rerank(engines, model="m-vllm", query="q", documents=["d"] * 1025)
    assert reply.status_code == 400 and "at most 1024" in reply.json()["error"]["message"]


def test_rerank_for_a_model_only_an_engine_without_rerank_serves_is_refused_clearly(engines: Running) -> None:
    reply = rerank(engines, model="m-tabbyapi", query="q", documents=DOCS)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "unsupported_route" and "rerank" in error["message"]
    assert "llamacpp, sglang, vllm" in error["message"]


def test_an_sglang_answer_that_is_not_a_list_of_results_is_not_passed_on() -> None:
    with pytest.raises(ValueError, match="not a list"):
        rerank_answer(b'{"results": []}', "m")
