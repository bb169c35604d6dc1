"""The cyclic garbage collector's settings for a process that serves (or measures) streams: fewer and shorter
pauses of the event loop.

CPython's cyclic collector stops the whole process while it runs, and a full (generation 2) collection walks
every tracked object the process holds. With the defaults (700, 10, 10) a gateway under load collects
generation 0 about once a request, so the objects of every request in flight or waiting in the admission queue
are promoted to the older generations, which fill and are collected in full again and again. In
`gateway bench fairness` (20 s scenarios, 2-core machine, timed by a ``gc.callbacks`` probe) the gateway made 5
full collections of up to 180 ms each (1.4 s of collections in all), and the load generator itself up to
119 ms: a light key's request that met one got its first token 200-370 ms late, and its TTFT p99 was 2.05x its
own beside a flood (60 s run; target 1.5x).

:func:`quiet` does what long-running Python servers do about it:

* ``gc.freeze()`` once startup is done: what startup made (modules, settings, compiled schemas, clients) goes to
  a permanent generation that no collection walks again;
* generation 0 collected every ``GEN0`` allocations instead of 700, so most of a request's objects are freed by
  their reference counts before a collection could promote them, and far fewer reach generation 2.

With it (and without the per-request reference cycles the same probe found: see ``BodyWriter`` and
``Dispatcher._wait_slice``), the same run: 2 full collections of at most 56 ms, 0.44 s of collections in all,
generation-0 collections of 27 ms at the 99th percentile (more objects each: 10,000 was the better of 700 and
50,000, whose young collections took up to 133 ms); the load generator's longest, 44 ms. Nothing is left
uncollected: cycles are still found, in fewer, larger batches.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

GEN0 = 10_000  # allocations (less deallocations) between generation-0 collections; CPython's default is 700
GEN1 = 20  # generation-0 collections between generation-1 collections (default 10)
GEN2 = 10  # generation-1 collections between full ones, when enough has been promoted since (default 10)


def quiet() -> None:
    """Collect what startup left, freeze the survivors and raise the thresholds (see the module docstring).
    Call it once the process has built what it keeps for its life, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0, GEN1, GEN2)


@contextlib.contextmanager
def quieted() -> Iterator[None]:
    """:func:`quiet` for a command that may run inside another process (the benchmarks are run in-process by
    the test suite): the collector's thresholds and the frozen heap are given back on exit."""
    threshold = gc.get_threshold()
    quiet()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
