"""Prefix caches, each in its engine's own unit.

* :class:`BlockCache`: full fixed-size blocks, each hash chained over its parent, LRU eviction. vLLM uses
  16-token blocks; ExLlamaV2/V3 (TabbyAPI) 256-token pages. Only whole blocks are reused.
* :class:`RadixCache`: SGLang's RadixAttention: a radix tree of pages (``page_size`` tokens, SGLang's default
  one), nodes split where prompts diverge, least recently used leaf nodes evicted first.
* :class:`SlotCache`: llama.cpp, one cached prompt per slot; an idle slot is chosen by longest-common-prefix
  similarity (> ``similarity``) else least recently used; it also limits concurrency to the slot count.

All return the number of cached prompt tokens on admission, never the whole prompt (the last token is always
computed, as in the engines). A request's ``salt`` (its ``cache_salt``) partitions the block and radix caches as
the engines do: vLLM mixes it into the first block's hash (so every block of a salted prompt differs from the same
tokens' unsalted or otherwise salted block), SGLang keys a salted prompt's radix nodes by the salt (a subtree of
its own). llama.cpp's slots have no salt: any request reuses any slot's prompt.

A block or radix cache given ``events`` (a :class:`CacheEvents`, in practice a
:class:`~gateway.sim.kv_events.KvEventPublisher`) reports the blocks it stores, evicts and clears, with the
engine's own block hashes: vLLM's unsigned 64-bit (the low 8 bytes of a SHA-256 chain), SGLang's signed 64-bit
(the first 8 bytes of its SHA-256 page chain). Without ``events`` nothing is hashed but what matching needs.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class CacheEvents(Protocol):
    def stored(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int,
               salt: str | None = None) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class PrefixCache(Protocol):
    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None, salt: str | None = None) -> int | None:
        """Cached tokens for this prompt, or None when the sequence cannot start now (no free slot, or the
        slot it names is busy). ``slot``: the slot the request names (llama.cpp ``id_slot``); other caches
        ignore it. ``salt``: the request's cache salt (engines without one ignore it)."""

    def computed(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        """The prompt has been prefilled: its prefix becomes reusable (under ``salt``)."""

    def release(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        """The sequence ended (finished or aborted); ``tokens`` are the prompt plus what was generated."""

    def flush(self) -> None: ...

    def cached_tokens(self) -> int: ...


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as the engines hash them: 4 bytes each, little-endian, unsigned."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:  # ids outside uint32 (only from raw input_ids): wrapped, as a uint32 array would
        return b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in tokens)


class BlockCache:
    """vLLM's block pool as far as prefix caching goes: full blocks, each keyed by a hash chained over its
    parent's, least recently used first out. A request's blocks are touched and released tail first, as vLLM
    frees a finished request's blocks in reverse order, so a chain's tail is evicted before its head (never a
    head before its tail, which would leave blocks no prompt can reach).

    With ``events``: block hashes are vLLM's (``sha256(parent digest + tokens [+ extra keys])``, its low 8 bytes
    as an unsigned int); one BlockStored per run of new blocks (parent: the block before the run), one
    BlockRemoved per evicted block, AllBlocksCleared on flush. A salt is an extra key of the first block only
    (``generate_block_hash_extra_keys``), so it changes every hash of the chain, and is published with that
    block (``extra_keys``)."""

    def __init__(self, block_size: int, capacity_tokens: int, events: CacheEvents | None = None) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.events = events

    def _hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """The hashes of ``tokens``' full blocks, in order (the first one's extra key: ``salt``)."""
        bs = self.block_size
        out: list[int] = []
        if self.events is None:
            parent = hash(("cache_salt", salt)) if salt else 0
            for start in range(0, len(tokens) - bs + 1, bs):
                parent = hash((parent, tuple(tokens[start : start + bs])))
                out.append(parent)
            return out
        digest = b""
        extra = b"\0cache_salt\0" + salt.encode("utf-8", "surrogatepass") if salt else b""
        for start in range(0, len(tokens) - bs + 1, bs):
            digest = hashlib.sha256(digest + _token_bytes(tokens[start : start + bs]) + extra).digest()
            extra = b""
            out.append(int.from_bytes(digest[-8:], "big"))
        return out

    def held(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """How many leading tokens of ``tokens`` the cache holds, in whole blocks (nothing is touched)."""
        n = 0
        for h in self._hashes(tokens, salt):
            if h not in self._blocks:
                break
            n += 1
        return n * self.block_size

    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None, salt: str | None = None) -> int | None:
        blocks = self._blocks
        hits: list[int] = []
        for h in self._hashes(tokens[:-1], salt):
            if h not in blocks:
                break
            hits.append(h)
        for h in reversed(hits):
            blocks.move_to_end(h)
        return len(hits) * self.block_size

    def computed(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        self._insert(tokens, salt)

    def release(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        self._insert(tokens, salt)

    def _insert(self, tokens: list[int], salt: str | None) -> None:
        hashes = self._hashes(tokens, salt)
        blocks = self._blocks
        events = self.events
        new = [i for i, h in enumerate(hashes) if h not in blocks] if events is not None else []
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        if new:
            self._report_stored(tokens, hashes, new, salt)
        while len(blocks) > self.capacity_blocks:
            evicted = blocks.popitem(last=False)[0]
            if events is not None:
                events.removed([evicted])

    def _report_stored(self, tokens: list[int], hashes: list[int], new: list[int], salt: str | None) -> None:
        """One BlockStored per run of consecutive new blocks, its parent the block before the run (the run from the
        first block carries the salt)."""
        assert self.events is not None
        bs = self.block_size
        start = new[0]
        for k, i in enumerate(new):
            if k + 1 < len(new) and new[k + 1] == i + 1:
                continue
            self.events.stored(hashes[start : i + 1], hashes[start - 1] if start else None,
                               tokens[start * bs : (i + 1) * bs], bs, salt if start == 0 else None)
            if k + 1 < len(new):
                start = new[k + 1]

    def flush(self) -> None:
        self._blocks.clear()
        if self.events is not None:
            self.events.cleared()

    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size


class _Node:
    """A radix tree node: ``key`` is a run of whole pages; ``digests`` their SGLang page hashes (events only)."""

    __slots__ = ("children", "digests", "key", "last", "parent")

    def __init__(self, parent: _Node | None, key: list[int], last: int) -> None:
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.key = key
        self.last = last
        self.digests: list[bytes] | None = None


def _int64(digest: bytes) -> int:
    """SGLang's ``hash_str_to_int64``: the digest's first 8 bytes as a signed big-endian int."""
    return int.from_bytes(digest[:8], "big", signed=True)


class RadixCache:
    """SGLang's radix cache: a radix tree of whole pages of ``page_size`` tokens (SGLang's default page is one
    token), reused in whole pages; a node is split where a prompt leaves it (on match and on insert); least
    recently used leaf nodes are evicted first, whole, until enough tokens are free.

    A salted prompt's nodes are keyed by its salt (``RadixKey.child_key``: ``((extra_key, cache_salt), page)``), so
    each salt has a tree of its own under the root: here, a root per salt.

    With ``events``: each page is hashed as SGLang does (``sha256(parent page digest + tokens as uint32 LE)``,
    chained from the root, whose digest is empty, or under a salt ``sha256("sglang-cache-salt-v1\\0" + salt)``;
    the event hash is the digest's first 8 bytes as a signed int64). A new node is one BlockStored of all its pages
    (parent: the last page of its parent node, None under the root; ``cache_salt``: its salt); an evicted node is
    one BlockRemoved of all its pages; flush is AllBlocksCleared."""

    def __init__(self, capacity_tokens: int, page_size: int = 1, events: CacheEvents | None = None) -> None:
        self.capacity = capacity_tokens
        self.page_size = max(1, page_size)
        self.events = events
        self._clock = itertools.count(1)
        self._roots: dict[str | None, _Node] = {}
        self._size = 0

    def _root(self, salt: str | None) -> _Node:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = _Node(None, [], 0)
            if salt is not None:
                root.digests = [hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()]
        return root

    def _child_key(self, tokens: Sequence[int], pos: int) -> object:
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])

    def _match(self, key: list[int], tokens: Sequence[int], pos: int) -> int:
        """How many leading tokens of ``key`` equal ``tokens[pos:]``, in whole pages."""
        n = len(key)
        if tokens[pos : pos + n] == key:
            return n
        page = self.page_size
        limit = min(n, len(tokens) - pos)
        i = 0
        if page == 1:
            while i < limit and key[i] == tokens[pos + i]:
                i += 1
            return i
        while i + page <= limit and key[i : i + page] == tokens[pos + i : pos + i + page]:
            i += page
        return i

    def _aligned(self, tokens: Sequence[int]) -> int:
        return len(tokens) // self.page_size * self.page_size

    def held(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """How many leading tokens of ``tokens`` the cache holds, in whole pages (nothing is touched)."""
        end = self._aligned(tokens)
        tokens = tokens[:end]
        node, pos = self._root(salt), 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = self._match(child.key, tokens, pos)
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None, salt: str | None = None) -> int | None:
        return self._walk(tokens[: self._aligned(tokens[:-1])], next(self._clock), salt)[1]

    def _walk(self, tokens: list[int], now: int, salt: str | None) -> tuple[_Node, int]:
        """Follow ``tokens`` down the salt's tree, touching each node passed and splitting the one left midway; the
        deepest node reached and how many tokens matched."""
        node, pos = self._root(salt), 0
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            child.last = now
            m = self._match(child.key, tokens, pos)
            pos += m
            if m < len(child.key):
                node = self._split(child, m)
                break
            node = child
        return node, pos

    def _split(self, child: _Node, at: int) -> _Node:
        """``child`` becomes ``upper`` (its first ``at`` tokens) -> ``child`` (the rest); returns ``upper``."""
        parent = child.parent
        assert parent is not None
        upper = _Node(parent, child.key[:at], child.last)
        parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        if child.digests is not None:
            pages = at // self.page_size
            upper.digests, child.digests = child.digests[:pages], child.digests[pages:]
        return upper

    def computed(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        self._insert(tokens, salt)

    def release(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        self._insert(tokens, salt)

    def _insert(self, tokens: list[int], salt: str | None) -> None:
        tokens = tokens[: self._aligned(tokens)]
        now = next(self._clock)
        node, pos = self._walk(tokens, now, salt)
        if pos < len(tokens):
            leaf = _Node(node, tokens[pos:], now)
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._size += len(leaf.key)
            if self.events is not None:
                self._report_stored(leaf, salt)
        if self._size > self.capacity:
            self._evict(self._size - int(self.capacity * 0.9))

    def _report_stored(self, leaf: _Node, salt: str | None) -> None:
        assert self.events is not None and leaf.parent is not None
        parent = leaf.parent
        under_root = parent.parent is None
        prior = parent.digests[-1] if parent.digests else b""
        page = self.page_size
        digests = []
        for start in range(0, len(leaf.key), page):
            prior = hashlib.sha256(prior + _token_bytes(leaf.key[start : start + page])).digest()
            digests.append(prior)
        leaf.digests = digests
        self.events.stored([_int64(d) for d in digests],
                           None if under_root or not parent.digests else _int64(parent.digests[-1]), leaf.key, page,
                           salt)

    def _evict(self, count: int) -> None:
        heap: list[tuple[int, int, _Node]] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                heap.append((node.last, id(node), node))
        heapq.heapify(heap)
        evicted = 0
        while evicted < count and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._child_key(leaf.key, 0)]
            evicted += len(leaf.key)
            self._size -= len(leaf.key)
            if self.events is not None and leaf.digests:
                self.events.removed([_int64(d) for d in leaf.digests])
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))

    def flush(self) -> None:
        self._roots.clear()
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

    def admit(self, seq_id: int, tokens: list[int], slot: int | None = None, salt: str | None = None) -> int | None:
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

    def computed(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
        return None

    def release(self, seq_id: int, tokens: list[int], salt: str | None = None) -> None:
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
