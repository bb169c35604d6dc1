"""An engine's usage figures that are no count (a string, a float, a boolean, null, an object, a negative or huge
number) are no reading: the request neither crashes nor goes free, and its key is charged the gateway's own
estimate, as for an engine that reports no usage at all.

Held to zero, ``{"prompt_tokens": "12", "completion_tokens": 1e30}`` cost its key nothing, and ``-5`` took five
tokens off what it was charged; a huge figure was charged as 2^27 tokens, holding the key back for hours.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.auth import TokenBucket
from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

HONEST = {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}
GARBAGE: dict[str, dict[str, Any]] = {
    "string_and_1e30": {"prompt_tokens": "12", "completion_tokens": 1e30, "total_tokens": 12},
    "negative": {"prompt_tokens": -5, "completion_tokens": 8, "total_tokens": 3},
    "fraction": {"prompt_tokens": 3.7, "completion_tokens": 8, "total_tokens": 11.7},
    "boolean": {"prompt_tokens": True, "completion_tokens": 8, "total_tokens": 9},
    "null": {"prompt_tokens": None, "completion_tokens": None, "total_tokens": None},
    "nested": {"prompt_tokens": {"text": 10}, "completion_tokens": [8], "total_tokens": {}},
    "huge": {"prompt_tokens": 10, "completion_tokens": 1 << 62, "total_tokens": 1 << 62},
    "no_figures": {"total_tokens": 18},
}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, ScriptedUpstream, TokenBucket]]:
    with ScriptedUpstream(mode="stream", tokens=8, every=0.002) as upstream:
        app, server = gateway_over(upstream, auth={"keys": [{
            "name": "team", "key_sha256": hashlib.sha256(b"sk-team").hexdigest(), "tokens_per_minute": 6000}]})
        with server as gw:
            client = app.gateway.keys.authenticate(b"Bearer sk-team", None)
            assert client is not None and client.tokens is not None
            client.tokens.charge(1000)  # (spent: a full bucket's refill is lost, and ``charged`` would miss it)
            yield gw.url, upstream, client.tokens


def charged(bucket: TokenBucket, ask: Callable[[], httpx.Response]) -> float:
    """Tokens the request ``ask`` sends took from the key, its bucket's refill meanwhile added back (the bucket is
    never full here: it starts 1000 tokens short, and refills 100 a second)."""
    bucket.charge(0)  # (refilled up to now)
    before, since = bucket.level, bucket.updated
    r = ask()
    assert r.status_code == 200, r.text
    bucket.charge(0)
    return before + (bucket.updated - since) * bucket.rate - bucket.level


def asker(url: str, stream: bool) -> tuple[Callable[[], httpx.Response], bytes]:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS,
                         "stream": stream})
    return lambda: httpx.post(url + "/v1/chat/completions", content=body, timeout=10, headers={
        "authorization": "Bearer sk-team", "content-type": "application/json"}), body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_garbage_usage_is_no_reading_and_the_key_is_charged_the_gateways_estimate(
        gateway: tuple[str, ScriptedUpstream, TokenBucket], stream: bool) -> None:
    url, upstream, bucket = gateway
    ask, body = asker(url, stream)
    upstream.mode = "stream" if stream else "complete"
    upstream.usage = HONEST
    assert charged(bucket, ask) == pytest.approx(18, abs=0.5)  # (the engine's usage, where it is one)
    if stream:  # what was relayed: the prompt's estimate and one token per text event, as with no usage chunk
        upstream.mode = "stream_no_usage"
        estimate = charged(bucket, ask)
        assert estimate >= 8
        upstream.mode = "stream"
    else:  # the output is not counted on the way: what the key reserved on arrival (its body's estimate and
        # max_tokens) or the most its prompt can cost (a token a byte of its body), whichever is more
        estimate = max(len(body) // 4 + MAX_TOKENS, len(body))
    found = {}
    for name, usage in GARBAGE.items():
        upstream.usage = usage
        found[name] = round(charged(bucket, ask), 1)
    assert found == pytest.approx({name: estimate for name in GARBAGE}, abs=0.5), (estimate, found)
