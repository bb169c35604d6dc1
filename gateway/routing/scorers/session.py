from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class SessionTable:
    """Session key -> backend name, least recently used first out, entries idle past ``ttl`` forgotten."""

    def __init__(self, max_entries: int = 100_000, ttl: float = 3600.0) -> None:
        # key -> (backend, last used, last told to the peers)
        self._entries: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self.max_entries = max_entries
        self.ttl = ttl

    def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry[1] > self.ttl:
            del self._entries[key]
            return None
        return entry[0]

    def put(self, key: str, backend: str, *, told: bool = False) -> bool:
        """Stick ``key`` to ``backend``; True when the peers should hear of it (new, moved, or last told over a
        quarter of the TTL ago). ``told``: they know (it came from them)."""
        now = time.monotonic()
        entry = self._entries.get(key)
        tell = not told and (entry is None or entry[0] != backend or now - entry[2] > self.ttl / 4)
        self._entries[key] = (backend, now, now if told or tell else entry[2] if entry else now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return tell


class SessionScorer:
    """Keeps a session (the session header, else the body's ``user``) on the backend it started on, while
    that backend is eligible and not overloaded (more queued sequences than ``overload`` x its slots).

    Learns in its ``routed`` hook: wherever a session's request is sent, the session sticks there. With peers
    (other gateway replicas), a session that is new or moved is published to them (``session``), and theirs
    are applied here, so a session sticks whichever replica its requests reach."""

    name = "session"

    def __init__(self, state: RoutingState, overload: float = 1.5, ttl: float = 3600.0,
                 max_sessions: int = 100_000) -> None:
        self.sessions = SessionTable(max_sessions, ttl)
        self._overload = overload
        self._peers = state.peers
        self._peers.subscribe("session", self._remote)

    def _remote(self, payload: Any) -> None:
        key, backend = payload
        self.sessions.put(str(key), str(backend), told=True)

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        sticky = self.sessions.get(request.session_key) if request.session_key else None
        if sticky is None:
            return [0.0] * len(backends)
        now = time.monotonic()
        return [
            1.0 if b.name == sticky and b.estimated_queue(now) <= self._overload * (b.slots or 1) else 0.0
            for b in backends
        ]

    def routed(self, request: RouteRequest, backend: Backend) -> None:
        if request.session_key and self.sessions.put(request.session_key, backend.name):
            self._peers.publish("session", (request.session_key, backend.name))
