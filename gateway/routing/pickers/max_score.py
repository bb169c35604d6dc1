from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.prompt import BLOCK_BYTES
from gateway.routing.request import POOLING_ROUTES, RouteRequest
from gateway.routing.state import RoutingState

OPENING_BYTES = 1024  # of the rendered prompt: the opening a tie is broken on


def _rendezvous(opening: bytes, name: str) -> float:
    digest = hashlib.blake2b(opening + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class MaxScorePicker:
    """Highest score first; ties go to the backend with fewer of our requests in flight, then by rendezvous
    hashing of the prompt's opening (its first kilobyte) with the backend's name: equal idle backends share a
    burst of different prompts instead of the first one in the list taking it all, a prompt opening goes to
    the same backend each time (where it may be cached), and several gateway replicas break the tie alike.
    A prompt shorter than one prefix block (128 bytes), which no engine caches usefully, or none at all
    (embeddings), breaks it at random. Nothing is hashed when nothing ties."""

    name = "max-score"

    def __init__(self, state: RoutingState, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        keyed = [(-score, backend.in_flight, 0.0, index)
                 for index, (backend, score) in enumerate(zip(backends, scores, strict=True))]
        if len({k[:2] for k in keyed}) < len(keyed):  # a tie somewhere: break it
            prompt = request.prompt[:OPENING_BYTES] if request.route not in POOLING_ROUTES else b""
            cacheable = len(prompt) >= BLOCK_BYTES  # shorter: no cache to aim at, so spread at random
            opening = request.model.encode() + b"\0" + prompt
            keyed = [(s, f, _rendezvous(opening, backends[i].name) if cacheable else self._rng.random(), i)
                     for s, f, _, i in keyed]
        keyed.sort()
        return [backends[item[3]] for item in keyed]
