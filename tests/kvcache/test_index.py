"""The event index: engine hashes resolved to the gateway's own chain keys, matched against request keys."""

from __future__ import annotations

import itertools

import pytest

from gateway.kvcache.index import EventIndex, chunk_tokens, request_keys
from gateway.kvcache.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored

pytestmark = pytest.mark.unit

_seq = itertools.count()


def batch(*events: object) -> Batch:
    return Batch(next(_seq), 0.0, tuple(events))  # type: ignore[arg-type]


def stored(tokens: list[int], block_size: int, hashes: list[int], parent: int | None = None,
           medium: str | None = "GPU", lora: str | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), block_size, medium, lora)


def held(index: EventIndex, tokens: list[int]) -> float:
    assert index.chunk is not None
    return index.match(request_keys(tokens, index.chunk)) * index.chunk


def test_chunk_is_a_whole_number_of_blocks_of_at_least_16_tokens() -> None:
    assert [chunk_tokens(b) for b in (1, 4, 16, 32, 5)] == [16, 16, 16, 32, 20]


def test_vllm_blocks_chained_through_engine_parent_hashes() -> None:
    """Two requests share 32 tokens: the second's event names the shared block as parent, and only carries
    its own new blocks' tokens."""
    a = list(range(100, 148))  # 3 blocks of 16
    b = a[:32] + list(range(900, 916))
    index = EventIndex()
    index.apply(batch(stored(a, 16, [0xA1, 0xA2, 0xA3])))
    index.apply(batch(stored(b[32:], 16, [0xB3], parent=0xA2)))
    assert held(index, a) == 48 and held(index, b) == 48
    assert held(index, a[:32] + [7] * 16) == 32
    assert held(index, [1, *a]) == 0  # keys are a chain: a shifted prompt shares nothing
    index.apply(batch(BlockRemoved((0xA3,), "GPU")))
    assert held(index, a) == 32 and held(index, b) == 48
    index.apply(batch(BlockRemoved((0xA2,), "GPU")))
    assert held(index, b) == 16  # the chain breaks at the first block not held
    index.apply(batch(AllBlocksCleared()))
    assert held(index, a) == 0 and len(index) == 0


def test_sglang_page_size_one_is_keyed_in_chunks_of_16() -> None:
    """One hash per token, coalesced into one event per radix node; a node split mid-chunk continues the
    pending tokens through the parent; evicting a leaf drops only the chunk it completed."""
    a = list(range(1, 41))  # 40 tokens: 2 full chunks and 8 pending
    index = EventIndex()
    index.apply(batch(stored(a, 1, [-i for i in range(1, 41)])))
    assert index.chunk == 16 and len(index) == 40 and index.keys_held == 2
    assert held(index, a) == 32
    # a second prompt shares 20 tokens, then diverges: its node's parent is the token-20 page (hash -20)
    b = a[:20] + list(range(500, 520))
    index.apply(batch(stored(b[20:], 1, list(range(1000, 1020)), parent=-20)))
    assert held(index, b) == 32  # chunk 2 of b (tokens 16..31) completed inside the new node
    index.apply(batch(BlockRemoved(tuple(range(1012, 1020)), "GPU")))  # the leaf's tail, not its chunk end
    assert held(index, b) == 32
    index.apply(batch(BlockRemoved((1011,), "GPU")))  # token 31 of b: the page ending chunk 2
    assert held(index, b) == 16


def test_unknown_parent_is_dropped_and_counted() -> None:
    index = EventIndex()
    index.apply(batch(stored(list(range(16)), 16, [5], parent=999)))
    assert index.orphans == 1 and len(index) == 0


def test_host_tier_counts_less_and_lora_keys_apart() -> None:
    a = list(range(32))
    index = EventIndex()
    index.apply(batch(stored(a, 16, [1, 2], medium="CPU")))
    assert held(index, a) == 16  # two host chunks at half weight
    index.apply(batch(stored(a, 16, [1, 2], medium="GPU")))
    assert held(index, a) == 32
    other = EventIndex()
    other.apply(batch(stored(a, 16, [1, 2], lora="adapter")))
    assert held(other, a) == 0  # an adapter's blocks are not the base model's


def test_re_announced_blocks_count_once_and_other_block_sizes_are_ignored() -> None:
    a = list(range(32))
    index = EventIndex()
    index.apply(batch(stored(a, 16, [1, 2])))
    index.apply(batch(stored(a, 16, [1, 2])))  # kv_cache_report_mode="full" re-reports reused blocks
    index.apply(batch(BlockRemoved((2,), "GPU")))
    assert held(index, a) == 16
    index.apply(batch(stored(list(range(12)), 12, [3])))  # another block size, not a divisor: not comparable
    assert len(index) == 1


def test_a_salted_chain_is_keyed_apart_from_the_same_tokens_unsalted_or_under_another_salt() -> None:
    tokens = tuple(range(32))
    index = EventIndex()
    index.apply(Batch(0, 0.0, (BlockStored((1, 2), None, tokens, 16, cache_salt="a"),
                               BlockStored((3,), 2, tuple(range(32, 48)), 16))))
    assert index.match(request_keys(list(range(48)), 16, cache_salt="a")) == 3
    assert index.match(request_keys(list(range(48)), 16, cache_salt="b")) == 0
    assert index.match(request_keys(list(range(48)), 16)) == 0
