"""Reloading the configuration file without trusting a file that is being written.

A file rewritten in place (``tee``, ``scp``, ``rsync --inplace``, a templating tool) is empty and then a growing
prefix of itself while it is written, and most prefixes of a YAML file are valid YAML: read at the wrong moment,
it parses as a configuration whose later sections are simply absent. A reload of such a prefix used to apply it:
with ``auth`` near the end, every key was gone and the gateway open to anyone.

Two defences, one for when a reload happens and one for what it may do:

* :func:`stable_contents`: the file watch hands on a changed content only once it has read that same content for
  ``settle`` seconds, and hands on those bytes: the reload parses them and never reads the file again (a
  content checked and then re-read would be a different one);
* :func:`check_reload`: whatever triggered it (the watch, SIGHUP, the admin API), a reload may not take away every
  API key unless the file says ``auth.open: true``, nor every backend by leaving ``backends`` out (a file that
  means it says ``backends: []``). A truncated file can produce neither spelling, since the sections it lost are
  absent, not emptied.

What a cut cannot be told from a change, and so still applies (docs/operating.md#reloading-the-configuration):
a cut inside the ``keys`` list keeps the keys before the cut, a cut inside one key drops the limits after it, a cut
inside ``backends`` removes the later backends, and any section after the cut returns to its defaults.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.config import ConfigError, Settings


def check_reload(running: Settings, new: Settings) -> None:
    """Raise ConfigError when ``new`` would silently take away what ``running`` depends on: every API key without
    ``auth.open: true``, or every backend without a ``backends`` section."""
    if running.auth.keys and not new.auth.keys and not new.auth.open:
        raise ConfigError(
            f"auth.keys: the file has no API keys, and {len(running.auth.keys)} are in use: it may have been "
            "read half-written (or emptied); to serve without keys on purpose, say auth: {open: true}")
    if running.backends and "backends" not in new.model_fields_set:
        raise ConfigError(
            f"backends: the file has no backends section, and {len(running.backends)} backends are configured: it "
            "may have been read half-written; to remove every backend on purpose, say backends: []")


async def stable_contents(read: Callable[[], Awaitable[bytes | None]], every: float, settle: float, *,
                          sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncIterator[bytes]:
    """Read the file every ``every`` seconds (``read``: its bytes, None when it cannot be read) and yield each new
    content once consecutive reads have found it unchanged for at least ``settle`` seconds. The first read is
    the content already in force; a content that goes back to it before settling is no change."""
    steady = max(1, math.ceil(settle / every))  # reads that must agree after the first, each ``every`` apart
    seen = await read()
    candidate: bytes | None = None
    agreed = 0
    while True:
        await sleep(every)
        now = await read()
        if now is None or now == seen:
            candidate, agreed = None, 0
        elif now != candidate:
            candidate, agreed = now, 0
        else:
            agreed += 1
            if agreed >= steady:
                seen, candidate, agreed = now, None, 0
                yield now
