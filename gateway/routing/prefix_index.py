"""What each backend's prefix cache probably holds, modelled as the engine caches (``EngineSpec.cache``).

* ``blocks`` (vLLM, SGLang, TabbyAPI, llama.cpp with its host-RAM prompt cache): a per-backend LRU set of
  chained block hashes, a shared prefix counted in the engine's whole pages (``cache_page_tokens``: vLLM 16,
  ExLlama 256, SGLang's radix tree 1), sized to the backend's cache where the engine says how big it is
  (``Capacity.cache_tokens``), corrected by what the engine reports it really had cached: a request predicted
  to hit but reported as (mostly) missed means the cache evicts sooner than assumed, so that backend's index
  shrinks; hits as predicted let it grow back towards the engine's stated size.
* ``slots`` (llama.cpp started with ``--cache-ram 0``, stated as ``cache_ram_mib: 0`` in the backend's
  settings): one prompt per slot, placed as llama.cpp places it (:mod:`gateway.routing.slot_index`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import islice, repeat, takewhile

from gateway.pool.backend import Backend
from gateway.routing.prompt import BLOCK_BYTES, BlockKey
from gateway.routing.slot_index import SlotIndex

DEFAULT_CACHE_TOKENS = 100_000  # when the engine does not say
MIN_BLOCKS = 64


# runs an iterator to its end in C, keeping nothing
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


class BlockIndex:
    """An LRU set of block keys, oldest first (a dict keeps insertion order). Every operation is a few C-level
    calls over the request's keys, with no Python step per block: a request's keys are removed wherever they
    are and appended again, so they become the most recent in their order, and the oldest keys beyond the
    capacity are dropped."""

    __slots__ = ("_blocks", "capacity", "epoch", "limit")

    def __init__(self, capacity: int, epoch: int = 0) -> None:
        self._blocks: dict[BlockKey, None] = {}
        self.epoch = epoch  # the backend's epoch it describes
        self.capacity = capacity  # current estimate, in blocks
        self.limit = capacity  # what the engine states

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, blocks: Sequence[BlockKey]) -> int:
        """How many leading blocks are held (chained keys: the first miss ends the shared prefix)."""
        return len(list(takewhile(self._blocks.__contains__, blocks)))

    def insert(self, blocks: Sequence[BlockKey], held_leading: int | None = None) -> None:
        """``blocks`` become the most recent, in order. ``held_leading``: ``match(blocks)``, when the caller
        has it; only those keys are moved then (a key past the first miss is all but never held: its chain
        runs through the missing one, and a tail outliving its head is only refreshed when the head is)."""
        held = self._blocks
        if held_leading is None:
            _consume(map(held.pop, blocks, repeat(None)))
        elif held_leading:
            _consume(map(held.__delitem__, blocks[:held_leading]))
        held.update(dict.fromkeys(blocks))
        self._evict()

    def resize(self, capacity: int) -> None:
        self.capacity = max(MIN_BLOCKS, min(capacity, self.limit))
        self._evict()

    def _evict(self) -> None:
        # In batches: a dict keeps the slots of removed keys until it next resizes, and finding the oldest keys
        # walks over them, so evicting a request's worth at a time cost more than the rest of the index. The
        # index may hold an eighth over its capacity meanwhile (the capacity is an estimate itself).
        held = self._blocks
        capacity = self.capacity
        if len(held) > capacity + (capacity >> 3):
            _consume(map(held.__delitem__, list(islice(held, len(held) - capacity))))


class PrefixIndexes:
    """One index per backend, created on first use: a :class:`SlotIndex` where the engine holds one prompt per
    slot and says how many slots it has, else a :class:`BlockIndex` sized from the backend's capacity."""

    def __init__(self, bytes_per_token: float = 4.0) -> None:
        self._indexes: dict[str, BlockIndex | SlotIndex] = {}
        self.bytes_per_token = bytes_per_token

    def for_backend(self, backend: Backend) -> BlockIndex | SlotIndex:
        index = self._indexes.get(backend.name)
        slots = backend.capacity.slots if backend.caches_by_slot else None
        if slots:
            if not isinstance(index, SlotIndex) or index.epoch != backend.epoch or len(index) != slots:
                index = self._indexes[backend.name] = SlotIndex(slots, backend.epoch,
                                                                pin=backend.spec.slot_field is not None,
                                                                clock=backend.clock)
            return index
        stated = self._stated_blocks(backend)
        if not isinstance(index, BlockIndex) or index.epoch != backend.epoch:
            # new, or the engine restarted with an empty cache
            index = self._indexes[backend.name] = BlockIndex(stated, backend.epoch)
        elif index.limit != stated:  # the engine restarted with another size, or told us at last
            index.limit = stated
            index.resize(stated)
        return index

    def _stated_blocks(self, backend: Backend) -> int:
        tokens = backend.capacity.cache_tokens or DEFAULT_CACHE_TOKENS
        return max(MIN_BLOCKS, int(tokens * self.bytes_per_token / BLOCK_BYTES))

    def match(self, backend: Backend, blocks: Sequence[BlockKey]) -> int:
        return self.lookup(backend, blocks)[0]

    def _whole_pages(self, backend: Backend, blocks: int) -> int:
        """Of ``blocks`` shared leading blocks, those the engine reuses: its cache keeps whole pages of
        ``cache_page_tokens`` tokens, so a shared prefix counts down to its last whole page."""
        page = backend.capacity.page_tokens or backend.spec.cache_page_tokens
        if page <= 1 or not blocks:
            return blocks
        tokens = blocks * BLOCK_BYTES / self.bytes_per_token
        return int((tokens // page) * page * self.bytes_per_token / BLOCK_BYTES)

    def lookup(self, backend: Backend, blocks: Sequence[BlockKey]) -> tuple[int, bool, bool]:
        """If the request were sent now: the leading blocks found cached, whether it would first wait for the
        slot that holds them (slot indexes that pin), and whether it would take an empty slot (evicting
        nothing)."""
        index = self.for_backend(backend)
        if isinstance(index, SlotIndex):
            placement = index.plan(blocks)
            slot = placement.slot
            return (placement.cached, placement.waits and slot is not None,
                    slot is not None and not placement.waits and not index.contents[slot])
        return self._whole_pages(backend, index.match(blocks)), False, False

    def assign(self, backend: Backend, blocks: Sequence[BlockKey], owner: Hashable) -> tuple[int, int | None]:
        """The request ``owner`` goes to ``backend``: afterwards its cache holds the prompt. Returns the blocks
        predicted cached there, and the slot to name in the request where the index pins one."""
        index = self.for_backend(backend)
        if isinstance(index, SlotIndex):
            placement = index.assign(blocks, owner)
            return placement.cached, placement.slot if index.pin else None
        held = index.match(blocks)
        index.insert(blocks, held)
        return self._whole_pages(backend, held), None

    def remote_insert(self, backend: str, blocks: Sequence[BlockKey]) -> None:
        """Another replica routed ``blocks`` to ``backend``: its block index holds them now too (a backend this
        replica has no block index for yet, or whose index is by slot, is left alone)."""
        index = self._indexes.get(backend)
        if isinstance(index, BlockIndex):
            index.insert(blocks)

    def release(self, backend: Backend, owner: Hashable) -> None:
        """The request ``owner`` finished on (or left) ``backend``: a slot it held is idle again."""
        index = self._indexes.get(backend.name)
        if isinstance(index, SlotIndex):
            index.release(owner)

    def correct(self, backend: Backend, predicted_blocks: int, reported_cached_tokens: int) -> None:
        """Reconcile a prediction with what the engine reported for the same request (block indexes: their
        size; a slot index places as the engine does and has no size to learn)."""
        index = self.for_backend(backend)
        if isinstance(index, SlotIndex):
            return
        reported_blocks = int(reported_cached_tokens * self.bytes_per_token / BLOCK_BYTES)
        if predicted_blocks >= 4 and reported_blocks < predicted_blocks // 2:
            index.resize(int(index.capacity * 0.8))  # evicted sooner than we thought
        elif predicted_blocks > 0 and reported_blocks >= predicted_blocks:
            index.resize(int(index.capacity * 1.05) + 1)

    def learn_bytes_per_token(self, prompt_bytes: int, prompt_tokens: int) -> None:
        if prompt_tokens > 16 and prompt_bytes > 0:
            self.bytes_per_token += 0.05 * (prompt_bytes / prompt_tokens - self.bytes_per_token)
