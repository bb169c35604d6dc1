"""KV-cache events as vLLM and SGLang publish them, decoded.

Both engines publish the same scheme (vLLM ``vllm/distributed/kv_events.py``, SGLang
``srt/disaggregation/kv_events.py``): a ZMQ PUB message of three frames ``[topic, seq, payload]``, ``seq`` an
unsigned 64-bit big-endian counter that starts at 0 when the engine process starts, ``payload`` one msgpack
batch ``[ts, events, dp_rank]`` (vLLM ``data_parallel_rank``, SGLang ``attn_dp_rank``; two elements in old
vLLM). Each event is either a map tagged by ``"type"`` (vLLM >= 0.24, SGLang >= 0.5.20), read by field name,
or, in older releases, an array whose first element is the tag and whose fields follow in declaration order
(``_ARRAY_FIELDS``; vLLM omits trailing fields left at their default):

* ``BlockStored``: vLLM 0.23 ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window``; SGLang 0.5.19 the
  first six, and a salted block is a ``BlockStoredWithMetadata`` (same tag) with one more field, ``metadata``,
  a map ``{cache_salt}``, where vLLM has ``lora_name`` (a string or nil, never a map: that tells them apart).
* ``BlockRemoved``: ``block_hashes, medium, group_idx`` (SGLang: the first two).
* ``AllBlocksCleared``: no fields.

A prefix cached under a ``cache_salt`` says so where its chain starts (no parent), in both forms: SGLang in the
event's ``cache_salt`` (0.5.23) or ``metadata.cache_salt`` (0.5.19); vLLM in ``extra_keys`` (0.23 and 0.34
alike: one entry per block, the first block's holding the salt as a bare string after the LoRA name, multimodal
``[identifier, offset]`` pairs before it, prompt-embedding digests, bytes, after it). ``group_idx`` is the
KV-cache group of a hybrid model; ``kv_cache_spec_*`` describe that group and are not used (the index keys
group 0 only).

Hashes are opaque: vLLM sends unsigned 64-bit ints (or the raw digest bytes with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), SGLang signed 64-bit ints. They are only ever compared with other
hashes of the same engine process. Fields this module does not use are ignored, so later releases that add
fields still decode. Anything malformed raises :class:`WireError` and the caller drops that batch.

A batch is decoded event by event (:func:`batch_steps`, a generator that pauses every ``PACE`` events), so the
subscriber lets the event loop run between steps: decoded whole, a 27 MB batch held the loop 5 s (sweep 8),
and an engine may send up to ``MAX_PAYLOAD_BYTES``.

The replay socket (a ROUTER) answers a DEALER's ``[b"", start_seq]`` with one ``[b"", topic, seq, payload]``
per buffered batch (``[b"", seq, payload]`` before vLLM 0.26 / SGLang 0.5.22), then the end marker whose seq
is ``b"\\xff" * 8``.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

Hash = int | bytes
END_OF_REPLAY = b"\xff" * 8
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # a batch larger than this is refused (the socket drops it earlier)
PACE = 8192  # blocks (an event counts 1 plus its blocks) decoded or applied between two pauses: a few ms
# the longest array one event may hold (a BlockStored's token_ids: a 128k-token prompt's; its hashes are fewer), and
# the most events one batch may: unpacked in one step, one 1M-block event held the event loop 3.7 s (sweep 9)
MAX_ARRAY = 1 << 18
# kept in the index for as long as the blocks they name (sweep 13: 4 KB hashes, and 15 MB salts, grew the
# gateway by GBs for good): digests are 32 bytes (sha256), vLLM's cache_salt at most 1,024 characters
MAX_HASH_BYTES = 64
MAX_NAME_CHARS = 1024
MAX_EVENT_BLOCKS = 1 << 14  # blocks one event may name (a 262,144-token prompt at 16 a block): one step's work
MAX_BATCH_BLOCKS = 1 << 20  # blocks one batch may name in all (16M tokens at 16 a block): past it, the batch is
# refused (a 33.6 MB batch of 64 events of 262,144 blocks each held the event loop 8.5 s when paced by events)


PACE_BYTES = 256 * 1024  # and at most this much of the payload decoded between two pauses


def work(event: Event) -> int:
    """What decoding or applying ``event`` costs, in blocks: 1 plus the blocks it names (and its tokens, 16 to a
    block: an event of 1 block and 262,143 tokens cost as much as 16,384 blocks, sweep 11)."""
    return 1 + len(getattr(event, "block_hashes", ())) + len(getattr(event, "token_ids", ())) // 16


class WireError(ValueError):
    """A frame or payload that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[Hash, ...]
    parent: Hash | None  # the block before block_hashes[0]; None: the sequence starts here
    token_ids: tuple[int, ...]  # all tokens of these blocks, concatenated
    block_size: int
    medium: str | None = None  # "GPU" (or None: GPU in old releases), "CPU", "CPU_PINNED", "STORAGE", "DISK"
    lora_name: str | None = None
    group_idx: int | None = None  # the KV-cache group of hybrid models
    cache_salt: str | None = None  # the salt a chain starting here (parent None) was cached under


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[Hash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    skipped: int = 0  # events of a kind this gateway does not index (unknown type, tuple tokens)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def message_parts(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A live PUB message ``[topic, seq, payload]``: its seq and payload."""
    if len(frames) != 3:
        raise WireError(f"{len(frames)} frames, expected 3 (topic, seq, payload)")
    return decode_seq(frames[1]), frames[2]


def decode_message(frames: Sequence[bytes]) -> Batch:
    """A live PUB message: ``[topic, seq, payload]``."""
    return decode_batch(*message_parts(frames))


def replay_parts(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One reply on the replay socket as a DEALER receives it: its seq and payload; None for the end marker."""
    if not frames or frames[0] != b"":
        raise WireError("replay reply without the empty delimiter frame")
    body = frames[1:]
    if len(body) == 3:  # topic, seq, payload (vLLM >= 0.26, SGLang >= 0.5.22)
        seq_frame, payload = body[1], body[2]
    elif len(body) == 2:  # seq, payload
        seq_frame, payload = body[0], body[1]
    else:
        raise WireError(f"replay reply of {len(frames)} frames")
    if seq_frame == END_OF_REPLAY:
        return None
    return decode_seq(seq_frame), payload


def decode_replay(frames: Sequence[bytes]) -> Batch | None:
    """One reply on the replay socket as a DEALER receives it; None for the end marker."""
    parts = replay_parts(frames)
    return None if parts is None else decode_batch(*parts)


def decode_batch(seq: int, payload: bytes) -> Batch:
    """The whole batch at once (:func:`batch_steps` run through)."""
    steps = batch_steps(seq, payload)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            batch: Batch = done.value
            return batch


def batch_steps(seq: int, payload: bytes) -> Generator[None, None, Batch]:
    """Decode a batch, pausing (yielding) every ``PACE`` events; returns the Batch. Raises WireError."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"payload of {len(payload)} bytes")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, use_list=True,
                                max_buffer_size=max(len(payload), 1), max_array_len=MAX_ARRAY,
                                max_map_len=1024)
    unpacker.feed(payload)
    try:
        fields = unpacker.read_array_header()
        if fields not in (2, 3):
            raise WireError("batch is not [ts, events(, dp_rank)]")
        ts = unpacker.unpack()
        if not isinstance(ts, int | float):
            raise WireError("batch timestamp is not a number")
        count = unpacker.read_array_header()
        events: list[Event] = []
        skipped = 0
        done = blocks = 0
        mark = unpacker.tell()
        for _ in range(count):
            event = _event(unpacker.unpack())
            if event is None:
                skipped += 1
                done += 1
            else:
                events.append(event)
                cost = work(event)
                done += cost
                blocks += cost
                if blocks > MAX_BATCH_BLOCKS:
                    raise WireError(f"a batch naming more than {MAX_BATCH_BLOCKS} blocks")
            if done >= PACE or unpacker.tell() - mark >= PACE_BYTES:  # (by bytes too: a skipped event's content,
                # an unknown type's, counts as 1 above whatever it holds)
                done, mark = 0, unpacker.tell()
                yield
        dp_rank = unpacker.unpack() if fields == 3 else None
    except WireError:
        raise
    except (ValueError, msgpack.UnpackException) as exc:  # (a header of another type, data cut short)
        raise WireError(f"not a msgpack batch: {exc}") from None
    if not isinstance(dp_rank, int) or isinstance(dp_rank, bool):
        dp_rank = None
    return Batch(seq=seq, ts=float(ts), events=tuple(events), dp_rank=dp_rank, skipped=skipped)


# Array-form events (vLLM < 0.24, SGLang < 0.5.20): field names by position after the tag, as declared in
# vLLM 0.23 (SGLang 0.5.19 sends a prefix of each; values past a table's end are ignored).
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
# SGLang 0.5.19's BlockStoredWithMetadata: tagged "BlockStored", its kw-only ``metadata`` after ``medium``
_SGLANG_STORED_WITH_METADATA = (*_ARRAY_FIELDS["BlockStored"][:6], "metadata")


def _fields(item: Any) -> tuple[str, dict[str, Any]] | None:
    """(type, fields by name) of a map- or array-encoded event."""
    if isinstance(item, dict):
        kind = item.get("type")
        return (kind, item) if isinstance(kind, str) else None
    if isinstance(item, list) and item and isinstance(item[0], str):
        kind, values = item[0], item[1:]
        names = _ARRAY_FIELDS.get(kind, ())
        if kind == "BlockStored" and len(values) == 7 and isinstance(values[6], dict):
            names = _SGLANG_STORED_WITH_METADATA
        return kind, dict(zip(names, values, strict=False))
    raise WireError(f"event is a {type(item).__name__}, not a map or array")


def _hashes(value: Any) -> tuple[Hash, ...]:
    if isinstance(value, list) and len(value) > MAX_EVENT_BLOCKS:
        raise WireError(f"an event naming more than {MAX_EVENT_BLOCKS} blocks")
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise WireError("block_hashes is not a list of ints or bytes")
    if any(isinstance(h, bytes) and len(h) > MAX_HASH_BYTES for h in value):
        raise WireError(f"a block hash of more than {MAX_HASH_BYTES} bytes")
    return tuple(value)


def _name(f: dict[str, Any], field: str) -> str | None:
    value = f.get(field)
    if isinstance(value, str) and len(value) > MAX_NAME_CHARS:
        raise WireError(f"a {field} of more than {MAX_NAME_CHARS} characters")
    return value if isinstance(value, str) else None


def _event(item: Any) -> Event | None:
    parsed = _fields(item)
    if parsed is None:
        raise WireError("event without a type")
    kind, f = parsed
    group = f.get("group_idx")
    group = group if isinstance(group, int) else None
    medium = _name(f, "medium")  # (a few words in every release; one of 32 MiB per event: sweep 17)
    if kind == "BlockStored":
        hashes = _hashes(f.get("block_hashes"))
        parent = f.get("parent_block_hash")
        if parent is not None and not isinstance(parent, int | bytes):
            raise WireError("parent_block_hash is not an int, bytes or nil")
        if isinstance(parent, bytes) and len(parent) > MAX_HASH_BYTES:
            raise WireError(f"a block hash of more than {MAX_HASH_BYTES} bytes")
        tokens = f.get("token_ids")
        block_size = f.get("block_size")
        if not isinstance(tokens, list) or not isinstance(block_size, int) or block_size < 1:
            raise WireError("BlockStored without token_ids or block_size")
        if not all(type(t) is int for t in tokens):
            return None  # EAGLE bigram keys (tuples): not plain token ids
        lora = _name(f, "lora_name")
        return BlockStored(hashes, parent, tuple(tokens), block_size, medium, lora, group,
                           _salt(f, lora) if parent is None else None)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(f.get("block_hashes")), medium, group)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _salt(f: dict[str, Any], lora: str | None) -> str | None:
    """The ``cache_salt`` of a chain's first block: SGLang's field (0.5.23) or its metadata's (0.5.19), or the
    string in vLLM's first ``extra_keys`` entry that is not the LoRA name (the others there are multimodal
    ``[id, offset]`` pairs and prompt-embedding digests)."""
    metadata = f.get("metadata")
    salt = _name(metadata, "cache_salt") if isinstance(metadata, dict) else _name(f, "cache_salt")
    if salt is not None:
        return salt or None
    extra = f.get("extra_keys")
    if not isinstance(extra, list) or not extra or not isinstance(extra[0], list):
        return None
    strings = [key for key in extra[0] if isinstance(key, str)]
    if any(len(key) > MAX_NAME_CHARS for key in strings):
        raise WireError(f"an extra key of more than {MAX_NAME_CHARS} characters")
    if lora is not None and strings:
        del strings[0]
    return strings[-1] if strings else None
