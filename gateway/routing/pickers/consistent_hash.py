from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Annotated

from annotated_types import Ge, Gt, Le

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

# points per backend on the ring: more spread the keys no better, and each costs a hash when the ring is built
MAX_VNODES = 1024


class ConsistentHashPicker:
    """Bounded-load consistent hashing on the prompt's leading blocks, for several gateway replicas.

    Every replica computes the same key (a stable hash of the first ``key_blocks`` prefix blocks, or of the
    whole prompt when it is shorter) and the same ring (``vnodes`` points per backend name), so the same
    prefix goes to the same backend with no shared store. A backend is skipped while its queue is above
    ``load_factor`` x the mean queue (rounded up, +1), the bound of Mirrokni et al.'s consistent hashing with
    bounded loads: a hot prefix spills to the next backend on the ring, again the same one on every replica.
    Scores are ignored.
    """

    name = "consistent-hash"

    def __init__(self, state: RoutingState, key_blocks: Annotated[int, Ge(1)] = 4,
                 vnodes: Annotated[int, Ge(1), Le(MAX_VNODES)] = 64,
                 load_factor: Annotated[float, Gt(0)] = 1.25) -> None:
        self._key_blocks = key_blocks
        self._clock = state.clock
        self._vnodes = vnodes
        self._load_factor = load_factor
        self._rings: dict[frozenset[str], tuple[list[int], list[str]]] = {}

    def _ring(self, names: frozenset[str]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(names)
        if ring is None:
            points = sorted((_point(f"{name}#{i}".encode()), name) for name in names for i in range(self._vnodes))
            ring = ([p for p, _ in points], [n for _, n in points])
            if len(self._rings) > 64:
                self._rings.clear()
            self._rings[names] = ring
        return ring

    def key(self, request: RouteRequest) -> int:
        blocks = request.blocks
        if blocks:
            return blocks[min(self._key_blocks, len(blocks)) - 1]
        return _point(request.model.encode() + b"\0" + request.prompt)

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        by_name = {b.name: b for b in backends}
        points, owners = self._ring(frozenset(by_name))
        now = self._clock.monotonic()
        queues = {name: b.estimated_queue(now) for name, b in by_name.items()}
        bound = math.ceil(self._load_factor * (sum(queues.values()) + 1) / len(queues))
        start = bisect.bisect(points, self.key(request))
        order: list[str] = []
        for i in range(len(points)):
            name = owners[(start + i) % len(points)]
            if name not in order:
                order.append(name)
                if len(order) == len(by_name):
                    break
        within = [n for n in order if queues[n] < bound]
        ranked = within + [n for n in order if n not in within]
        return [by_name[n] for n in ranked]
