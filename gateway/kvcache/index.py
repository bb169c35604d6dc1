"""What one engine's prefix cache holds, as its KV events say, keyed by the gateway's own hashes.

The engines' block hashes cannot be recomputed outside the engine: vLLM hashes a pickle of ``(parent,
tokens, extra keys)`` with a per-deployment seed and algorithm (``--prefix-caching-hash-algo``; before 0.31 a
random seed per process) and keeps the low 64 bits; SGLang keeps the first 64 bits, signed, of its own SHA-256
chain. But every ``BlockStored`` carries the tokens of its blocks and the hash of the block before them, so
the gateway keys each block by its *own* chain hash (blake2b over the parent's own key and the block's token
ids), found by following the engine's parent hash to the own key recorded for it. A request is then keyed the
same way from its own token ids, and "held" means "the engine announced it and has not evicted it". llm-d's
precise scorer and Dynamo's KV router keep their own keys for the same reasons.

Own keys are cut in chunks of at least :data:`MIN_CHUNK_TOKENS` tokens, a whole number of the engine's blocks
(vLLM: 16 tokens, one block; SGLang's default page of one token: 16 pages), so a page-size-1 radix cache does
not cost one key per token on each request. A chunk counts as held while the engine holds its last block:
both engines evict a sequence's tail before its head (vLLM frees a request's blocks in reverse order, SGLang
evicts radix leaves first), and a match stops at the first chunk not held anyway.

Medium: ``GPU`` (or none) is the device tier; anything else (``CPU``, ``CPU_PINNED``, ``STORAGE``, ``DISK``)
is a slower tier, counted at :data:`HOST_WEIGHT` of a device hit. Only KV-cache group 0 is indexed (hybrid
models publish one stream per group; group 0 is the full-attention one).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Generator, Sequence

from gateway.kvcache.wire import PACE, AllBlocksCleared, Batch, BlockRemoved, BlockStored, Hash, work

MIN_CHUNK_TOKENS = 16
HOST_WEIGHT = 0.5
# engine blocks remembered per backend; beyond it the index is reset (lost removals). ~260-320 bytes each (hashes
# of at most wire.MAX_HASH_BYTES): ~320 MB at most per backend, 16M tokens at 16 a block (4M let a publisher hold
# ~1.3 GB for good, sweep 13)
MAX_NODES = 1_000_000
DEVICE, HOST = 0, 1
MAX_SPECULATIVE = 100_000
MAX_SEEDS = 10_000  # chain seeds kept (one per LoRA and cache salt seen); past it they are computed afresh
SPECULATIVE_PRUNE_AGE = 60.0


def chunk_tokens(block_size: int) -> int:
    """The own-key chunk for an engine block size: the smallest whole number of blocks >= MIN_CHUNK_TOKENS."""
    return block_size * max(1, -(-MIN_CHUNK_TOKENS // block_size))


def seed_key(lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
    """The chain's starting key: base model, or one LoRA adapter, under a cache salt or none (the engine keys
    each apart: a prefix cached under one salt is no one else's)."""
    salt = b"\0salt:" + cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""
    return hashlib.blake2b(b"kv-chain:" + (lora_name or "").encode() + salt, digest_size=8).digest()


def _next_key(previous: bytes, tokens: bytes) -> bytes:
    return hashlib.blake2b(previous + tokens, digest_size=8).digest()


def _pack(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def request_keys(tokens: Sequence[int], chunk: int, lora_name: str | None = None,
                 cache_salt: str | None = None) -> list[bytes]:
    """Own keys of a prompt's full chunks, as :class:`EventIndex` keys the blocks the engine announces (under
    ``cache_salt``: the salt the engine gets with it)."""
    keys: list[bytes] = []
    key = seed_key(lora_name, cache_salt)
    packed = _pack(tokens)
    step = chunk * 4
    for start in range(0, len(tokens) // chunk * step, step):
        key = _next_key(key, packed[start : start + step])
        keys.append(key)
    return keys


class EventIndex:
    """One engine process's cache contents as announced by its events.

    ``_nodes`` maps (tier, engine hash) to the chain state after that block: the own key of the last full
    chunk, the tokens since (a partial chunk, packed), and whether this block completes a chunk.
    """

    __slots__ = ("_held", "_nodes", "_seeds", "_speculative", "chunk", "orphans", "stored_blocks")

    def __init__(self, block_size: int | None = None) -> None:
        self.chunk: int | None = chunk_tokens(block_size) if block_size else None
        self._nodes: dict[tuple[int, Hash], tuple[bytes, bytes, bool]] = {}
        self._held: tuple[dict[bytes, int], dict[bytes, int]] = ({}, {})
        self._seeds: dict[tuple[str | None, str | None], bytes] = {}  # (LoRA, salt) -> its chain's seed
        # chunks of prompts just routed here, until the engine has had time to announce them: own key -> expiry
        self._speculative: dict[bytes, float] = {}
        self.orphans = 0  # BlockStored events dropped: their parent was never announced (history missed)
        self.stored_blocks = 0

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def keys_held(self) -> int:
        return len(self._held[DEVICE]) + len(self._held[HOST])

    def clear(self) -> None:
        self._speculative.clear()
        self._nodes.clear()
        self._held[DEVICE].clear()
        self._held[HOST].clear()

    def apply(self, batch: Batch) -> None:
        for _ in self.apply_steps(batch):
            pass

    def apply_steps(self, batch: Batch) -> Generator[None, None, None]:
        """Apply the batch, pausing (yielding) every ``PACE`` blocks so the caller can let others run."""
        done = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
            done += work(event)
            if done >= PACE:
                done = 0
                if len(self._nodes) > MAX_NODES:
                    self.clear()
                yield
        if len(self._nodes) > MAX_NODES:
            self.clear()

    def _stored(self, ev: BlockStored) -> None:
        if ev.group_idx not in (None, 0) or not ev.block_hashes:
            return
        bs = ev.block_size
        if self.chunk is None:
            self.chunk = chunk_tokens(bs)
        chunk = self.chunk
        if chunk % bs or len(ev.token_ids) != len(ev.block_hashes) * bs:
            return  # another block size than the one keyed (or masked blocks): not comparable
        tier = DEVICE if ev.medium in (None, "GPU") else HOST
        nodes = self._nodes
        if ev.parent is None:
            namespace = (ev.lora_name, ev.cache_salt)
            seed = self._seeds.get(namespace)
            if seed is None:
                if len(self._seeds) > MAX_SEEDS:
                    self._seeds.clear()
                seed = self._seeds[namespace] = seed_key(ev.lora_name, ev.cache_salt)
            key, pending = seed, b""
        else:
            state = nodes.get((tier, ev.parent)) or nodes.get((1 - tier, ev.parent))
            if state is None:
                self.orphans += 1
                return
            key, pending, _ = state
        held = self._held[tier]
        packed = _pack(ev.token_ids)
        step = bs * 4
        full = chunk * 4
        for i, block_hash in enumerate(ev.block_hashes):
            pending += packed[i * step : (i + 1) * step]
            ends = len(pending) == full
            if ends:
                key = _next_key(key, pending)
                pending = b""
            node = (tier, block_hash)
            previous = nodes.get(node)
            if previous is not None and previous[2]:  # announced again (a re-report): count it once
                self._release(tier, previous[0])
            nodes[node] = (key, pending, ends)
            if ends:
                held[key] = held.get(key, 0) + 1
        self.stored_blocks += len(ev.block_hashes)

    def _removed(self, ev: BlockRemoved) -> None:
        if ev.group_idx not in (None, 0):
            return
        tier = DEVICE if ev.medium in (None, "GPU") else HOST
        nodes = self._nodes
        for block_hash in ev.block_hashes:
            state = nodes.pop((tier, block_hash), None)
            if state is not None and state[2]:
                self._release(tier, state[0])

    def _release(self, tier: int, key: bytes) -> None:
        held = self._held[tier]
        count = held.get(key, 0) - 1
        if count > 0:
            held[key] = count
        else:
            held.pop(key, None)

    def speculate(self, keys: Sequence[bytes], until: float) -> None:
        """A prompt with these chunk keys was just sent to this engine: count them as held until ``until``
        (monotonic seconds), so requests sharing it that arrive before the engine's events do (its prefill
        takes time) follow it instead of computing the same prefix elsewhere. llm-d's precise scorer keeps
        such speculative entries for the same reason."""
        speculative = self._speculative
        if len(speculative) > MAX_SPECULATIVE:
            now = until - SPECULATIVE_PRUNE_AGE
            for key in [k for k, t in speculative.items() if t < now]:
                del speculative[key]
            if len(speculative) > MAX_SPECULATIVE:
                speculative.clear()
        for key in keys:
            speculative[key] = until

    def match(self, keys: Sequence[bytes], now: float | None = None) -> float:
        """Leading chunks of ``keys`` held, a slower-tier chunk counted as :data:`HOST_WEIGHT` of one; with
        ``now``, chunks speculated until after it count as held."""
        device, host = self._held
        speculative = self._speculative if now is not None else {}
        after = now if now is not None else 0.0
        n = 0.0
        for key in keys:
            if key in device:
                n += 1.0
            elif key in host:
                n += HOST_WEIGHT
            elif speculative.get(key, 0.0) > after:
                n += 1.0
            else:
                break
        return n
