"""The emulators' rerank: exactly the routes each real engine serves, each in its engine's answer shape
(vLLM's Jina-style results with documents, llama.cpp's without, SGLang's bare list), ranked by relevance."""

from __future__ import annotations

import httpx
import pytest

from gateway.sim import FleetThread
from gateway.sim.rerank import PATHS

ALL_PATHS = sorted({p for paths in PATHS.values() for p in paths})
DOCS = ["nothing here", "the llama eats grass", "a llama"]


@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang", "tabbyapi"])
def test_each_emulator_serves_exactly_its_engines_rerank_paths(fleet: FleetThread, engine: str) -> None:
    served = PATHS.get(engine, ())
    for path in ALL_PATHS:
        reply = httpx.post(fleet.fleet[f"sim-{engine}"].url + path, json={"query": "llama grass", "documents": DOCS})
        assert (reply.status_code == 200) == (path in served), (engine, path, reply.status_code)


def test_the_three_answer_shapes(fleet: FleetThread) -> None:
    body = {"query": "llama grass", "documents": DOCS, "top_n": 2}
    vllm = httpx.post(fleet.fleet["sim-vllm"].url + "/v1/rerank", json=body).json()
    assert [(r["index"], r["relevance_score"], r["document"]["text"]) for r in vllm["results"]] == [
        (1, 1.0, DOCS[1]), (2, 0.5, DOCS[2])]
    assert vllm["usage"]["total_tokens"] > 0 and vllm["id"].startswith("rerank")
    llama = httpx.post(fleet.fleet["sim-llamacpp"].url + "/v1/rerank", json=body).json()
    assert llama["object"] == "list" and llama["results"] == [{"index": 1, "relevance_score": 1.0},
                                                              {"index": 2, "relevance_score": 0.5}]
    sglang = httpx.post(fleet.fleet["sim-sglang"].url + "/v1/rerank", json={**body, "return_documents": False}).json()
    assert isinstance(sglang, list)
    assert [(r["index"], r["score"], r["document"]) for r in sglang] == [(1, 1.0, None), (2, 0.5, None)]
    assert all(r["meta_info"]["prompt_tokens"] > 0 for r in sglang)


def test_a_rerank_without_documents_is_the_engines_400(fleet: FleetThread) -> None:
    reply = httpx.post(fleet.fleet["sim-vllm"].url + "/v1/rerank", json={"query": "q", "documents": []})
    assert reply.status_code == 400
