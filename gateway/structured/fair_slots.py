"""A few slots (validation workers) shared fairly between owners (API keys).

A free slot goes to the owners waiting in turn, round robin: each owner's waiters in their order of arrival,
and an owner that has had a turn goes behind every other owner waiting. So a key that queues a hundred
constraints delays another key's one by at most one constraint per slot, not a hundred; and each owner may
have at most ``per_owner`` waiting, beyond which it is refused at once rather than queued.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque


class OwnerQueueFull(Exception):
    """The owner has ``per_owner`` waiting already."""


class FairSlots:
    def __init__(self, count: int, per_owner: int) -> None:
        self._free = list(range(count - 1, -1, -1))
        self._per_owner = per_owner
        # owner -> its waiters, oldest first; the owners in the order their turns come
        self._waiting: OrderedDict[str, deque[asyncio.Future[int]]] = OrderedDict()

    def waiting(self, owner: str) -> int:
        queue = self._waiting.get(owner)
        return len(queue) if queue is not None else 0

    async def acquire(self, owner: str, patience: float) -> int:
        """A slot, for ``owner``: at once when one is free and nobody waits, else in ``owner``'s turn.
        Raises OwnerQueueFull, or TimeoutError after ``patience`` seconds of waiting."""
        if self._free and not self._waiting:
            return self._free.pop()
        queue = self._waiting.get(owner)
        if queue is None:
            queue = self._waiting[owner] = deque()
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
        """``slot`` is free again: to the owner whose turn it is, else back to the free list."""
        while self._waiting:
            owner, queue = next(iter(self._waiting.items()))
            turn = queue.popleft()
            if queue:
                self._waiting.move_to_end(owner)  # (its next waiter comes after every other owner's)
            else:
                del self._waiting[owner]
            if not turn.done():
                turn.set_result(slot)
                return
        self._free.append(slot)

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
