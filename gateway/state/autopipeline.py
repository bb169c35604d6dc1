"""Commands issued in the same event-loop turn, sent to Redis in one pipeline: one write, one read, one
parse loop, for however many requests are being admitted at that moment.

redis-py sends each command on its own (a pooled connection taken and given back, the command packed, a
round trip awaited): ~180 us of CPU per script call on our 2-core machines, against ~47 us each when 16 go in
one pipeline (measured with uvloop, as the gateway runs). A request being admitted only needs its own answer,
so the commands of concurrent requests can share a pipeline without changing what any of them sees: each
script is atomic in Redis, and they run in the order they were issued.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gateway.state.loop_lag import MAX_LAG_FACTOR
from gateway.state.resp import RespConnection, RespError

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("gateway.state")
Late = Callable[[Any], None]  # called with the reply (or the error) of a command whose caller gave up


class _Call:
    """One command on its way: what it is, who waits for it, and how far it got."""

    __slots__ = ("command", "future", "late", "sent", "wire")

    def __init__(self, command: tuple[Any, ...], future: asyncio.Future[Any], late: Late | None) -> None:
        self.command, self.future, self.late = command, future, late
        self.sent: float | None = None  # loop.time() when it was written to Redis
        self.wire: asyncio.Future[Any] | None = None  # its reply as read (done: Redis answered; see resp.py)


class _Expiry:
    """A command's timeout, measured on Redis (see AutoPipeline): when it is due, it looks at the command once
    the loop has read what arrived (three looks, a loop turn apart: uvloop runs timers before it polls, asyncio
    runs what was ready before what its poll found, and a long hold may sit between) and cancels the waiting
    task only if Redis has not answered ``within`` after the command was written; else it waits on. No task or
    future of its own: admissions are the hot path."""

    __slots__ = ("cancelling", "entry", "expired", "handle", "looks", "loop", "started", "task", "within")

    def __init__(self, entry: _Call, within: float) -> None:
        self.entry, self.within = entry, within
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.cancelling = task.cancelling()  # (as asyncio.timeout: a cancellation from elsewhere stays one)
        self.expired = False
        self.looks = 0
        self.started = self.loop.time()
        self.handle: asyncio.Handle = self.loop.call_at(self.started + within, self._due)

    def _due(self) -> None:
        self.looks = 0
        self.handle = self.loop.call_soon(self._look)

    def _look(self) -> None:
        entry, now = self.entry, self.loop.time()
        if entry.future.done() or (entry.wire is not None and entry.wire.done()):
            return  # (answered: the reply reaches the task once the loop gets to it)
        if now - self.started < MAX_LAG_FACTOR * self.within:
            if entry.sent is None:  # (not written yet: the loop's doing, not Redis's)
                self.handle = self.loop.call_at(now + self.within, self._due)
                return
            if entry.sent + self.within > now:  # (written late: Redis gets its whole timeout)
                self.handle = self.loop.call_at(entry.sent + self.within, self._due)
                return
            if self.looks < 2:  # (two more turns, for what a poll may still bring)
                self.looks += 1
                self.handle = self.loop.call_soon(self._look)
                return
        self.expired = True
        self.task.cancel()


class AutoPipeline:
    """``await call(*command)``: the command's reply (or its error), sent with whatever else was called in the
    same loop turn. ``errors``: what a broken connection or a timeout raises (given to every waiter).

    ``await run(*command, late=undo, within=timeout)``: should the caller give up before its reply reaches it (its
    wait timed out, or its task was cancelled), ``undo(reply)`` gets the reply (or the error): a command Redis ran
    anyway may have taken what no one will give back otherwise. That includes a reply that came in the very loop
    turn its caller gave up: the reply is on the future, but the caller's task is woken with its cancellation
    instead (under a loaded event loop, ~10% of timed-out admissions; each leaked a key's ``max_in_flight``
    place for good).

    The timeout measures Redis, not this process: a command not yet written when it expires (the event loop
    was busy) gets it again from when it was written, and one whose reply has been read is waited for; only a
    command Redis has not answered ``timeout`` after it was written times out, or one the loop could not even
    write within ``MAX_LAG_FACTOR`` timeouts. Measured on the whole wait, one large body decoded (~0.3 s) or a
    fast stream relayed made other keys' admissions time out and fail (503 ``limits_unavailable``, sweep 13)."""

    def __init__(self, client: redis.asyncio.Redis, spawn: Callable[[Any], None],
                 fast: RespConnection | None = None) -> None:
        self._client = client
        self._fast = fast  # the batch goes on this connection when given (see resp.py), else on redis-py's
        self._spawn = spawn
        self._queue: list[_Call] = []
        self._scheduled = False

    def call(self, *command: Any, late: Late | None = None) -> asyncio.Future[Any]:
        return self._enqueue(command, late).future

    def _enqueue(self, command: tuple[Any, ...], late: Late | None) -> _Call:
        loop = asyncio.get_running_loop()
        entry = _Call(command, loop.create_future(), late)
        self._queue.append(entry)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return entry

    async def run(self, *command: Any, late: Late | None = None, within: float | None = None) -> Any:
        """The command's reply (see the class's docstring for ``late``, and ``within``: its timeout); TimeoutError."""
        entry = self._enqueue(command, late)
        future = entry.future
        expiry = _Expiry(entry, within) if within is not None else None
        try:
            return await future
        except asyncio.CancelledError:
            if not future.done():
                future.cancel()  # (_send gives its reply to ``late`` when it comes)
            elif late is not None and not future.cancelled():
                # (answered as its caller gave up: _send saw a caller still waiting, and left the reply here)
                error = future.exception()
                _undo(late, error if error is not None else future.result())
            if expiry is not None and expiry.expired and expiry.task.uncancel() <= expiry.cancelling:
                raise TimeoutError from None
            raise
        finally:
            if expiry is not None:
                expiry.handle.cancel()

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._queue = self._queue, []
        self._spawn(self._send(batch))

    async def _send(self, batch: list[_Call]) -> None:
        try:
            if self._fast is not None:
                await self._fast.connected()
                now = asyncio.get_running_loop().time()
                wires = self._fast.send([entry.command for entry in batch])
                for entry, wire in zip(batch, wires, strict=True):
                    entry.sent, entry.wire = now, wire
                replies = [_redis_error(r) if isinstance(r, RespError) else r
                           for r in await asyncio.gather(*wires, return_exceptions=True)]
            else:
                now = asyncio.get_running_loop().time()
                pipe = self._client.pipeline(transaction=False)
                for entry in batch:
                    entry.sent = now
                    pipe.execute_command(*entry.command)
                replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:  # (a broken connection: every command of the batch failed with it)
            error = exc if isinstance(exc, Exception) else ConnectionError(str(exc))
            for entry in batch:
                if not entry.future.done():
                    entry.future.set_exception(error)
                elif entry.late is not None and entry.future.cancelled():
                    _undo(entry.late, error)
            if not isinstance(exc, Exception):
                raise
            return
        for entry, reply in zip(batch, replies, strict=True):
            future, late = entry.future, entry.late
            if future.done():  # (its caller gave up: timed out, or left)
                if late is not None and future.cancelled():
                    _undo(late, reply)
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)


def _undo(late: Late, reply: Any) -> None:
    try:
        late(reply)
    except Exception:  # (one command's undoing must not leave the batch's other callers waiting)
        log.exception("undoing a command whose caller gave up failed")


def _redis_error(error: RespError) -> Exception:
    """The error redis-py would have raised for that reply (the callers catch redis-py's)."""
    from redis.exceptions import NoScriptError, ResponseError

    return NoScriptError(str(error)) if error.no_script else ResponseError(str(error))
