"""The emulators' KV events on the wire, read with plain pyzmq and msgpack as a subscriber would: each engine's
frames, batch and event fields, its hash scheme and signedness (recomputed here from the token ids), parents
chained onto shared prefixes, evictions (the events always describe exactly what the cache holds), flushes,
numbering from 0 after a restart on the same ports, and replay of batches a subscriber missed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from gateway.kvcache.contexts import close_context, open_context
from gateway.sim import FleetThread, SimServer, SimSpec
from gateway.sim.hf_tokenizer import HFTokenizer
from gateway.sim.kv_events import END_OF_REPLAY, KvEventPublisher
from gateway.sim.prefix_cache import BlockCache, RadixCache
from gateway.sim.tokenizer_files import ensure_tokenizer
from tests.waiting import until

TOPIC = "kv@sim"
SYSTEM = "You are a test assistant." + " kalo mine ruta wenso bade fezu" * 12
VLLM_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name", "group_idx"]
SGLANG_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "cache_salt", "session_id", "lora_name"]
Batch = tuple[int, list[Any]]  # (seq, [ts, events, dp_rank])


# -- the engines' hash schemes, written out plainly --------------------------------------------------------------
def vllm_hashes(ids: list[int], block: int = 16) -> list[int]:
    """sha256 over (parent digest + the block's tokens as uint32 LE); the event hash is its low 8 bytes."""
    out, digest = [], b""
    for i in range(0, len(ids) - block + 1, block):
        digest = hashlib.sha256(digest + b"".join(t.to_bytes(4, "little") for t in ids[i : i + block])).digest()
        out.append(int.from_bytes(digest[-8:], "big"))
    return out


def sglang_hashes(ids: list[int], page: int = 1) -> list[int]:
    """SGLang's ``get_hash_str`` chain and ``hash_str_to_int64``."""
    out, prior = [], ""
    for i in range(0, len(ids) // page * page, page):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in ids[i : i + page]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        value = int(prior[:16], 16)
        out.append(value - 2**64 if value >= 2**63 else value)
    return out


# -- fixtures and helpers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_dir(tokenizer_dir)


def spec(engine: str, tokenizer_dir: Path, capacity: int = 100_000, **kv: Any) -> SimSpec:
    return SimSpec(engine=engine, model="m", name="e", time_scale=100.0, tokenizer=str(tokenizer_dir),  # type: ignore[arg-type]
                   kv_events={"topic": TOPIC, **kv}, overrides={"kv_capacity_tokens": capacity})


def chat(user: str, system: str = SYSTEM, max_tokens: int = 3) -> dict[str, Any]:
    return {"model": "m", "max_tokens": max_tokens, "messages": [{"role": "system", "content": system},
                                                                  {"role": "user", "content": user}]}


class Subscriber:
    """A SUB socket on the server's PUB endpoint, and a DEALER on its replay endpoint."""

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.ctx = open_context(zmq.Context)  # (its monitor socket too: see gateway.kvcache.contexts)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        assert server.kv_events_endpoint is not None
        self.sub.connect(server.kv_events_endpoint)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        assert server.kv_replay_endpoint is not None
        self.dealer.connect(server.kv_replay_endpoint)
        try:
            self.wait_connected()
        except BaseException:
            self.close()
            raise

    def wait_connected(self) -> None:
        """Until the SUB socket has (re)connected, and its subscription has had time to reach the publisher.
        (A SUB socket sends its subscription on a reconnect when it is next used: a poll does it.)"""
        assert self.monitor.poll(3000), "the subscriber did not connect"
        self.monitor.recv_multipart()
        assert not self.sub.poll(50)

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)
        self.dealer.close(0)
        close_context(self.ctx)

    def published(self) -> int:
        assert self.server.kv_events is not None
        return self.server.kv_events.seq

    def receive(self, until_seq: int | None = None) -> list[Batch]:
        """Live batches up to ``until_seq`` (default: every batch published so far)."""
        until = self.published() - 1 if until_seq is None else until_seq
        out: list[Batch] = []
        while not out or out[-1][0] < until:
            assert self.sub.poll(10_000), f"no batch {until}: {out}"
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
        return out

    def replay(self, start: int) -> list[Batch]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[Batch] = []
        while True:
            assert self.dealer.poll(2000), "no end of replay"
            frames = self.dealer.recv_multipart()
            if frames[2] == END_OF_REPLAY:
                assert frames == [b"", b"", END_OF_REPLAY, b""]
                return out
            empty, topic, seq, payload = frames
            assert empty == b"" and topic == TOPIC.encode()
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))


def post(server: SimServer, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def events(batches: list[Batch], kind: str | None = None) -> list[dict[str, Any]]:
    return [e for _, b in batches for e in b[1] if kind is None or e["type"] == kind]


def held_hashes(server: SimServer) -> set[int]:
    """Every block or page hash the emulated engine's cache holds now."""
    cache = server.scheduler.cache
    if isinstance(cache, BlockCache):
        return set(cache._blocks)
    assert isinstance(cache, RadixCache)
    out, stack = set(), list(cache._roots.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:  # (a salted tree's root holds the salt's seed, no page)
            out.update(int.from_bytes(d[:8], "big", signed=True) for d in node.digests or [])
    return out


def apply(index: dict[int, int | None], batches: list[Batch]) -> None:
    """A subscriber's index: block hash -> parent hash."""
    for event in events(batches):
        if event["type"] == "BlockStored":
            parent = event["parent_block_hash"]
            for h in event["block_hashes"]:
                index[h] = parent
                parent = h
        elif event["type"] == "BlockRemoved":
            for h in event["block_hashes"]:
                assert h in index, "removed a block never stored"
                del index[h]
        else:
            index.clear()


ENGINES = [pytest.param(("vllm", {}), id="vllm"), pytest.param(("sglang", {}), id="sglang"),
           pytest.param(("sglang", {"page_size": 4}), id="sglang-page4")]


def engine_spec(param: tuple[str, dict[str, Any]], tokenizer_dir: Path, **kw: Any) -> SimSpec:
    engine, kv = param
    return spec(engine, tokenizer_dir, **{**kv, **kw})


# -- live events -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("param", ENGINES)
def test_a_first_request_stores_its_prompt_in_the_engines_wire_format(param: tuple[str, dict[str, Any]],
                                                                      tokenizer_dir: Path, hf: HFTokenizer) -> None:
    engine, kv = param
    with FleetThread([engine_spec(param, tokenizer_dir)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        try:
            body = chat("first question")
            sent = time.time()
            post(server, body)
            batches = sub.receive()
            received = time.time()
        finally:
            sub.close()
    ids = hf.chat_ids(body["messages"])
    (seq, batch), *_ = batches
    assert seq == 0 and [b[0] for b in batches] == list(range(len(batches)))
    assert len(batch) == 3 and isinstance(batch[0], float) and batch[2] == 0
    assert sent <= batch[0] <= received  # real time: stamped with the wall clock's seconds as it is published
    stored = batch[1][0]
    assert list(stored) == (VLLM_KEYS if engine == "vllm" else SGLANG_KEYS)  # "type" first, fields in order
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None and stored["medium"] == "GPU"
    assert stored["lora_id"] is None and stored["lora_name"] is None
    size = 16 if engine == "vllm" else kv.get("page_size", 1)
    assert stored["block_size"] == size
    full = len(ids) // size * size
    assert stored["token_ids"] == ids[:full], "the prompt's full blocks, as the model's token ids"
    expected = vllm_hashes(ids) if engine == "vllm" else sglang_hashes(ids, size)
    assert stored["block_hashes"] == expected
    every = [h for e in events(batches, "BlockStored") for h in e["block_hashes"]]
    if engine == "vllm":
        assert stored["group_idx"] == 0
        assert all(0 <= h < 2**64 for h in every) and any(h >= 2**63 for h in every), "unsigned 64-bit"
    else:
        assert stored["cache_salt"] is None and stored["session_id"] is None
        assert all(-(2**63) <= h < 2**63 for h in every) and any(h < 0 for h in every), "signed 64-bit"


@pytest.mark.parametrize("param", ENGINES)
def test_a_shared_prefix_chains_onto_its_last_shared_block(param: tuple[str, dict[str, Any]],
                                                           tokenizer_dir: Path, hf: HFTokenizer) -> None:
    engine, kv = param
    size = 16 if engine == "vllm" else kv.get("page_size", 1)
    first, second = chat("first question"), chat("a second, different question about the cache")
    with FleetThread([engine_spec(param, tokenizer_dir)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        try:
            post(server, first)
            sub.receive()
            before = sub.published()
            usage = post(server, second)["usage"]
            batches = sub.receive()
        finally:
            sub.close()
    ids1, ids2 = hf.chat_ids(first["messages"]), hf.chat_ids(second["messages"])
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2, strict=False)) if a != b)
    reused = shared // size * size
    assert usage["prompt_tokens"] == len(ids2) and usage["prompt_tokens_details"]["cached_tokens"] == reused
    stored = events([b for b in batches if b[0] >= before], "BlockStored")[0]
    expected = vllm_hashes(ids2) if engine == "vllm" else sglang_hashes(ids2, size)
    assert stored["parent_block_hash"] == expected[reused // size - 1], "the last block both prompts share"
    assert stored["block_hashes"] == expected[reused // size :]
    assert stored["token_ids"] == ids2[reused : len(ids2) // size * size]


@pytest.mark.parametrize("param", ENGINES)
def test_evictions_keep_the_events_equal_to_the_cache(param: tuple[str, dict[str, Any]],
                                                      tokenizer_dir: Path) -> None:
    """Under a small cache: BlockRemoved events, and a subscriber's index built from the events alone holds
    exactly what the cache holds, with every block's parent held too (vLLM evicts a chain's tail first)."""
    engine, _ = param
    seen: list[Batch] = []
    with FleetThread([engine_spec(param, tokenizer_dir, capacity=200)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        index: dict[int, int | None] = {}
        try:
            for i in range(8):
                post(server, chat(f"question {i}", system=f"System {i % 5}." + " zuba feso hogi" * (8 + i)))
                batches = sub.receive()
                seen += batches
                apply(index, batches)
                assert set(index) == held_hashes(server)
                assert all(p is None or p in index for p in index.values()), "a block held without its parent"
        finally:
            sub.close()
    removed = events(seen, "BlockRemoved")
    assert removed and all(e["block_hashes"] and e["medium"] == "GPU" for e in removed)
    assert list(removed[0]) == (["type", "block_hashes", "medium", "group_idx"] if engine == "vllm"
                                else ["type", "block_hashes", "medium"])


def test_evictions_are_published(tokenizer_dir: Path) -> None:
    with FleetThread([spec("vllm", tokenizer_dir, capacity=320)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        try:
            for i in range(3):
                post(server, chat("q", system=f"Other {i}." + " zuba feso" * 60))
            removed = events(sub.receive(), "BlockRemoved")
        finally:
            sub.close()
    assert removed and all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" for e in removed)


@pytest.mark.parametrize(("engine", "path"), [("vllm", "/reset_prefix_cache"), ("sglang", "/flush_cache")])
def test_flush_clears_and_a_restart_numbers_from_zero_on_the_same_ports(engine: str, path: str,
                                                                         tokenizer_dir: Path) -> None:
    with FleetThread([spec(engine, tokenizer_dir)]) as fleet:
        server = fleet.fleet["e"]
        endpoints = (server.kv_events_endpoint, server.kv_replay_endpoint)
        assert endpoints[0] is not None and endpoints[0].startswith("tcp://127.0.0.1:")
        assert not endpoints[0].endswith(":*") and endpoints[0] != endpoints[1]
        sub = Subscriber(server)
        try:
            post(server, chat("before"))
            sub.receive()
            assert httpx.post(server.url + path, timeout=5).status_code == 200
            last = sub.receive()[-1]
            assert last[1][1] == [{"type": "AllBlocksCleared"}]
            fleet.call(server.stop())
            fleet.call(server.start())  # a fresh process: same ports, numbering from 0, an empty replay buffer
            assert (server.kv_events_endpoint, server.kv_replay_endpoint) == endpoints
            sub.wait_connected()  # the subscriber reconnects on its own
            post(server, chat("after"))
            (seq, batch), *_ = sub.receive()
            assert seq == 0 and batch[1][0]["parent_block_hash"] is None
            assert [s for s, _ in sub.replay(0)] == list(range(sub.published()))
        finally:
            sub.close()


# -- replay ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_dropped_batches_leave_a_gap_that_replay_fills(engine: str, tokenizer_dir: Path) -> None:
    with FleetThread([spec(engine, tokenizer_dir)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        try:
            post(server, chat("one"))
            seen = sub.receive()
            assert server.kv_events is not None
            server.kv_events.drop_next = 2  # the next two batches: numbered and buffered, never sent
            sent = server.kv_events.sent
            for i in range(6):  # until a batch after the dropped ones goes out
                post(server, chat("two", system=f"System number {i}." + " hobade" * 40))
                if server.kv_events.sent > sent:
                    break
            live = sub.receive()
            missing = sorted(set(range(seen[-1][0] + 1, live[-1][0] + 1)) - {s for s, _ in live})
            assert len(missing) == 2 and missing[0] == seen[-1][0] + 1
            replayed = sub.replay(missing[0])
            assert [s for s, _ in replayed] == list(range(missing[0], sub.published()))
            assert all(dict(replayed)[s] == b for s, b in live), "a replayed batch is the batch published"
            assert all(b[1] for _, b in replayed)
            # a request that is not [b"", seq] is ignored; the socket still answers the next one
            sub.dealer.send_multipart([b"", (0).to_bytes(8, "big"), b"extra"])
            assert not sub.dealer.poll(150)
            assert [s for s, _ in sub.replay(10**6)] == []
            # the same knob over HTTP, for fleets in another process
            r = httpx.post(server.url + "/sim/faults", json={"kv_events_drop_next": 1}, timeout=5)
            assert r.status_code == 200 and server.kv_events.drop_next == 1
        finally:
            sub.close()


def test_a_gap_older_than_the_buffer_cannot_be_filled(tokenizer_dir: Path) -> None:
    with FleetThread([spec("vllm", tokenizer_dir, buffer_steps=3)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        try:
            for i in range(3):
                post(server, chat(f"question {i}"))
            total = sub.published()
            assert total > 3
            assert [s for s, _ in sub.replay(0)] == list(range(total - 3, total)), "only the last 3 batches"
        finally:
            sub.close()


# -- the publisher on its own ------------------------------------------------------------------------------------
def _tasks() -> int:
    """This process's ZMQ background threads (libzmq names them ``ZMQbg/...``): counting every thread failed
    when a thread of an earlier test's server ended meanwhile."""
    if not os.path.isdir("/proc/self/task"):
        return 0
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith("ZMQbg")
        except OSError:  # the thread ended meanwhile
            pass
    return count


def test_one_batch_per_loop_turn_sglang_coalescing_and_a_clean_close() -> None:
    threads = _tasks()

    async def scenario() -> list[tuple[int, list[Any]]]:
        pub = KvEventPublisher("sglang", "tcp://127.0.0.1:0", "tcp://127.0.0.1:*", topic=TOPIC, buffer_steps=5)
        try:
            assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
            pub.start()
            # (a new thread names itself ZMQbg once it runs: seen late under load)
            await until(lambda: _tasks() > threads, "the publisher runs ZMQ threads (so the count below can tell)")
            pub.stored([1, 2], None, [10, 11], 1)
            pub.stored([3], 2, [12], 1)  # continues the chain: joins the event
            pub.stored([4], 1, [20], 1)  # a sibling: an event of its own
            pub.removed([4])
            await asyncio.sleep(0)
            pub.cleared()
            await asyncio.sleep(0)
            out = [(seq, msgpack.unpackb(payload)) for seq, payload in pub.buffer]
        finally:
            await pub.close()  # (also when an assertion fails: nothing left running)
        return out

    batches = asyncio.run(scenario())
    assert [s for s, _ in batches] == [0, 1]
    assert [(e["type"], e.get("block_hashes"), e.get("parent_block_hash"), e.get("token_ids"))
            for e in batches[0][1][1]] == [("BlockStored", [1, 2, 3], None, [10, 11, 12]),
                                           ("BlockStored", [4], 1, [20]), ("BlockRemoved", [4], None, None)]
    assert batches[1][1][1] == [{"type": "AllBlocksCleared"}]
    assert _tasks() == threads, "the publisher's zmq threads end with it"


def test_vllm_never_coalesces_and_drop_next_still_numbers() -> None:
    async def scenario() -> KvEventPublisher:
        pub = KvEventPublisher("vllm", topic=TOPIC)
        pub.drop_next = 1
        pub.stored([1], None, list(range(16)), 16)
        pub.stored([2], 1, list(range(16)), 16)
        await asyncio.sleep(0)
        pub.removed([2])
        await asyncio.sleep(0)
        await pub.close()
        return pub

    pub = asyncio.run(scenario())
    assert pub.replay_endpoint is None and (pub.seq, pub.sent, pub.dropped) == (2, 1, 1)
    first = msgpack.unpackb(pub.buffer[0][1])[1]
    assert [e["block_hashes"] for e in first] == [[1], [2]]


def test_only_vllm_and_sglang_publish_and_settings_are_checked(tokenizer_dir: Path) -> None:
    for engine in ("llamacpp", "tabbyapi"):
        with pytest.raises(ValueError, match="publishes no KV-cache events"):
            SimSpec(engine=engine, model="m", kv_events={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown keys"):
        SimSpec(engine="vllm", model="m", kv_events={"endpont": "tcp://127.0.0.1:5557"})
    with pytest.raises(ValueError, match="page_size"):
        SimSpec(engine="vllm", model="m", kv_events={"page_size": 4})
    with pytest.raises(ValueError, match="buffer_steps"):
        SimSpec(engine="sglang", model="m", kv_events={"buffer_steps": 0})
    with pytest.raises(ValueError, match="tokenizer"):
        SimSpec(engine="llamacpp", model="m", tokenizer=str(tokenizer_dir / "missing"))


def test_sglang_server_info_advertises_its_publisher(tokenizer_dir: Path) -> None:
    with FleetThread([spec("sglang", tokenizer_dir, page_size=4)]) as fleet:
        server = fleet.fleet["e"]
        info = httpx.get(server.url + "/server_info", timeout=5).json()["kv_events"]
    assert server.kv_events_endpoint is not None and server.kv_replay_endpoint is not None
    assert info == {"publisher": "zmq", "endpoint_host": "127.0.0.1",
                    "endpoint_port_base": int(server.kv_events_endpoint.rsplit(":", 1)[1]), "topic": TOPIC,
                    "block_size": 4, "dp_size": 1,
                    "replay_endpoint_port_base": int(server.kv_replay_endpoint.rsplit(":", 1)[1])}


@pytest.mark.parametrize("param", ENGINES)
def test_a_salted_prompt_is_published_with_its_salt_and_keyed_apart(param: tuple[str, dict[str, Any]],
                                                                      tokenizer_dir: Path, hf: HFTokenizer) -> None:
    """vLLM 0.34 puts the salt in the first block's ``extra_keys`` entry, SGLang in ``cache_salt``; the gateway's
    index then holds the prompt under that salt only."""
    from gateway.kvcache.index import EventIndex, request_keys
    from gateway.kvcache.wire import decode_batch

    engine, _ = param
    body = {**chat("first question"), "cache_salt": "tenant-a"}
    with FleetThread([engine_spec(param, tokenizer_dir)]) as fleet:
        server = fleet.fleet["e"]
        sub = Subscriber(server)
        try:
            post(server, body)
            batches = sub.receive()
        finally:
            sub.close()
    stored = events(batches, "BlockStored")[0]
    if engine == "vllm":
        assert stored["extra_keys"][0] == ["tenant-a"] and set(stored["extra_keys"][1:]) <= {None}
    else:
        assert stored["cache_salt"] == "tenant-a"
    index = EventIndex()
    for seq, batch in batches:
        index.apply(decode_batch(seq, msgpack.packb(batch)))
    ids = hf.chat_ids(body["messages"])
    assert index.chunk is not None
    held = index.match(request_keys(ids, index.chunk, cache_salt="tenant-a"))
    assert held >= (len(ids) - index.chunk) // index.chunk
    assert index.match(request_keys(ids, index.chunk)) == 0
    assert index.match(request_keys(ids, index.chunk, cache_salt="tenant-b")) == 0
