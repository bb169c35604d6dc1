"""The emulators' KV events on the wire, read with plain pyzmq and msgpack: each engine's field set, hash
signedness, parent chaining, evictions, replay, and numbering from 0 after a restart."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgpack
import zmq

from gateway.sim import FleetThread, SimSpec

SYSTEM = "You are a test." + " kalo mine ruta wenso" * 30


def body(user: str, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": user}]}


def receive(sub: zmq.Socket[bytes], count: int = 1) -> list[tuple[int, list[Any]]]:
    out: list[tuple[int, list[Any]]] = []
    deadline = time.monotonic() + 5
    while len(out) < count:
        assert sub.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), f"got {len(out)} of {count} batches"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@t" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
    return out


def run(engine: str, **kv: Any) -> None:
    spec = SimSpec(engine=engine, model="m", name="e", time_scale=50.0,  # type: ignore[arg-type]
                   kv_events={"topic": "kv@t", "replay_endpoint": "tcp://127.0.0.1:*", **kv},
                   overrides={"kv_capacity_tokens": 600})
    ctx = zmq.Context()
    with FleetThread([spec]) as fleet:
        server = fleet.fleet["e"]
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert server.kv_events_endpoint is not None
        sub.connect(server.kv_events_endpoint)
        time.sleep(0.2)
        httpx.post(f"{server.url}/v1/chat/completions", json=body("first"))
        (seq, batch), *_ = receive(sub)
        assert seq == 0 and len(batch) == 3 and batch[2] == 0 and isinstance(batch[0], float)
        stored = batch[1][0]
        assert next(iter(stored)) == "type" and stored["type"] == "BlockStored"
        keys = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"}
        keys |= {"lora_name", "group_idx"} if engine == "vllm" else {"cache_salt", "session_id", "lora_name"}
        assert set(stored) == keys and stored["parent_block_hash"] is None and stored["medium"] == "GPU"
        size = stored["block_size"]
        assert len(stored["token_ids"]) == size * len(stored["block_hashes"])
        if engine == "vllm":
            assert size == 16 and all(0 <= h < 2**64 for h in stored["block_hashes"])
        else:
            assert size == kv.get("page_size", 1) and all(-(2**63) <= h < 2**63 for h in stored["block_hashes"])
        first_hashes = stored["block_hashes"]
        # a second prompt sharing the system prompt: its new blocks chain onto a block of the first
        httpx.post(f"{server.url}/v1/chat/completions", json=body("second" + " hobade" * 40))
        batches = receive(sub)
        chained = [e for _, b in batches for e in b[1] if e["type"] == "BlockStored"]
        assert chained[0]["parent_block_hash"] in first_hashes
        # other prompts push the first out of a 600-token cache
        for i in range(6):
            httpx.post(f"{server.url}/v1/chat/completions", json=body("q", system=f"Other {i}." + " zuba" * 120))
        time.sleep(0.3)
        removed: list[Any] = []
        while sub.poll(100):
            removed += [e for e in msgpack.unpackb(sub.recv_multipart()[2])[1] if e["type"] == "BlockRemoved"]
        assert removed and set(removed[0]) == ({"type", "block_hashes", "medium", "group_idx"} if engine == "vllm"
                                               else {"type", "block_hashes", "medium"})
        # replay from 1 over a DEALER: every buffered batch from seq 1, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        assert server.kv_replay_endpoint is not None
        dealer.connect(server.kv_replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(2000)
            frames = dealer.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            if frames[2] == b"\xff" * 8:
                break
            seqs.append(int.from_bytes(frames[2], "big"))
        assert seqs == list(range(1, server.kv_events.seq if server.kv_events else 0))
        # a restarted server numbers from 0 again, on the same ports, and its replay buffer starts empty
        fleet.call(server.stop())
        fleet.call(server.start())
        httpx.post(f"{server.url}/v1/chat/completions", json=body("after restart"))
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(2000)
        frames = dealer.recv_multipart()
        assert int.from_bytes(frames[2], "big") == 0 and msgpack.unpackb(frames[3])[1][0]["parent_block_hash"] is None
        while frames[2] != b"\xff" * 8:  # the rest of the new process's batches, then the end marker
            assert dealer.poll(2000)
            frames = dealer.recv_multipart()
        dealer.close(0)
        sub.close(0)
    ctx.term()


def test_vllm_events() -> None:
    run("vllm")


def test_sglang_events_page_size_one_and_four() -> None:
    run("sglang")
    run("sglang", page_size=4)


def test_only_vllm_and_sglang_publish() -> None:
    import pytest

    with pytest.raises(ValueError, match="publishes no KV-cache events"):
        SimSpec(engine="llamacpp", model="m", kv_events={})
