"""ZeroMQ contexts that garbage collection cannot hang on.

A context that becomes garbage together with one of its sockets (a reference cycle: the socket holds its
context, something in the cycle holds the socket) hangs the thread that collects it, for good: the collector
clears the context's weak set of sockets before finalizers run, so pyzmq's ``Context.__del__`` closes nothing
and calls ``zmq_ctx_term``, which waits for every socket to be closed, and the socket's own finalizer is queued
behind it on the same thread. ``LINGER 0`` does not help (term waits for sockets to be *closed*). Seen: a CI
run hung for an hour in a thread that collected an earlier test's context.

So every context the gateway and its emulators open is held here until :func:`close_context` ends it: a
context is never garbage, a socket nobody closed is collected on its own (its finalizer closes it), and the
worst a forgotten context costs is its two threads.
"""

from __future__ import annotations

import threading
from typing import TypeVar

import zmq

C = TypeVar("C", bound=zmq.Context)  # type: ignore[type-arg]

_held: set[zmq.Context] = set()  # type: ignore[type-arg]
_lock = threading.Lock()


def open_context(kind: type[C]) -> C:
    """A new context of ``kind`` (``zmq.Context`` or ``zmq.asyncio.Context``) whose sockets close at once."""
    ctx = kind()
    ctx.setsockopt(zmq.LINGER, 0)
    with _lock:
        _held.add(ctx)
    return ctx


def close_context(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    """Close every socket of ``ctx`` still open (call from the thread that used them, once they are idle) and
    end it; then it may be collected."""
    ctx.destroy(linger=0)
    with _lock:
        _held.discard(ctx)


def held() -> int:
    """Contexts opened and not yet closed (tests check that a component closes what it opens)."""
    with _lock:
        return len(_held)
