"""A few slots (validation workers) shared fairly between owners (API keys), by the time each used them.

A free slot goes to the waiting owner that has used the slots least (start-time fair queueing, the time a slot was
held being what an owner is charged): each owner's waiters in their order of arrival, owners that used as much in
turn. An owner that starts waiting is charged from where the others are (the least any owner holding or waiting
has used, or what it had used itself if more), so time it did not ask for is not credit. So a key that queues a
hundred constraints delays another key's one by at most one constraint per slot, not a hundred; a key whose
checks take 2 s each gets a turn for every 2 s the others' checks take together, not one turn in two (sweep 28:
offloaded checks of other keys from 0.23 to 10.9 s behind 2-4 s ones); and each owner may have at most
``per_owner`` waiting, beyond which it is refused at once rather than queued.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_OWNERS = 10_000  # owners whose use is remembered (those at or below the others' are forgotten first)


class OwnerQueueFull(Exception):
    """The owner has ``per_owner`` waiting already."""


class FairSlots:
    def __init__(self, count: int, per_owner: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._free = list(range(count - 1, -1, -1))
        self._per_owner = per_owner
        self._clock = clock
        # owner -> its waiters, oldest first (the owners in the order they began waiting)
        self._waiting: OrderedDict[str, deque[asyncio.Future[int]]] = OrderedDict()
        self._used: dict[str, float] = {}  # owner -> slot seconds charged (on the shared scale below)
        self._virtual = 0.0  # where the owners being served are: the charge of the last one given a slot
        self._holders: dict[int, tuple[str, float]] = {}  # slot -> its owner, and when it was given

    def waiting(self, owner: str) -> int:
        queue = self._waiting.get(owner)
        return len(queue) if queue is not None else 0

    async def acquire(self, owner: str, patience: float) -> int:
        """A slot, for ``owner``: at once when one is free and nobody waits, else in ``owner``'s turn.
        Raises OwnerQueueFull, or TimeoutError after ``patience`` seconds of waiting."""
        if self._free and not self._waiting:
            slot = self._free.pop()
            self._give(slot, owner)
            return slot
        queue = self._waiting.get(owner)
        if queue is None:
            queue = self._waiting[owner] = deque()
            self._used[owner] = max(self._used.get(owner, 0.0), self._virtual)
        elif len(queue) >= self._per_owner:
            raise OwnerQueueFull
        turn: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        try:
            async with asyncio.timeout(patience):
                return await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release(turn.result())  # (given a slot just as it stopped waiting: pass it on)
            else:
                turn.cancel()
                self._forget(owner, turn)
            raise

    def release(self, slot: int) -> None:
        """``slot`` is free again (its holder charged the time it held it): to the waiting owner that has used the
        slots least, else back to the free list."""
        held = self._holders.pop(slot, None)
        if held is not None:
            owner, since = held
            self._used[owner] = max(self._used.get(owner, 0.0), self._virtual) + max(0.0, self._clock() - since)
        while self._waiting:
            owner = min(self._waiting, key=lambda o: self._used.get(o, 0.0))  # (the first of equals: in order)
            queue = self._waiting[owner]
            turn = queue.popleft()
            if not queue:
                del self._waiting[owner]
            if not turn.done():
                turn.set_result(slot)
                self._give(slot, owner)
                return
        self._free.append(slot)

    def _give(self, slot: int, owner: str) -> None:
        self._virtual = max(self._virtual, self._used.get(owner, 0.0))
        self._holders[slot] = (owner, self._clock())
        if len(self._used) > MAX_OWNERS:  # (those at or below the others' would be charged from there anyway)
            active = set(self._waiting) | {o for o, _ in self._holders.values()}
            self._used = {o: u for o, u in self._used.items() if o in active or u > self._virtual}

    def _forget(self, owner: str, turn: asyncio.Future[int]) -> None:
        queue = self._waiting.get(owner)
        if queue is None:
            return
        try:
            queue.remove(turn)
        except ValueError:
            return
        if not queue:
            del self._waiting[owner]
