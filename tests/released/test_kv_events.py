"""Every KV event the engines' own publishers emit, over real ZMQ on loopback, decodes in the gateway.

vLLM's ``vllm/distributed/kv_events.py`` and SGLang's ``srt/disaggregation/kv_events.py`` (newest and oldest
pinned release: map-form events in vLLM 0.34 and SGLang 0.5.23, array-form in vLLM 0.23 and SGLang 0.5.19)
publish each event type; the gateway's decoder (``gateway.kvcache.wire``) must read every field it uses from
the live PUB stream and from the replay socket: hashes, parent, tokens, block size, medium, LoRA name, the
KV-cache group (hybrid models) and the cache salt a chain starts under.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from gateway.kvcache.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, decode_message, decode_replay
from tests.released.conftest import released
from tests.released.loader import EngineCode
from tests.released.sources import SGLANG_NEWEST, SGLANG_OLDEST, VLLM_NEWEST, VLLM_OLDEST, Release
from tests.waiting import wait_until

RELEASES = (VLLM_NEWEST, VLLM_OLDEST, SGLANG_NEWEST, SGLANG_OLDEST)
TOPIC = "kv"
TOKENS = list(range(100, 108))
WAIT_S = 10.0  # for a message that is on its way (a failure, not a pacing: the test waits for the frames)


@dataclass(frozen=True)
class Publisher:
    """One release's kv_events module, loaded with everything else of the engine stubbed."""

    code: EngineCode
    module: Any
    package: str

    def start(self, endpoint: str, replay: str) -> Any:
        with self.code.active():  # (data-parallel rank 0: the endpoints as given)
            return self.module.ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic=TOPIC)

    def batch(self, events: list[Any]) -> Any:
        return self.module.KVEventBatch(ts=time.time(), events=events)

    def every_event(self) -> tuple[list[Any], list[Any]]:
        """(each event type as the engine builds it, what the gateway must decode from each)."""
        m = self.module
        salted, plain = self._stored(m)
        removed = m.BlockRemoved(block_hashes=[12], medium="GPU",
                                 **({"group_idx": 1} if self.package == "vllm" else {}))
        expected_removed = BlockRemoved((12,), "GPU", 1 if self.package == "vllm" else None)
        return ([*salted[0:1], *plain[0:1], removed, m.AllBlocksCleared()],
                [*salted[1:], *plain[1:], expected_removed, AllBlocksCleared()])

    def _stored(self, m: Any) -> tuple[list[Any], list[Any]]:
        fields = set(getattr(m.BlockStored, "__struct_fields__", ()))
        if self.package == "vllm":
            # a chain's first blocks under a LoRA and a cache_salt: extra_keys hold, per block, the LoRA name then
            # (first block only) the salt; group 1 of a hybrid model
            salted = m.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=TOKENS, block_size=4,
                                   lora_id=None, medium="GPU", lora_name="adapter",
                                   extra_keys=[("adapter", "salt-1"), ("adapter",)], group_idx=1)
            plain = m.BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32, token_ids=TOKENS[:4],
                                  block_size=4, lora_id=None, medium="CPU", lora_name=None)
            return ([salted, BlockStored((11, 12), None, tuple(TOKENS), 4, "GPU", "adapter", 1, "salt-1")],
                    [plain, BlockStored((b"\x01" * 32,), b"\x02" * 32, tuple(TOKENS[:4]), 4, "CPU")])
        if "cache_salt" in fields:  # SGLang 0.5.23: the salt and the LoRA name in the event
            salted = m.BlockStored(block_hashes=[-5, 7], parent_block_hash=None, token_ids=TOKENS[:2], block_size=1,
                                   lora_id=None, medium="GPU", cache_salt="salt-1", lora_name="adapter")
            expected = BlockStored((-5, 7), None, tuple(TOKENS[:2]), 1, "GPU", "adapter", None, "salt-1")
        else:  # SGLang 0.5.19: a salted event is BlockStoredWithMetadata(metadata=BlockStoredMetadata(cache_salt))
            salted = m.BlockStoredWithMetadata(block_hashes=[-5, 7], parent_block_hash=None, token_ids=TOKENS[:2],
                                               block_size=1, lora_id=None, medium="GPU",
                                               metadata=m.BlockStoredMetadata(cache_salt="salt-1"))
            expected = BlockStored((-5, 7), None, tuple(TOKENS[:2]), 1, "GPU", None, None, "salt-1")
        plain = m.BlockStored(block_hashes=[9], parent_block_hash=7, token_ids=TOKENS[2:3], block_size=1, lora_id=None,
                              medium="GPU")
        return [salted, expected], [plain, BlockStored((9,), 7, tuple(TOKENS[2:3]), 1, "GPU")]


def _load(release: Release) -> Publisher:
    root = released(release)
    if release.package == "vllm":
        code = EngineCode(root, "vllm", real={"vllm.envs", "vllm.distributed.kv_events"},
                          stubs={"vllm.logger": {"init_logger": logging.getLogger},
                                 "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int}})
        name = "vllm.distributed.kv_events"
    else:
        code = EngineCode(root, "sglang", real={"sglang.srt.disaggregation.kv_events"})
        name = "sglang.srt.disaggregation.kv_events"
    return Publisher(code, code.module(name), release.package)


@pytest.fixture(scope="module")
def publishers() -> Callable[[Release], Publisher]:
    loaded: dict[Release, Publisher] = {}

    def get(release: Release) -> Publisher:
        if release not in loaded:
            loaded[release] = _load(release)
        return loaded[release]

    return get


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket[bytes], str, str]]:
    """A SUB bound on loopback (the engine's PUB connects to it: an endpoint with no wildcard is connected to by
    every release's publisher) and an ipc path for the engine's replay ROUTER."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.bind("tcp://127.0.0.1:0")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    with tempfile.TemporaryDirectory(prefix="kv", dir="/tmp") as tmp:  # (ipc paths: at most 107 bytes)
        try:
            yield sub, endpoint, f"ipc://{Path(tmp) / 'replay'}"
        finally:
            sub.close(linger=0)
            context.term()


def _receive(sub: zmq.Socket[bytes]) -> list[bytes]:
    if not sub.poll(int(WAIT_S * 1000)):
        raise AssertionError(f"no message within {WAIT_S} s")
    return sub.recv_multipart()


@pytest.mark.parametrize("release", RELEASES, ids=[r.label for r in RELEASES])
def test_every_event_decodes_live_and_replayed(
    publishers: Callable[[Release], Publisher], sockets: tuple[zmq.Socket[bytes], str, str], release: Release
) -> None:
    pub_side = publishers(release)
    sub, endpoint, replay_endpoint = sockets
    events, expected = pub_side.every_event()
    publisher = pub_side.start(endpoint, replay_endpoint)
    try:
        # until the subscription has reached the publisher, PUB drops what it sends: send a clear until one arrives
        def arrived() -> bool:
            if sub.poll(0):
                return True
            publisher.publish(pub_side.batch([pub_side.module.AllBlocksCleared()]))
            return False

        wait_until(arrived, "the publisher's messages arriving", within=WAIT_S)
        first = decode_message(sub.recv_multipart())
        publisher.publish(pub_side.batch(events))
        live = _next_batch_after(sub, first.seq)
        replayed = _replay(replay_endpoint, live.seq)  # (this release's replay framing: 4 or 3 frames)
        assert [b.seq for b in replayed] == [live.seq]
        assert replayed[0].events == live.events and replayed[0].dp_rank == live.dp_rank
        assert live.dp_rank == 0 and live.skipped == 0
        assert live.events == tuple(expected)
    finally:
        # (its thread can stop before taking the shutdown sentinel: shutdown() then waits its whole timeout)
        publisher.SHUTDOWN_TIMEOUT = 0.1
        with pub_side.code.active():
            publisher.shutdown()


def _next_batch_after(sub: zmq.Socket[bytes], seq: int) -> Batch:
    while True:
        batch = decode_message(_receive(sub))
        if batch.seq > seq and batch.events != (AllBlocksCleared(),):
            return batch


def _replay(endpoint: str, start: int) -> list[Batch]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches: list[Batch] = []
        while True:
            if not dealer.poll(int(WAIT_S * 1000)):
                raise AssertionError(f"the replay socket sent no end marker within {WAIT_S} s")
            batch = decode_replay(dealer.recv_multipart())
            if batch is None:
                return batches
            batches.append(batch)
    finally:
        dealer.close(linger=0)
        context.term()
