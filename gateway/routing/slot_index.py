"""What an engine that caches one prompt per slot holds: llama.cpp's ``llama-server`` without its host-RAM
prompt cache (``--cache-ram 0``).

Each slot keeps the last prompt it processed (and its answer) and nothing else. A new request goes to the idle
slot whose cached prompt shares the largest fraction of the new one, if that fraction exceeds
``slot_prompt_similarity`` (0.1 by default), else to the least recently used idle slot; with no idle slot it
waits (``get_available_slot`` in tools/server/server-context.cpp, llama.cpp as vendored by llama-cpp-python
0.3.36). So a prefix is cached where it was last placed, for as long as no other prompt takes that slot, and
only usable while that slot is idle: a second request of the same prefix arriving while the first runs goes to
another slot and evicts what that one held.

The index replays that rule on the gateway's own placements: a slot is busy from the moment a request is
assigned to it until the request finishes (``release``) or, should the gateway never hear of it again,
``busy_ttl`` seconds later. Prompts are chained block hashes (``gateway.routing.prompt``), so the shared prefix
of two prompts is the run of equal leading hashes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from gateway.clock import SYSTEM, Clock
from gateway.routing.prompt import BlockKey

LLAMACPP_SIMILARITY = 0.1  # llama.cpp's default --slot-prompt-similarity


def _shared(a: Sequence[BlockKey], b: Sequence[BlockKey]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request would go on one backend: its slot (None: every slot busy, it waits for any), how many
    of its leading blocks that slot holds, and whether it must wait for that slot to finish another request."""

    slot: int | None
    cached: int
    waits: bool


class SlotIndex:
    """The prompt each slot of one backend holds, and the gateway's requests on each slot.

    With ``pin`` (the engine takes the slot in the request: llama.cpp's ``id_slot``), a request whose prefix
    sits in a busy slot may wait for that slot, at most ``max_waiters`` behind the one it runs, rather than
    take another slot and evict what it holds; the gateway then names the slot in the request, so the engine
    places it as predicted. (On 3 real llama-servers x 2 slots with 3 users, one waiter reached 0.86-0.91 of
    the oracle's hit rate and two reached 0.91-1.00: see docs/routing.md.)
    """

    __slots__ = ("_owners", "_time", "_uses", "busy_ttl", "contents", "epoch", "last_used", "max_waiters", "pin",
                 "similarity", "wait_share")

    def __init__(self, slots: int, epoch: int = 0, *, pin: bool = False, similarity: float = LLAMACPP_SIMILARITY,
                 wait_share: float = 0.5, max_waiters: int = 2, busy_ttl: float = 600.0,
                 clock: Clock = SYSTEM) -> None:
        self.contents: list[Sequence[BlockKey]] = [() for _ in range(slots)]
        self.last_used = [0] * slots
        self.epoch = epoch
        self.pin = pin
        self.similarity = similarity
        self.wait_share = wait_share  # least share of the prompt a busy slot must hold to be worth waiting for
        self.max_waiters = max_waiters  # requests that may queue for one slot behind the one it runs
        self.busy_ttl = busy_ttl
        self._owners: dict[Hashable, tuple[int, float]] = {}  # request -> (slot, since)
        self._uses = 0  # (a count, to order the slots' last uses)
        self._time = clock

    def __len__(self) -> int:
        return len(self.contents)

    def _occupants(self) -> dict[int, int]:
        now = self._time.monotonic()
        stale = [owner for owner, (_, since) in self._owners.items() if now - since > self.busy_ttl]
        for owner in stale:
            del self._owners[owner]
        counts: dict[int, int] = {}
        for slot, _ in self._owners.values():
            counts[slot] = counts.get(slot, 0) + 1
        return counts

    def plan(self, blocks: Sequence[BlockKey]) -> Placement:
        """Where the request would go now: the idle slot llama.cpp would choose (the largest shared share above
        ``similarity``, else the least recently used idle slot); or, with ``pin``, a busy slot holding at least
        ``wait_share`` of the prompt and fewer than ``max_waiters`` waiting for it, when no idle slot holds any
        of it."""
        occupants = self._occupants()
        idle_best = busy_best = None
        idle_share = busy_share = 0.0
        shared = [_shared(cached, blocks) for cached in self.contents]
        for slot, n in enumerate(shared):
            share = n / max(1, len(blocks))
            if share <= self.similarity:
                continue
            held = occupants.get(slot, 0)
            if held == 0 and share > idle_share:
                idle_best, idle_share = slot, share
            elif 0 < held <= self.max_waiters and self.pin and share >= self.wait_share and share > busy_share:
                busy_best, busy_share = slot, share
        if idle_best is not None:
            return Placement(idle_best, shared[idle_best], False)
        if busy_best is not None:
            return Placement(busy_best, shared[busy_best], True)
        oldest = None
        for slot, used in enumerate(self.last_used):  # "<=": the last of equally old slots, as llama.cpp
            if slot not in occupants and (oldest is None or used <= self.last_used[oldest]):
                oldest = slot
        if oldest is None:
            return Placement(None, 0, True)
        return Placement(oldest, shared[oldest], False)

    def match(self, blocks: Sequence[BlockKey]) -> int:
        """Leading blocks of ``blocks`` that would be found cached if the request were sent now."""
        return self.plan(blocks).cached

    def assign(self, blocks: Sequence[BlockKey], owner: Hashable) -> Placement:
        """The request ``owner`` is sent here: the slot it takes now holds its prompt and is busy until
        ``release(owner)``. With every slot busy and nothing to wait for, it waits for whichever slot frees
        first, unknown here: the least recently used stands in."""
        placement = self.plan(blocks)
        slot = placement.slot
        if slot is None:
            slot = min(range(len(self.contents)), key=self.last_used.__getitem__)
            placement = Placement(slot, _shared(self.contents[slot], blocks), True)
        self.contents[slot] = tuple(blocks)
        self._uses += 1
        self.last_used[slot] = self._uses
        self._owners[owner] = (slot, self._time.monotonic())
        return placement

    def release(self, owner: Hashable) -> None:
        self._owners.pop(owner, None)
