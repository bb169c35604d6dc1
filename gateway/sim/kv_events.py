"""KV-cache events as the emulated vLLM and SGLang publish them, from their prefix caches.

The wire format is the engines' own (vLLM 0.33 ``vllm/distributed/kv_events.py``, SGLang 0.5.23
``srt/disaggregation/kv_events.py``):

* a PUB socket sends ``[topic, seq (8 bytes, big-endian), payload]``; ``seq`` counts batches from 0 for each
  process (a restarted server starts again at 0);
* ``payload`` is the msgpack array ``[ts, events, dp_rank]`` (vLLM's ``data_parallel_rank``, SGLang's
  ``attn_dp_rank``; always 0 here), one batch per event-loop turn that produced events (the engines publish one
  per scheduler step; the emulator's scheduler step is one loop turn);
* events are msgpack maps, ``"type"`` first: vLLM ``BlockStored{block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, group_idx}`` (and, as 0.34 sends it, ``extra_keys`` with a chain's
  salted first block) and ``BlockRemoved{block_hashes, medium, group_idx}``;
  SGLang ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, cache_salt,
  session_id, lora_name}`` and ``BlockRemoved{block_hashes, medium}``; both ``AllBlocksCleared{}``. The caches
  compute the hashes (:mod:`gateway.sim.prefix_cache`): vLLM's unsigned 64-bit, SGLang's signed. SGLang's
  consecutive stored pages, each the child of the one before, travel as one event;
* a ROUTER replay socket answers ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq, payload]``
  for every buffered batch (the last ``buffer_steps``) from ``start_seq`` on, then the end marker
  ``[identity, b"", b"", b"\\xff" * 8, b""]``.

Fault knob: ``drop_next`` skips *sending* that many coming batches; they are still numbered and buffered (a
subscriber sees a gap and can replay it).

Sockets never block the emulator's loop: PUB sends are non-blocking (a slow subscriber loses messages, as with
the engines), replies to replay requests are awaited on the loop. Each publisher owns its zmq context, ended in
:meth:`close`.
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

from gateway.kvcache.contexts import close_context, open_context

EngineKind = Literal["vllm", "sglang"]
END_OF_REPLAY = b"\xff" * 8
DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"
DEFAULT_BUFFER_STEPS = 10_000
PUB_HWM = 100_000  # vLLM's default send high-water mark


class KvEventPublisher:
    """The event side of one emulated engine process. Its cache calls :meth:`stored`, :meth:`removed` and
    :meth:`cleared`; the events of one loop turn go out as one batch. ``endpoint`` and ``replay_endpoint`` are
    the addresses bound (``tcp://127.0.0.1:*`` binds an ephemeral port: read the port here)."""

    def __init__(self, engine: EngineKind, endpoint: str = DEFAULT_ENDPOINT, replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = DEFAULT_BUFFER_STEPS) -> None:
        self.engine = engine
        self.topic = topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self.seq = 0  # the next batch's sequence number
        self.sent = 0
        self.dropped = 0
        self.drop_next = 0
        self._pending: list[dict[str, Any]] = []
        self._flush_handle: asyncio.Handle | None = None
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._ctx = open_context(zmq.Context)  # (never left to the collector: see gateway.kvcache.contexts)
        self._router: zmq.asyncio.Socket | None = None
        try:
            self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._router = zmq.asyncio.Socket(self._ctx, zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.setsockopt(zmq.SNDHWM, 0)  # a replay of the whole buffer is never cut short
                self._router.bind(replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            close_context(self._ctx)
            raise

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve replay requests (call from the emulator's event loop)."""
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def close(self) -> None:
        """Unsent events are lost, as when the engine process dies; the ports are free once this returns."""
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        close_context(self._ctx)

    # -- what the cache reports --------------------------------------------------------------------------------
    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int,
               salt: str | None = None) -> None:
        """``salt``: the cache salt the blocks were stored under (vLLM: given with a chain's first block only)."""
        if self.engine == "sglang" and self._extend_last(hashes, parent, tokens, salt):
            return
        event: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
                                 "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
                                 "medium": "GPU"}
        if self.engine == "vllm":
            event["lora_name"] = None
            if salt is not None:  # (0.34: one entry per block, untagged; the salt is the first block's extra key)
                event["extra_keys"] = [[salt], *([None] * (len(hashes) - 1))]
            event["group_idx"] = 0
        else:
            event["cache_salt"] = salt
            event["session_id"] = None
            event["lora_name"] = None
        self._add(event)

    def _extend_last(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int],
                     salt: str | None) -> bool:
        """SGLang: pages that continue the last stored event's chain, under the same salt, join that event."""
        if not self._pending or parent is None:
            return False
        last = self._pending[-1]
        if last["type"] != "BlockStored" or last["block_hashes"][-1] != parent or last.get("cache_salt") != salt:
            return False
        last["block_hashes"].extend(hashes)
        last["token_ids"].extend(tokens)
        return True

    def removed(self, hashes: Sequence[int]) -> None:
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}
        if self.engine == "vllm":
            event["group_idx"] = 0
        self._add(event)

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def _add(self, event: dict[str, Any]) -> None:
        if self._closed:
            return
        self._pending.append(event)
        if self._flush_handle is None:
            try:
                self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no running loop (a cache driven on its own): one batch per event
                self.flush()

    # -- batches -----------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Publish what is pending as one batch (the loop calls this once per turn that produced events)."""
        self._flush_handle = None
        if self._closed or not self._pending:
            return
        events, self._pending = self._pending, []
        payload: bytes = msgpack.packb([time.time(), events, 0])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.drop_next > 0:
            self.drop_next -= 1
            self.dropped += 1
            return
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError:  # PUB drops rather than blocks; anything else is lost, as with a real engine
            self.dropped += 1

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
            await router.send_multipart([identity, b"", b"", END_OF_REPLAY, b""])
