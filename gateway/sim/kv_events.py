"""KV-cache events as the emulated vLLM and SGLang publish them, from their prefix caches.

The wire format is the engines' own (vLLM 0.33 ``vllm/distributed/kv_events.py``, SGLang 0.5.23
``srt/disaggregation/kv_events.py``):

* a PUB socket sends ``[topic, seq (8 bytes, big-endian), payload]``; ``seq`` counts batches from 0 for each
  process (a restarted server starts again at 0);
* ``payload`` is the msgpack array ``[ts, events, dp_rank]`` (vLLM's ``data_parallel_rank``, SGLang's
  ``attn_dp_rank``; always 0 here), one batch per event-loop turn that produced events (the engines publish one
  per scheduler step);
* events are maps tagged by ``"type"``: vLLM ``BlockStored{block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, group_idx}``, ``BlockRemoved{block_hashes, medium, group_idx}``;
  SGLang ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, cache_salt,
  session_id, lora_name}``, ``BlockRemoved{block_hashes, medium}``; both ``AllBlocksCleared{}``. vLLM's hashes
  are unsigned 64-bit, SGLang's signed;
* a ROUTER replay socket answers ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq, payload]``
  for every buffered batch from ``start_seq`` on, then ``[identity, b"", b"", b"\\xff" * 8, b""]``.

``drop_next`` skips *sending* that many coming batches (they are still numbered and buffered), so tests can
make a subscriber see a gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

EngineKind = Literal["vllm", "sglang"]
MASK64 = (1 << 64) - 1
END = b"\xff" * 8


class KvEventPublisher:
    """The event side of one emulated engine process. The caches call :meth:`stored`, :meth:`removed` and
    :meth:`cleared`; the events of one loop turn go out as one batch."""

    def __init__(self, engine: EngineKind, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000) -> None:
        self.engine = engine
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.sent = 0
        self.drop_next = 0
        self._pending: list[dict[str, Any]] = []
        self._flush_scheduled = False
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._pub.close(0)
        if self._router is not None:
            self._router.close(0)

    # -- what the caches report --------------------------------------------------------------------------------
    def _hash(self, value: int) -> int:
        return value & MASK64 if self.engine == "vllm" else value

    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int) -> None:
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [self._hash(h) for h in hashes],
                                 "parent_block_hash": None if parent is None else self._hash(parent),
                                 "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
                                 "medium": "GPU"}
        if self.engine == "vllm":
            event.update(lora_name=None, group_idx=0)
        else:
            event.update(cache_salt=None, session_id=None, lora_name=None)
        self._add(event)

    def removed(self, hashes: Sequence[int]) -> None:
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [self._hash(h) for h in hashes],
                                 "medium": "GPU"}
        if self.engine == "vllm":
            event["group_idx"] = 0
        self._add(event)

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def _add(self, event: dict[str, Any]) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a cache used on its own): publish at once
                self.flush()

    def flush(self) -> None:
        self._flush_scheduled = False
        if not self._pending:
            return
        events, self._pending = self._pending, []
        payload = msgpack.packb([time.time(), events, 0])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            return
        with contextlib.suppress(zmq.Again, zmq.ZMQError):  # PUB drops for slow subscribers, as the engines'
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.sent += 1

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([identity, b"", b"", END, b""])
