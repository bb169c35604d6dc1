from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any

from annotated_types import Ge, Gt

from gateway.clock import SYSTEM, Clock
from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import NoPeers, RoutingState


class SessionTable:
    """Session key -> backend name, least recently used first out, entries idle past ``ttl`` forgotten.

    Each entry carries a ``version`` (1 when the session is placed, one more each time it moves) and when it
    was placed (``born``, wall-clock time). Replicas that placed one session apart, before hearing of each
    other, agree by one rule applied alike everywhere: the higher version wins, then the earlier placement
    (then the backend's name), so crossed messages cannot leave them swapping the session back and forth."""

    def __init__(self, max_entries: int = 100_000, ttl: float = 3600.0, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        # key -> (backend, last used, last told to the peers, version, born)
        self._entries: OrderedDict[str, tuple[str, float, float, int, float]] = OrderedDict()
        self.max_entries = max_entries
        self.ttl = ttl

    def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.clock.monotonic() - entry[1] > self.ttl:
            del self._entries[key]
            return None
        return entry[0]

    def stamp(self, key: str) -> tuple[int, float] | None:
        """The entry's (version, born), for what is told to the peers."""
        entry = self._entries.get(key)
        return None if entry is None else (entry[3], entry[4])

    def put(self, key: str, backend: str) -> bool:
        """Stick ``key`` to ``backend`` (where this replica sent it); True when the peers should hear of it
        (new, moved, or last told over a quarter of the TTL ago)."""
        now = self.clock.monotonic()
        entry = self._entries.get(key)
        if entry is None or now - entry[1] > self.ttl:
            version, born, told = 1, self.clock.time(), -math.inf
        elif entry[0] != backend:
            version, born, told = entry[3] + 1, self.clock.time(), -math.inf
        else:
            version, born, told = entry[3], entry[4], entry[2]
        tell = now - told > self.ttl / 4
        self._store(key, (backend, now, now if tell else told, version, born))
        return tell

    def merge(self, key: str, backend: str, version: int, born: float) -> None:
        """A peer's placement of ``key``: taken unless this one's wins (see the class)."""
        now = self.clock.monotonic()
        entry = self._entries.get(key)
        if (entry is not None and now - entry[1] <= self.ttl
                and (entry[3], -entry[4], entry[0]) >= (version, -born, backend)):
            if entry[0] == backend:
                self._store(key, (backend, now, now, entry[3], entry[4]))  # (they know)
            return
        self._store(key, (backend, now, now, version, born))

    def _store(self, key: str, entry: tuple[str, float, float, int, float]) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class SessionScorer:
    """Keeps a session (the session header, else the body's ``user``) on the backend it started on, while
    that backend is eligible and not overloaded (more queued sequences than ``overload`` x its slots).

    Learns in its ``routed`` hook: wherever a session's request is sent, the session sticks there. With peers
    (other gateway replicas), a session that is new or moved is published to them (``session``), and theirs
    are applied here, so a session sticks whichever replica its requests reach."""

    name = "session"

    def __init__(self, state: RoutingState, overload: Annotated[float, Gt(0)] = 1.5,
                 ttl: Annotated[float, Gt(0)] = 3600.0, max_sessions: Annotated[int, Ge(1)] = 100_000) -> None:
        self._overload = overload
        self._peers = state.peers
        self._replicated = not isinstance(state.peers, NoPeers)
        kept = state.kept.get(self.name)
        if isinstance(kept, SessionTable):  # (a reload rebuilt the pipeline: sessions stay where they were)
            self.sessions = kept
            self.sessions.max_entries, self.sessions.ttl = max_sessions, ttl
        else:
            self.sessions = state.kept[self.name] = SessionTable(max_sessions, ttl, state.clock)
            table = self.sessions
            self._peers.subscribe("session", lambda payload: _remote(table, payload))

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        key = _key(request)
        if not key:
            return [0.0] * len(backends)
        sticky = self.sessions.get(key)
        now = self.sessions.clock.monotonic()
        if sticky is None:
            if not self._replicated:
                return [0.0] * len(backends)
            # a new session behind several replicas: every replica would place it on the same backend (the
            # highest rendezvous hash of the session among those not overloaded), so turns that reach another
            # replica before it heard of the placement land on the same backend all the same
            ready = [b.name for b in backends if b.estimated_queue(now) <= self._overload * (b.slots or 1)]
            if not ready:
                return [0.0] * len(backends)
            pick = max(ready, key=lambda name: hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest())
            return [1.0 if b.name == pick else 0.0 for b in backends]
        return [
            1.0 if b.name == sticky and b.estimated_queue(now) <= self._overload * (b.slots or 1) else 0.0
            for b in backends
        ]

    def routed(self, request: RouteRequest, backend: Backend) -> None:
        key = _key(request)
        if key and self.sessions.put(key, backend.name):
            stamp = self.sessions.stamp(key)
            assert stamp is not None
            self._peers.publish("session", (key, backend.name, *stamp))


def _key(request: RouteRequest) -> str | None:
    """The request's session within its cache domain: another key's session of the same name is another
    session (else a key could find out where, and that, another key's session runs)."""
    key = request.session_key
    return request.cache_domain.qualify(key) if key else None


def _remote(table: SessionTable, payload: Any) -> None:
    """A peer's session message: (key, backend, version, born)."""
    if len(payload) == 2:  # (from a replica of an earlier release: it always wins)
        key, backend = payload
        version, born = 1 << 30, 0.0
    else:
        key, backend, version, born = payload
    table.merge(str(key), str(backend), int(version), float(born))
