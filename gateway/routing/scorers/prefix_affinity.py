from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from annotated_types import Ge, Le

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState

Credit = Annotated[float, Ge(0), Le(1)]  # a share of a score (the credit for a prefix cached behind a queue)


class PrefixAffinityScorer:
    """Prefers the backend whose prefix cache probably holds the longest part of this prompt.

    Score = the fraction of the prompt's blocks the backend's index holds (see ``prefix_index``). A load
    gate keeps a hot prefix from piling onto one backend: a backend whose queue exceeds the least loaded
    candidate's by more than ``gate_abs`` sequences *and* by more than ``gate_rel`` times gets no affinity
    credit, so load-aware scorers decide instead (the prefix then spreads to a second backend's cache); so does
    a backend whose every slot is taken while another candidate has a free one: there the request would wait
    for a slot, and a few-slot engine's queue is the tail latency a cache hit does not win back. The exception
    is an engine that caches by slot and takes the slot in the request (llama.cpp): a request may wait for the
    busy slot that holds its prefix (two waiters at most), for ``wait_credit`` of the credit of an idle one,
    instead of evicting another prefix from another slot. A request that misses everywhere gets
    ``empty_credit`` where it would take an empty slot, so prefixes fill the slots before they evict each other.
    """

    name = "prefix"

    def __init__(self, state: RoutingState, gate_abs: Annotated[int, Ge(0)] = 12,
                 gate_rel: Annotated[float, Ge(0)] = 3.0, wait_credit: Credit = 0.5,
                 empty_credit: Credit = 0.1) -> None:
        self._prefix = state.prefix  # attaches the shared prefix learner
        self._clock = state.clock
        self._gate_abs = gate_abs
        self._gate_rel = gate_rel
        self._wait_credit = wait_credit
        self._empty_credit = empty_credit

    def gated(self, backends: Sequence[Backend], now: float) -> tuple[list[bool], list[bool]]:
        """Per backend: whether its queue is too long for affinity credit, and whether every slot of it is
        taken while another candidate has a free one (the slot-pinning exception is the caller's)."""
        queues = [b.estimated_queue(now) for b in backends]
        lightest = min(queues)
        full = [b.slots is not None and q >= b.slots for b, q in zip(backends, queues, strict=True)]
        room_elsewhere = not all(full)
        long_queue = [q - lightest > self._gate_abs and q > self._gate_rel * max(lightest, 1) for q in queues]
        return long_queue, [f and room_elsewhere for f in full]

    def score(self, request: RouteRequest, backends: Sequence[Backend],
              gate: tuple[list[bool], list[bool]] | None = None) -> list[float]:
        """``gate``: :meth:`gated` for these backends, when the caller has it already."""
        blocks = request.blocks
        if not blocks:
            return [0.0] * len(backends)
        long_queue, no_room = gate if gate is not None else self.gated(backends, self._clock.monotonic())
        prefix = self._prefix
        scores = []
        for backend, too_long, full in zip(backends, long_queue, no_room, strict=True):
            cached, waits, empty = prefix.lookup(backend, blocks)
            if too_long or (full and not waits):
                scores.append(0.0)
            elif cached:
                scores.append(cached / len(blocks) * (self._wait_credit if waits else 1.0))
            else:  # a miss: better into an empty slot than over another prefix
                scores.append(self._empty_credit if empty else 0.0)
        return scores
