"""Prefix caches, each in its engine's own unit.

* :class:`BlockCache`: full fixed-size blocks, each hash chained over its parent, LRU eviction. vLLM uses
  16-token blocks; ExLlamaV2/V3 (TabbyAPI) 256-token pages. Only whole blocks are reused.
* :class:`RadixCache`: SGLang's RadixAttention, token-granular (one trie node per token), LRU eviction of leaves.
* :class:`SlotCache`: llama.cpp, one cached prompt per slot; an idle slot is chosen by longest-common-prefix
  similarity (> ``similarity``) else least recently used; it also limits concurrency to the slot count.

All return the number of cached prompt tokens on admission, never the whole prompt (the last token is always
computed, as in the engines). A block or radix cache given ``events`` (a
:class:`~gateway.sim.kv_events.KvEventPublisher`) reports the blocks it stores, evicts and clears, as vLLM and
SGLang publish them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class CacheEvents(Protocol):
    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class PrefixCache(Protocol):
    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None) -> int | None:
        """Cached tokens for this prompt, or None when the sequence cannot start now (no free slot, or the
        slot it names is busy). ``slot``: the slot the request names (llama.cpp ``id_slot``); other caches
        ignore it."""

    def computed(self, seq_id: int, tokens: list[int]) -> None:
        """The prompt has been prefilled: its prefix becomes reusable."""

    def release(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence ended (finished or aborted); ``tokens`` are the prompt plus what was generated."""

    def flush(self) -> None: ...

    def cached_tokens(self) -> int: ...


class BlockCache:
    """vLLM's block pool as far as prefix caching goes. A request's blocks are touched and released tail first,
    as vLLM frees a finished request's blocks in reverse order, so a chain's tail is evicted before its head."""

    def __init__(self, block_size: int, capacity_tokens: int, events: CacheEvents | None = None) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.events = events

    def _hashes(self, tokens: list[int]) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        parent = 0
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash((parent, tuple(tokens[start : start + bs])))
            out.append(parent)
        return out

    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None) -> int | None:
        hits = 0
        for h in self._hashes(tokens[:-1]):
            if h not in self._blocks:
                break
            hits += 1
        hashes = self._hashes(tokens[:-1])[:hits]
        for h in reversed(hashes):
            self._blocks.move_to_end(h)
        return hits * self.block_size

    def computed(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def release(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def _insert(self, tokens: list[int]) -> None:
        hashes = self._hashes(tokens)
        blocks = self._blocks
        new = [i for i, h in enumerate(hashes) if h not in blocks]
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        if self.events is not None and new:
            self._report_stored(tokens, hashes, new)
        evicted = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        if self.events is not None and evicted:
            self.events.removed(evicted)

    def _report_stored(self, tokens: list[int], hashes: list[int], new: list[int]) -> None:
        """One BlockStored per run of consecutive new blocks, its parent the block before the run."""
        assert self.events is not None
        bs = self.block_size
        start = new[0]
        for k, i in enumerate(new):
            last = k + 1 == len(new) or new[k + 1] != i + 1
            if last:
                self.events.stored(hashes[start : i + 1], hashes[start - 1] if start else None,
                                   tokens[start * bs : (i + 1) * bs], bs)
                if k + 1 < len(new):
                    start = new[k + 1]

    def flush(self) -> None:
        self._blocks.clear()
        if self.events is not None:
            self.events.cleared()

    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size


class _Node:
    __slots__ = ("children", "last", "page_hash", "parent", "token")

    def __init__(self, parent: _Node | None, token: int, last: int) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.token = token
        self.last = last
        self.page_hash: int | None = None  # set on the node that completes a page


class RadixCache:
    """SGLang's radix cache: a token trie holding whole pages of ``page_size`` tokens (SGLang's default page is
    one token), reused in whole pages, least recently used leaves evicted first. Each page is hashed in a chain
    over its parent page, for the events: one BlockStored per insert covering its new pages, one BlockRemoved
    per eviction round."""

    def __init__(self, capacity_tokens: int, page_size: int = 1, events: CacheEvents | None = None) -> None:
        self.capacity = capacity_tokens
        self.page_size = max(1, page_size)
        self.events = events
        self._clock = itertools.count(1)
        self._root = _Node(None, -1, 0)
        self._size = 0

    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None) -> int | None:
        now = next(self._clock)
        node = self._root
        n = 0
        for t in tokens[:-1]:
            child = node.children.get(t)
            if child is None:
                break
            child.last = now
            node = child
            n += 1
        return n // self.page_size * self.page_size

    def computed(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def release(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def _insert(self, tokens: list[int]) -> None:
        page = self.page_size
        tokens = tokens[: len(tokens) // page * page]
        now = next(self._clock)
        node = self._root
        parent_hash: int | None = None
        stored_parent: int | None = None
        stored: list[int] = []
        first_stored = 0
        for i, t in enumerate(tokens):
            child = node.children.get(t)
            if child is None:
                child = _Node(node, t, now)
                node.children[t] = child
                self._size += 1
            else:
                child.last = now
            node = child
            if i % page == page - 1:
                if child.page_hash is None:  # a page new to the cache
                    child.page_hash = hash((parent_hash or 0, tuple(tokens[i - page + 1 : i + 1])))
                    if not stored:
                        stored_parent, first_stored = parent_hash, i - page + 1
                    stored.append(child.page_hash)
                parent_hash = child.page_hash
        if self.events is not None and stored:
            self.events.stored(stored, stored_parent, tokens[first_stored : first_stored + len(stored) * page], page)
        if self._size > self.capacity:
            self._evict(self._size - int(self.capacity * 0.9))

    def _evict(self, count: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                heap.append((node.last, id(node), node))
        heapq.heapify(heap)
        removed: list[int] = []
        while count > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.token]
            if leaf.page_hash is not None:
                removed.append(leaf.page_hash)
            self._size -= 1
            count -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))
        if self.events is not None and removed:
            self.events.removed(removed)

    def flush(self) -> None:
        self._root = _Node(None, -1, 0)
        self._size = 0
        if self.events is not None:
            self.events.cleared()

    def cached_tokens(self) -> int:
        return self._size


class SlotCache:
    """llama.cpp slots: ``slot_of`` maps running sequences to slot ids; ``prompts`` is each slot's cached text."""

    def __init__(self, n_slots: int, similarity: float = 0.10) -> None:
        self.prompts: list[list[int]] = [[] for _ in range(n_slots)]
        self.last_used: list[int] = [0] * n_slots
        self.slot_of: dict[int, int] = {}
        self.similarity = similarity
        self._clock = itertools.count(1)

    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None) -> int | None:
        busy = set(self.slot_of.values())
        if slot is not None and 0 <= slot < len(self.prompts):
            # a named slot (id_slot): that one or none; llama.cpp defers the request while it is busy
            if slot in busy:
                return None
            best, best_lcp = slot, _common_prefix(self.prompts[slot], tokens)
        else:
            idle = [i for i in range(len(self.prompts)) if i not in busy]
            if not idle:
                return None
            best, best_lcp = -1, 0
            for i in idle:
                lcp = _common_prefix(self.prompts[i], tokens)
                if lcp > best_lcp:
                    best, best_lcp = i, lcp
            if best < 0 or best_lcp / max(1, len(tokens)) <= self.similarity:
                best = min(idle, key=lambda i: self.last_used[i])
                best_lcp = _common_prefix(self.prompts[best], tokens)
        self.slot_of[seq_id] = best
        self.last_used[best] = next(self._clock)
        self.prompts[best] = list(tokens)
        return min(best_lcp, len(tokens) - 1)

    def computed(self, seq_id: int, tokens: list[int]) -> None:
        return None

    def release(self, seq_id: int, tokens: list[int]) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self.prompts[slot] = list(tokens)
            self.last_used[slot] = next(self._clock)

    def flush(self) -> None:
        self.prompts = [[] for _ in self.prompts]

    def cached_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
