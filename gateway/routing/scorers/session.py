from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class SessionScorer:
    """Keeps a session (the session header, else the body's ``user``) on the backend it started on, while
    that backend is eligible and not overloaded (more queued sequences than ``overload`` x its slots)."""

    name = "session"
    uses_prefix = False

    def __init__(self, state: RoutingState, overload: float = 1.5, ttl: float = 3600.0) -> None:
        self._sessions = state.sessions
        self._sessions.ttl = ttl
        self._overload = overload

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        sticky = self._sessions.get(request.session_key) if request.session_key else None
        if sticky is None:
            return [0.0] * len(backends)
        now = time.monotonic()
        return [
            1.0 if b.name == sticky and b.estimated_queue(now) <= self._overload * (b.slots or 1) else 0.0
            for b in backends
        ]
