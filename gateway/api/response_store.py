"""The conversations behind ``previous_response_id``: recent ``/v1/responses`` answers, each kept under its id
for the API key that made it.

* **What is held is what is counted.** A conversation is kept as its JSON (decoded again when a continuation
  fetches it) and counted as that JSON, its id and :data:`ENTRY_OVERHEAD`, what holding an entry costs beyond
  them (its record, its places in the orders; measured in ``tests/api/test_response_store.py``). So
  ``max_bytes`` bounds the memory the store holds whatever the conversations' shape: kept as parsed messages,
  a 28-byte empty message took ~200 bytes, and a store filled with small messages held 8 to 20 times its bound.
* **Bounded in all and per API key.** A key past its own bound (``entries_per_key``, ``bytes_per_key``) loses
  its own oldest responses, never another key's; past the store's bound the oldest of all go. With auth off
  every response is one owner's (""), bounded by the store's bounds alone. Every entry expires ``ttl_seconds``
  after it was put; a conversation larger than a bound on its own is not kept.
* **Bound to its key.** Another key asking for a response is told exactly what an unknown id is told (None,
  which the API answers 404 ``previous_response_not_found``): it learns nothing of the response, not even that
  it exists.

With shared state every response is also kept in Redis (:mod:`gateway.state.stored_responses`), under the same
bounds for the whole fleet and bound to the key as well, so a continuation on another replica finds it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import orjson

from gateway.clock import SYSTEM, Clock
from gateway.config import ResponsesSettings
from gateway.errors import GatewayError
from gateway.state.errors import StateUnavailable
from gateway.state.stored_responses import StoreBounds

ENTRY_OVERHEAD = 1024  # bytes counted per entry besides its JSON and its id (measured, CPython 3.11: ~570, ~900
# when every entry is another key's; what tables cost varies with their fill)


class SharedResponses(Protocol):
    """Where several replicas keep their responses (``gateway.state.stored_responses.StoredResponses``)."""

    async def get_response(self, owner: str, response_id: str) -> bytes | None: ...

    def put_response(self, owner: str, response_id: str, raw: bytes, bounds: StoreBounds) -> None: ...


class _Entry:
    __slots__ = ("expires", "raw", "size")

    def __init__(self, expires: float, raw: bytes, size: int) -> None:
        self.expires = expires
        self.raw = raw
        self.size = size


class _Owner:
    """One owner's responses, oldest first, and the bytes they are counted."""

    __slots__ = ("held", "ids")

    def __init__(self) -> None:
        self.held = 0
        self.ids: OrderedDict[str, None] = OrderedDict()


class ResponseStore:
    """Recent responses, for ``previous_response_id``: per owner (an API key's name, "" with auth off) and
    response id, the whole conversation as chat messages (history + input + output). See the module docstring
    for what is counted and how the bounds apply."""

    def __init__(self, bounds: StoreBounds | None = None, *, clock: Clock = SYSTEM,
                 shared: SharedResponses | None = None) -> None:
        self._bounds = bounds if bounds is not None else StoreBounds()
        self._shared = shared  # with shared state: every response is also kept there, for every replica
        self._clock = clock
        self._held = 0
        # insertion order is expiry order: every entry lives equally long
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._owners: dict[str, _Owner] = {}

    @classmethod
    def of(cls, settings: ResponsesSettings, shared: SharedResponses | None = None,
           clock: Clock = SYSTEM) -> ResponseStore:
        return cls(StoreBounds.of(settings), shared=shared, clock=clock)

    @property
    def held(self) -> int:
        """The bytes the entries are counted (their JSON, ids and :data:`ENTRY_OVERHEAD` each)."""
        return self._held

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key)
        self._held -= entry.size
        owner = self._owners[key[0]]
        del owner.ids[key[1]]
        owner.held -= entry.size
        if not owner.ids:
            del self._owners[key[0]]

    def _expire(self) -> None:
        now = self._clock.monotonic()
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].expires > now:
                break
            self._drop(oldest)

    def put(self, owner: str, response_id: str, messages: list[dict[str, Any]]) -> None:
        """Keep ``owner``'s conversation under ``response_id`` (replacing what that owner kept there)."""
        bounds = self._bounds
        if not bounds.entries:
            return
        # a copy of exactly its length: orjson's bytes keep its whole write buffer (measured: 4 KiB held for `[]`,
        # 64 KiB for 5 KB of JSON)
        raw = bytes(memoryview(orjson.dumps(messages)))
        size = len(raw) + len(response_id) + ENTRY_OVERHEAD
        key = (owner, response_id)
        if key in self._entries:
            self._drop(key)
        self._expire()
        max_entries, max_bytes = bounds.of_owner(owner)
        if size > max_bytes:
            return
        while (mine := self._owners.get(owner)) is not None and (len(mine.ids) >= max_entries
                                                                 or mine.held + size > max_bytes):
            self._drop((owner, next(iter(mine.ids))))  # the owner's own oldest first
        while self._entries and (len(self._entries) >= bounds.entries or self._held + size > bounds.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[key] = _Entry(self._clock.monotonic() + bounds.ttl_seconds, raw, size)
        mine = self._owners.get(owner)
        if mine is None:
            mine = self._owners[owner] = _Owner()
        mine.ids[response_id] = None
        mine.held += size
        self._held += size
        if self._shared is not None:
            self._shared.put_response(owner, response_id, raw, bounds)

    def get(self, owner: str, response_id: str) -> list[dict[str, Any]] | None:
        """``owner``'s conversation up to and including that response; None when unknown, expired or
        another owner's (the same None: no oracle)."""
        self._expire()
        entry = self._entries.get((owner, response_id))
        return decode_conversation(entry.raw) if entry is not None else None

    def held_bytes(self, owner: str, response_id: str) -> int:
        """The size of ``owner``'s conversation under ``response_id`` as this process holds it (its JSON); 0 when
        it holds none (unknown, expired, another owner's, or only in the shared store)."""
        entry = self._entries.get((owner, response_id))
        return len(entry.raw) if entry is not None and entry.expires > self._clock.monotonic() else 0

    async def fetch(self, owner: str, response_id: str) -> list[dict[str, Any]] | None:
        """``get``, and where this process does not hold it, the shared store (another replica's response).
        Raises a 503 GatewayError when the shared store cannot answer."""
        raw = await self.fetch_raw(owner, response_id)
        return decode_conversation(raw) if raw is not None else None

    async def fetch_raw(self, owner: str, response_id: str) -> bytes | None:
        """:meth:`fetch`'s conversation as its JSON, before it is decoded (a caller may first check its size)."""
        self._expire()
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            return entry.raw
        if self._shared is None:
            return None
        try:
            return await self._shared.get_response(owner, response_id)
        except StateUnavailable as exc:
            raise GatewayError(503, "stored responses cannot be read now (the gateway's shared state does not "
                                    "answer); retry shortly", code="state_unavailable",
                               headers={"retry-after": "1"}) from exc

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)


def decode_conversation(raw: bytes) -> list[dict[str, Any]] | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None
