"""A rerank's engine reads its query again with each document: a key pays for that on arrival (its reservation)
and when the engine does not say what it read (the client gone before the answer). Sweep 17 (S17-4): the query
was reserved once, so a burst of large reranks passed together; sweep 18 (S18-1): a rerank whose client left
before its answer paid 1/215 of the engine's work."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from gateway.api.proxy_endpoint import _tokens_used
from gateway.app import GatewayApp
from gateway.proxy.exchange import Exchange, estimate_tokens, rerank_rereads
from gateway.proxy.transport import MockRequest, MockResponse
from gateway.routing.request import RouteRequest
from tests.inprocess import in_process

pytestmark = [pytest.mark.anyio, pytest.mark.unit]

QUERY = "0123456789" * 200  # 2,000 bytes, and as many tokens on a vocabulary splitting digits
DOCUMENTS = [f"document {i}" for i in range(200)]
BODY = {"model": "m", "query": QUERY, "documents": DOCUMENTS}


def test_a_rerank_the_engine_did_not_count_pays_its_query_once_a_document() -> None:
    raw = orjson.dumps(BODY)
    request = RouteRequest(model="m", route="rerank", stream=False, max_tokens=None, body=BODY)
    exchange = Exchange(request_id="r", route="rerank", t_start=0.0, request=request)
    exchange.backend = object()  # type: ignore[assignment]  # (a backend was reached; the client then left)
    exchange.reserve = exchange.body_tokens = estimate_tokens(raw)
    exchange.body_bytes, exchange.rereads = len(raw), rerank_rereads(BODY)
    assert _tokens_used(exchange) >= len(QUERY) * len(DOCUMENTS)


@contextlib.asynccontextmanager
async def gateway(release: asyncio.Event) -> AsyncIterator[tuple[GatewayApp, httpx.AsyncClient]]:
    async def engine(request: MockRequest) -> MockResponse:
        await release.wait()
        return MockResponse(body=orjson.dumps({"id": "r", "results": [{"index": 0, "relevance_score": 0.5}],
                                               "usage": {"prompt_tokens": 10, "total_tokens": 10}}))

    key = {"name": "k", "key_sha256": hashlib.sha256(b"sk-k").hexdigest(), "tokens_per_minute": 100_000}
    config = {"backends": [{"name": "v", "engine": "vllm", "url": "http://v:8000"}], "auth": {"keys": [key]}}
    async with in_process(config, engine) as running:
        yield running


async def test_a_rerank_reserves_its_query_once_a_document_so_a_burst_is_held_to_the_budget() -> None:
    release = asyncio.Event()
    async with gateway(release) as (_app, client):
        headers = {"authorization": "Bearer sk-k"}
        first = asyncio.create_task(client.post("/v1/rerank", json=BODY, headers=headers))
        for _ in range(50):  # (a few loop turns: the first is admitted and waits on the engine)
            await asyncio.sleep(0)
        # (its query read with each of 200 documents: ~100,000 reserved by the first, the whole budget)
        second = await asyncio.wait_for(client.post("/v1/rerank", json=BODY, headers=headers), 10)
        assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_tokens", second.text
        release.set()
        assert (await first).status_code == 200
