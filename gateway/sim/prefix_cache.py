"""Prefix caches, each in its engine's own unit.

* :class:`BlockCache`: full fixed-size blocks, each hash chained over its parent, LRU eviction. vLLM uses
  16-token blocks; ExLlamaV2/V3 (TabbyAPI) 256-token pages. Only whole blocks are reused.
* :class:`RadixCache`: SGLang's RadixAttention, token-granular (one trie node per token), LRU eviction of leaves.
* :class:`SlotCache`: llama.cpp, one cached prompt per slot; an idle slot is chosen by longest-common-prefix
  similarity (> ``similarity``) else least recently used; it also limits concurrency to the slot count.

All return the number of cached prompt tokens on admission, never the whole prompt (the last token is always
computed, as in the engines).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol


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
    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self._blocks: OrderedDict[int, None] = OrderedDict()

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
            self._blocks.move_to_end(h)
            hits += 1
        return hits * self.block_size

    def computed(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def release(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def _insert(self, tokens: list[int]) -> None:
        for h in self._hashes(tokens):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def flush(self) -> None:
        self._blocks.clear()

    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size


class _Node:
    __slots__ = ("children", "last", "parent", "token")

    def __init__(self, parent: _Node | None, token: int, last: int) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.token = token
        self.last = last


class RadixCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
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
        return n

    def computed(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def release(self, seq_id: int, tokens: list[int]) -> None:
        self._insert(tokens)

    def _insert(self, tokens: list[int]) -> None:
        now = next(self._clock)
        node = self._root
        for t in tokens:
            child = node.children.get(t)
            if child is None:
                child = _Node(node, t, now)
                node.children[t] = child
                self._size += 1
            else:
                child.last = now
            node = child
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
        while count > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.token]
            self._size -= 1
            count -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def flush(self) -> None:
        self._root = _Node(None, -1, 0)
        self._size = 0

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
