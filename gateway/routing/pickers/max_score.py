from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState

OPENING_BLOCKS = 8  # prompt blocks of 128 bytes: the opening a tie is broken on


def _rendezvous(opening: bytes, name: str) -> float:
    digest = hashlib.blake2b(opening + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class MaxScorePicker:
    """Highest score first; ties go to the backend with fewer of our requests in flight, then by rendezvous
    hashing of the prompt's opening (about its first kilobyte) with the backend's name: equal idle backends
    share a burst of different prompts instead of the first one in the list taking it all, a prompt opening
    goes to the same backend each time (where it may be cached), and several gateway replicas break the tie
    alike. A request without a prompt (embeddings) breaks it at random."""

    name = "max-score"

    def __init__(self, state: RoutingState, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        blocks = request.blocks if request.route != "embeddings" else []
        opening = blocks[min(len(blocks), OPENING_BLOCKS) - 1] if blocks else None
        keyed = [
            (-score, backend.in_flight, _rendezvous(opening, backend.name) if opening else self._rng.random(), index)
            for index, (backend, score) in enumerate(zip(backends, scores, strict=True))
        ]
        keyed.sort()
        return [backends[item[3]] for item in keyed]
