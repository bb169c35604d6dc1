"""Rerank as the engines serve it: a query and documents in, each document's relevance out, in each engine's
own request and answer shapes (read from their sources, see ROUTES.md).

* vLLM (``vllm/entrypoints/pooling/scoring``; ``/rerank``, ``/v1/rerank``, ``/v2/rerank``): Jina/Cohere's shape,
  ``{"id", "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index", "document": {"text"},
  "relevance_score"}]}``, best first, ``top_n`` of them (0 or absent: all).
* llama.cpp (``tools/server/server-common.cpp`` ``format_response_rerank``; ``/rerank``, ``/reranking``,
  ``/v1/rerank``, ``/v1/reranking``): ``{"model", "object": "list", "usage": {"prompt_tokens", "total_tokens"},
  "results": [{"index", "relevance_score"}]}``, no documents, best first, ``top_n`` of them.
* SGLang (``sglang/srt/entrypoints/openai/serving_rerank.py``; ``/v1/rerank``): a bare JSON list of
  ``{"score", "document", "index", "meta_info"}``, best first, ``top_n`` of them; ``return_documents: false``
  leaves ``document`` null.

The relevance itself has no meaning beyond this: the share of the query's words a document contains, so a test
can tell a right ranking from a wrong one (a real cross-encoder scores by meaning). Every shape counts the
tokens of the query and of each document.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.sim.engines.base import EngineError, new_id

RerankShape = Literal["vllm", "llamacpp", "sglang"]

PATHS: dict[RerankShape, tuple[str, ...]] = {
    "vllm": ("/rerank", "/v1/rerank", "/v2/rerank"),
    "llamacpp": ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"),
    "sglang": ("/v1/rerank",),
}

_WORD = re.compile(r"\w+")


@dataclass(frozen=True, slots=True)
class Ranked:
    index: int
    score: float
    document: str
    tokens: int  # of the query and this document, as the engine evaluates them together


def relevance(query: str, document: str) -> float:
    """The share of the query's distinct words that the document contains, in [0, 1]."""
    words = set(_WORD.findall(query.lower()))
    if not words:
        return 0.0
    return len(words & set(_WORD.findall(document.lower()))) / len(words)


def parse(body: dict[str, Any]) -> tuple[str, list[str], int | None]:
    """The query, the documents and ``top_n`` of a rerank request; EngineError 400 where it is malformed."""
    query = body.get("query")
    if not isinstance(query, str):
        raise EngineError(400, "\"query\" must be provided", param="query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise EngineError(400, "\"documents\" must be a non-empty array of strings", param="documents")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise EngineError(400, "\"top_n\" must be a non-negative integer", param="top_n")
    return query, documents, top_n or None


def rank(query: str, documents: list[str], count_tokens: Any) -> list[Ranked]:
    """Every document scored against the query, best first (ties: the earlier document)."""
    query_tokens = count_tokens(query)
    ranked = [Ranked(i, relevance(query, doc), doc, query_tokens + count_tokens(doc))
              for i, doc in enumerate(documents)]
    ranked.sort(key=lambda r: (-r.score, r.index))
    return ranked


def answer(shape: RerankShape, model: str, body: dict[str, Any], ranked: list[Ranked],
           top_n: int | None) -> Any:
    """The engine's answer for ``ranked`` (all documents; ``top_n`` keeps the best)."""
    tokens = sum(r.tokens for r in ranked)
    kept = ranked[:top_n] if top_n else ranked
    if shape == "sglang":
        documents = body.get("return_documents", True) is not False
        return [{"score": r.score, "document": r.document if documents else None, "index": r.index,
                 "meta_info": {"id": new_id("rerank"), "prompt_tokens": r.tokens}} for r in kept]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if shape == "llamacpp":
        return {"model": body.get("model") or model, "object": "list", "usage": usage,
                "results": [{"index": r.index, "relevance_score": r.score} for r in kept]}
    return {"id": new_id("rerank"), "model": model, "usage": usage,
            "results": [{"index": r.index, "document": {"text": r.document}, "relevance_score": r.score}
                        for r in kept]}
