"""The store behind ``previous_response_id``, in one process: what it holds of memory against its bound, its
bounds in all and per API key, expiry, and each response bound to the key that made it."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import orjson
import pytest

from gateway.api.response_store import ResponseStore
from gateway.api.translate.responses import new_response_id
from gateway.state.stored_responses import StoreBounds
from tests.clock import ManualClock

pytestmark = pytest.mark.unit


def message(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def bounds(**extra: Any) -> StoreBounds:
    return StoreBounds(**{"entries": 10**7, "max_bytes": 10**9, "entries_per_key": 10**7, "bytes_per_key": 10**9,
                          **extra})


# the worst shapes for memory held per byte counted: many entries of nothing or of tiny messages, of one key or
# of many (each key's own order costs besides)
SHAPES = {
    "empty conversations": ([], 1),
    "one empty message each": ([{"role": "user", "content": ""}], 1),
    "a hundred empty messages each": ([{"role": "user", "content": ""}] * 100, 1),
    "empty conversations of 500 keys": ([], 500),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_memory_held_stays_within_the_byte_bound_whatever_the_conversations_shape(shape: str) -> None:
    """Filled far past its bound (8,000 puts into 1 MiB), the store holds no more memory than its bound, as
    tracemalloc counts it. Kept as parsed messages, the same store held 8 to 20 times its bound (a 28-byte
    empty message was ~200 bytes of dicts); kept as orjson's own bytes, ~4 KiB per entry of write buffer."""
    conversation, keys = SHAPES[shape]
    bound = 1024 * 1024
    owners = [f"key-{i}" for i in range(keys)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(bounds(max_bytes=bound))
        for i in range(8_000):
            # (decoded afresh each time, as each request's messages are: nothing is shared with the caller)
            store.put(owners[i % keys], new_response_id(), orjson.loads(orjson.dumps(conversation)))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) > 200, "the store kept many entries (the shape is the worst case, not an empty store)"
    assert store.held <= bound
    assert held <= bound, f"{held} bytes held against a bound of {bound}"


def test_store_keeps_conversations_until_their_ttl() -> None:
    clock = ManualClock()
    store = ResponseStore(bounds(ttl_seconds=10), clock=clock)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    store.put("", "resp_a", conversation)
    clock.now += 5
    store.put("", "resp_b", conversation[:1])
    assert store.get("", "resp_a") == conversation and len(store) == 2
    clock.now += 5
    assert store.get("", "resp_a") is None and store.get("", "resp_b") == conversation[:1] and len(store) == 1
    clock.now += 5
    assert store.get("", "resp_b") is None and len(store) == 0
    assert store.get("", "resp_unknown") is None


def test_store_evicts_the_oldest_beyond_its_entry_bound() -> None:
    store = ResponseStore(bounds(entries=2))
    for name in ("a", "b", "c"):
        store.put("", name, message(name))
    assert store.get("", "a") is None and store.get("", "b") is not None and store.get("", "c") is not None
    assert len(store) == 2


def test_store_evicts_the_oldest_beyond_its_byte_bound() -> None:
    one = message("x" * 100)
    store = ResponseStore(bounds(max_bytes=1))
    store.put("", "a", one)
    assert store.held == 0, "larger than the store on its own: not kept"
    store = ResponseStore(bounds(max_bytes=10**6))
    store.put("", "a", one)
    size = store.held  # what one such entry is counted
    store = ResponseStore(bounds(max_bytes=2 * size))
    store.put("", "a", one)
    store.put("", "b", one)
    store.put("", "c", one)
    assert store.get("", "a") is None and store.get("", "b") == one and store.get("", "c") == one
    store.put("", "huge", message("x" * 10 * size))  # larger than the whole store: not kept
    assert store.get("", "huge") is None and store.get("", "c") == one
    store.put("", "c", one)  # putting again replaces, it does not count twice
    assert len(store) == 2 and store.held == 2 * size


def test_one_key_past_its_own_bound_loses_its_own_oldest_not_the_other_keys() -> None:
    store = ResponseStore(bounds(entries=100, entries_per_key=10))
    store.put("quiet", "resp_q", message("mine"))
    for i in range(50):  # a key storing as fast as it can
        store.put("loud", f"resp_{i}", message("x"))
    assert store.get("quiet", "resp_q") == message("mine"), "another key's conversation survives"
    assert [i for i in range(50) if store.get("loud", f"resp_{i}") is not None] == list(range(40, 50))
    # in bytes too
    store = ResponseStore(bounds(max_bytes=100_000, bytes_per_key=10_000))
    store.put("quiet", "resp_q", message("mine"))
    for i in range(50):
        store.put("loud", f"resp_{i}", message("x" * 1000))
    assert store.get("quiet", "resp_q") == message("mine")
    kept = [i for i in range(50) if store.get("loud", f"resp_{i}") is not None]
    assert kept and kept == list(range(50 - len(kept), 50)) and len(kept) < 10


def test_with_auth_off_every_response_is_one_owners_bounded_by_the_store_alone() -> None:
    store = ResponseStore(bounds(entries=100, entries_per_key=10))
    for i in range(50):
        store.put("", f"resp_{i}", message("x"))
    assert len(store) == 50


def test_another_key_is_told_what_an_unknown_id_is_told() -> None:
    store = ResponseStore(bounds())
    store.put("alice", "resp_1", message("secret"))
    assert store.get("alice", "resp_1") == message("secret")
    assert store.get("mallory", "resp_1") is None and store.get("mallory", "resp_2") is None
    assert store.get("", "resp_1") is None, "nor the anonymous owner (auth turned off later)"
    # the same id under another key is another response: neither replaces the other
    store.put("mallory", "resp_1", message("hers"))
    assert store.get("alice", "resp_1") == message("secret") and store.get("mallory", "resp_1") == message("hers")


@pytest.mark.anyio
async def test_fetch_is_get_without_shared_state() -> None:
    store = ResponseStore(bounds())
    store.put("alice", "resp_1", message("hi"))
    assert await store.fetch("alice", "resp_1") == message("hi")
    assert await store.fetch("bob", "resp_1") is None
