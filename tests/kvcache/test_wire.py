"""KV event batches decoded from bytes built to each engine's released schema (vLLM 0.34 back to 0.23, SGLang
0.5.23 back to 0.5.19): see gateway/kvcache/wire.py for the sources."""

from __future__ import annotations

import struct

import msgpack
import pytest

from gateway.kvcache.index import EventIndex, request_keys
from gateway.kvcache.wire import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
    decode_message,
    decode_replay,
)

pytestmark = pytest.mark.unit


def _str(s: str) -> bytes:
    assert len(s) < 32
    return bytes([0xA0 | len(s)]) + s.encode()


def test_vllm_033_map_events_from_hand_built_bytes() -> None:
    """Bytes written out by hand from msgspec's encoding of KVEventBatch (array_like) holding a tagged
    BlockStored map: an unsigned 64-bit hash above 2**63 (0xcf), nil parent, 4 tokens, block_size 4."""
    stored = (b"\x89" + _str("type") + _str("BlockStored")
              + _str("block_hashes") + b"\x91\xcf" + (2**64 - 5).to_bytes(8, "big")
              + _str("parent_block_hash") + b"\xc0"
              + _str("token_ids") + b"\x94\x01\x02\x03\x04"
              + _str("block_size") + b"\x04"
              + _str("lora_id") + b"\xc0"
              + _str("medium") + _str("GPU")
              + _str("lora_name") + b"\xc0"
              + _str("group_idx") + b"\x00")
    payload = b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91" + stored + b"\x00"
    batch = decode_message([b"kv@pod@m", (7).to_bytes(8, "big"), payload])
    assert batch.seq == 7 and batch.ts == 1.5 and batch.dp_rank == 0
    assert batch.events == (BlockStored((2**64 - 5,), None, (1, 2, 3, 4), 4, "GPU", None, 0),)


def test_vllm_023_array_events_read_every_field_by_position() -> None:
    """vLLM before 0.24: events are arrays, tag first, fields as declared in 0.23's kv_events.py (BlockStored:
    block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
    kv_cache_spec_kind, kv_cache_spec_sliding_window; BlockRemoved: block_hashes, medium, group_idx), trailing
    defaults omitted. 0.23's block_pool.py fills extra_keys per block with the LoRA name, multimodal
    (identifier, offset) pairs, then the bare cache_salt (first block only), then prompt-embedding digests."""
    salted = ["BlockStored", [11, 12], None, list(range(8)), 4, 3, "GPU", "adapter",
              [["adapter", ["mm-hash", 0], "salt-1", b"\x07" * 32], ["adapter"]], 1, "full_attention", None]
    continued = ["BlockStored", [13], 12, list(range(8, 12)), 4, None, "GPU", None, None, 0]
    oldest = ["BlockStored", [14], None, list(range(4)), 4, None, "GPU", None]  # nothing past lora_name
    payload = msgpack.packb([2.0, [salted, continued, oldest, ["BlockRemoved", [11], "GPU", 1],
                                   ["BlockRemoved", [13], "CPU"], ["AllBlocksCleared"]]])
    batch = decode_batch(3, payload)
    assert batch.dp_rank is None  # two-element batch of old vLLM
    assert batch.events == (BlockStored((11, 12), None, tuple(range(8)), 4, "GPU", "adapter", 1, "salt-1"),
                            BlockStored((13,), 12, tuple(range(8, 12)), 4, "GPU", None, 0),
                            BlockStored((14,), None, tuple(range(4)), 4, "GPU"),
                            BlockRemoved((11,), "GPU", 1), BlockRemoved((13,), "CPU"), AllBlocksCleared())


def test_sglang_0519_array_events_and_the_salt_in_metadata() -> None:
    """SGLang before 0.5.20: arrays without omitted defaults (BlockStored: block_hashes, parent_block_hash,
    token_ids, block_size, lora_id, medium; BlockRemoved: block_hashes, medium). A salted page is a
    BlockStoredWithMetadata, tagged BlockStored, with its kw-only ``metadata`` map {cache_salt} after medium;
    mem_cache/events.py attaches it to every salted page, the chain's first one included. The salted chain is
    keyed apart: a request without that salt (another cache domain) does not match it."""
    salted = ["BlockStored", [-5, 7], None, list(range(32)), 16, None, "GPU", {"cache_salt": "salt-1"}]
    continued = ["BlockStored", [8], 7, list(range(32, 48)), 16, None, "GPU", {"cache_salt": "salt-1"}]
    plain = ["BlockStored", [9], None, list(range(16)), 16, None, "CPU_PINNED"]
    payload = msgpack.packb([1.0, [salted, continued, plain, ["BlockRemoved", [9], "CPU_PINNED"]], 0])
    batch = decode_batch(0, payload)
    assert batch.events == (BlockStored((-5, 7), None, tuple(range(32)), 16, "GPU", None, None, "salt-1"),
                            BlockStored((8,), 7, tuple(range(32, 48)), 16, "GPU"),  # (its salt: where the chain starts)
                            BlockStored((9,), None, tuple(range(16)), 16, "CPU_PINNED"),
                            BlockRemoved((9,), "CPU_PINNED"))
    index = EventIndex()
    index.apply(batch)
    assert index.chunk == 16
    assert index.match(request_keys(list(range(48)), 16, cache_salt="salt-1")) == 3
    assert index.match(request_keys(list(range(48)), 16)) == 0
    assert index.match(request_keys(list(range(48)), 16, cache_salt="salt-2")) == 0


def test_sglang_0523_signed_hashes_and_extra_fields() -> None:
    """SGLang: signed int64 hashes (0xd3), attn_dp_rank third, cache_salt/session_id fields, medium CPU_PINNED."""
    stored = {"type": "BlockStored", "block_hashes": [-3, 2**62], "parent_block_hash": -(2**63),
              "token_ids": [5, 6], "block_size": 1, "lora_id": None, "medium": "CPU_PINNED", "cache_salt": None,
              "session_id": None, "lora_name": None}
    payload = msgpack.packb([0.5, [stored, {"type": "BlockRemoved", "block_hashes": [-3], "medium": "GPU"}], 1])
    assert b"\xd3" in payload  # msgpack's int64: what SGLang's negative hashes look like
    batch = decode_batch(0, payload)
    assert batch.dp_rank == 1
    assert batch.events[0] == BlockStored((-3, 2**62), -(2**63), (5, 6), 1, "CPU_PINNED")
    assert batch.events[1] == BlockRemoved((-3,), "GPU")


def test_bytes_hashes_unknown_types_and_tuple_tokens_are_kept_or_skipped() -> None:
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends digests as bytes; unknown event types and EAGLE bigram
    tokens are counted as skipped, not errors."""
    events = [{"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
               "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": "ad"},
              {"type": "SomethingNew", "x": 1},
              {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [[1, 2]],
               "block_size": 1, "lora_id": None, "medium": "GPU"}]
    batch = decode_batch(0, msgpack.packb([0.0, events, 0]))
    assert batch.events == (BlockStored((b"\x01" * 32,), None, (1, 2), 2, "GPU", "ad"),)
    assert batch.skipped == 2


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0]), msgpack.packb(["x", [], 0]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "nope"}], 0]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": [1], "block_size": 0}], 0]),
    msgpack.packb([1.0, [42], 0]),
])
def test_malformed_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(0, payload)


def test_frames() -> None:
    with pytest.raises(WireError):
        decode_message([b"", b"\x00" * 8])
    with pytest.raises(WireError):
        decode_message([b"", b"\x00" * 4, msgpack.packb([0.0, [], 0])])


def test_replay_frames_with_and_without_topic_and_the_end_marker() -> None:
    payload = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}], 0])
    new = decode_replay([b"", b"topic", (5).to_bytes(8, "big"), payload])  # vLLM >= 0.26, SGLang >= 0.5.22
    old = decode_replay([b"", (5).to_bytes(8, "big"), payload])
    assert new == old and new is not None and new.seq == 5 and new.events == (AllBlocksCleared(),)
    assert decode_replay([b"", b"", END_OF_REPLAY, b""]) is None
    assert decode_replay([b"", END_OF_REPLAY, b""]) is None
    with pytest.raises(WireError):
        decode_replay([b"x", (5).to_bytes(8, "big"), payload])


def test_the_salt_a_chain_was_cached_under() -> None:
    """SGLang 0.5.23 says it in cache_salt; vLLM 0.34 in the first block's extra_keys entry (untagged, after the
    LoRA name; multimodal pairs are arrays, prompt-embedding digests bytes). Only a chain's first block matters."""
    def stored(**fields: object) -> dict[str, object]:
        return {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [5, 6],
                "block_size": 1, "lora_id": None, "medium": "GPU", **fields}

    payload = msgpack.packb([1.0, [
        stored(cache_salt="s1", session_id=None, lora_name=None),
        stored(lora_name=None, extra_keys=[["s2"], None], group_idx=0),
        stored(lora_name="adapter", extra_keys=[["adapter", ["mm", 0], b"\x01", "s3"], ["adapter"]]),
        stored(lora_name="adapter", extra_keys=[["adapter"], ["adapter"]]),
        stored(lora_name=None, extra_keys=[None, None]),
        {**stored(cache_salt="s1"), "parent_block_hash": 7},
    ], 0])
    salts = [e.cache_salt for e in decode_batch(0, payload).events if isinstance(e, BlockStored)]
    assert salts == ["s1", "s2", "s3", None, None, None]


@pytest.mark.parametrize("field", ["block_hashes", "parent_block_hash", "cache_salt", "lora_name", "extra_keys",
                                   "metadata"])
def test_a_value_the_index_would_keep_is_bounded_in_bytes(field: str) -> None:
    """Sweep 13: hashes of 4 KB (180 batches: 90 MB -> 3.5 GB RSS, kept), and 60 salts of 15 MB (1 GB for 60
    blocks). The index is bounded in blocks and seeds; what each holds is bounded here: a batch naming a hash
    longer than a digest, or a name longer than vLLM's own cache_salt bound, is dropped."""
    from gateway.kvcache.wire import MAX_HASH_BYTES, MAX_NAME_CHARS

    def event(value: object) -> dict[str, object]:
        fields: dict[str, object] = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                     "token_ids": [5, 6], "block_size": 1, "lora_name": None, "medium": "GPU"}
        if field == "block_hashes":
            fields[field] = [b"h" * value]  # type: ignore[operator]
        elif field == "parent_block_hash":
            fields[field] = b"p" * value  # type: ignore[operator]
        elif field == "extra_keys":
            fields[field] = [["s" * value]]  # type: ignore[operator]
        elif field == "metadata":
            fields[field] = {"cache_salt": "s" * value}  # type: ignore[operator]
        else:
            fields[field] = "s" * value  # type: ignore[operator]
        return fields

    bound = MAX_HASH_BYTES if field in ("block_hashes", "parent_block_hash") else MAX_NAME_CHARS
    assert len(decode_batch(0, msgpack.packb([1.0, [event(bound)], 0])).events) == 1
    with pytest.raises(WireError, match="more than"):
        decode_batch(0, msgpack.packb([1.0, [event(bound + 1)], 0]))


def test_an_event_with_an_array_past_the_bound_drops_its_batch_before_it_is_built() -> None:
    """Sweep 9: decoding paused between events, but one BlockStored of 1M blocks was unpacked and walked in one
    step (3.7 s; 21.6 s for two of 3M). No array in a batch may be longer than MAX_ARRAY."""
    import msgpack

    from gateway.kvcache.wire import MAX_ARRAY, WireError, decode_batch

    huge = ["BlockStored", list(range(MAX_ARRAY + 1)), None, list(range(16)), 16]
    with pytest.raises(WireError):
        decode_batch(0, msgpack.packb([1.0, [huge]]))
    fine = ["BlockStored", [1, 2], None, list(range(32)), 16]
    assert len(decode_batch(0, msgpack.packb([1.0, [fine]])).events) == 1


def test_a_batch_is_paced_by_the_blocks_it_names_and_bounded_in_them() -> None:
    """Sweep 10: paced every 512 events, a batch of 64 events of 262,144 blocks each held the loop 8.5 s."""
    import msgpack

    from gateway.kvcache.wire import MAX_BATCH_BLOCKS, MAX_EVENT_BLOCKS, WireError, batch_steps, decode_batch

    def stored(blocks: int, first: int) -> list[object]:
        return ["BlockStored", list(range(first, first + blocks)), None, [0] * blocks, 1]

    four = msgpack.packb([1.0, [stored(MAX_EVENT_BLOCKS, i * MAX_EVENT_BLOCKS) for i in range(4)]])
    steps = batch_steps(0, four)
    pauses = 0
    while True:
        try:
            next(steps)
        except StopIteration:
            break
        pauses += 1
    assert pauses == 4  # (an event of more than PACE blocks is a step of its own)
    with pytest.raises(WireError):  # (one event past its bound)
        decode_batch(0, msgpack.packb([1.0, [stored(MAX_EVENT_BLOCKS + 1, 0)]]))
    events = MAX_BATCH_BLOCKS // MAX_EVENT_BLOCKS + 1
    with pytest.raises(WireError):  # (a batch past its bound)
        decode_batch(0, msgpack.packb([1.0, [stored(MAX_EVENT_BLOCKS, i * MAX_EVENT_BLOCKS) for i in range(events)]]))


def test_a_batch_is_paced_by_its_bytes_and_its_tokens_too() -> None:
    """Sweep 11: events of 1 block and 262,143 tokens, or of an unknown type holding 262,143 empty arrays, each
    counted 1, were decoded in one step (2.6 and 3.7 s)."""
    import msgpack

    from gateway.kvcache.wire import MAX_ARRAY, WireError, batch_steps, decode_batch

    def steps(payload: bytes) -> int:
        gen, count = batch_steps(0, payload), 0
        while True:
            try:
                next(gen)
            except StopIteration:
                return count
            count += 1

    tokens = ["BlockStored", [1], None, list(range(MAX_ARRAY - 1)), 16]
    with pytest.raises(WireError):  # (240 such events name 3.9M blocks' worth)
        decode_batch(0, msgpack.packb([1.0, [tokens] * 240]))
    assert steps(msgpack.packb([1.0, [tokens] * 8])) >= 8
    unknown = ["Foo", [[]] * (MAX_ARRAY - 1)]
    assert steps(msgpack.packb([1.0, [unknown] * 4])) >= 4
