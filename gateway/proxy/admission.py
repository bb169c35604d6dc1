"""Admission control: when every eligible backend is at its ``max_concurrency``, a request waits here for a
slot, up to ``max_wait_seconds``, in a queue of at most ``queue_size`` requests.

Fair across API keys: each key has its own FIFO, and a freed slot goes to the keys in turn, so one key
sending a flood does not starve the others. A slot freed on a backend wakes the next waiter whose model that
backend serves; the waiter then routes again (another request may have been quicker: it waits again, at the
head of its key's queue).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from gateway.config import AdmissionSettings
from gateway.pool.backend import Backend


class QueueFull(Exception):
    pass


class QueueTimeout(Exception):
    pass


@dataclass(eq=False)
class _Waiter:
    model: str
    key: str
    woken: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self._queues: OrderedDict[str, deque[_Waiter]] = OrderedDict()  # key -> its waiters; order = turns
        self.waiting = 0

    async def wait(self, model: str, key: str, deadline: float) -> None:
        """Wait until a slot may be free for ``model`` (then route again), or raise QueueFull/QueueTimeout.
        ``deadline`` is a time.monotonic() value."""
        if self.waiting >= self.settings.queue_size:
            raise QueueFull
        waiter = _Waiter(model, key)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(waiter)
        self.waiting += 1
        try:
            await asyncio.wait_for(asyncio.shield(waiter.woken), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise QueueTimeout from None
        finally:
            self.waiting -= 1
            if not waiter.woken.done():
                waiter.woken.cancel()
            if waiter in queue:
                queue.remove(waiter)
            if not queue and self._queues.get(key) is queue:
                del self._queues[key]

    def released(self, backend: Backend) -> None:
        """A request on ``backend`` finished: wake the next waiter (keys in turn) whose model it serves."""
        if not self.waiting:
            return
        for key in list(self._queues):
            queue = self._queues[key]
            for waiter in queue:
                if waiter.model in backend.models and not waiter.woken.done():
                    queue.remove(waiter)
                    waiter.woken.set_result(None)
                    self._queues.move_to_end(key)  # this key had its turn
                    return
