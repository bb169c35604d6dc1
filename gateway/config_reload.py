"""Reloading the configuration file without trusting a file that is being written.

A file rewritten in place (``tee``, ``scp``, ``rsync --inplace``, a templating tool) is empty and then a growing
prefix of itself while it is written, and most prefixes of a YAML file are valid YAML: read at the wrong moment,
it parses as a configuration whose later sections are simply absent. A reload of such a prefix used to apply it:
with ``auth`` near the end, every key was gone and the gateway open to anyone.

Three defences, one for when a reload happens, one for how a file is read and one for what a reload may do:

* :func:`stable_contents`: the file watch hands on a changed content only once it has read that same content for
  ``settle`` seconds, and hands on those bytes: the reload parses them and never reads the file again (a
  content checked and then re-read would be a different one);
* :func:`gateway.config_file.read_yaml`: a document that ends inside a value (no line break after its last plain
  value) or with a field that has no value (``requests_per_minute:``, which YAML reads as null) is refused: a cut
  can only be taken for a file if it falls at a line's end;
* :func:`check_reload`: whatever triggered it (the watch, SIGHUP, the admin API), a reload may not widen access
  by leaving something out. Every API key taken away needs ``auth.open: true``; every backend taken away needs
  ``backends: []`` (not a missing section); a kept key's restriction in force (``models``, ``scopes``,
  ``requests_per_minute``, ``tokens_per_minute``, ``max_in_flight``, ``priority``, ``max_priority``,
  ``weight``) needs the field written to change it (``requests_per_minute: null`` lifts a limit), and so do
  ``auth.reserve_tokens`` and the ``limits`` and ``admission`` fields in force, which bound every key (its
  budget, priority, queue, what one request may ask); ``auth.protect_health``/``protect_metrics`` need an
  explicit ``false``. A cut file can write none
  of these: what it lost is absent, not emptied. A running admin listener on a non-loopback address
  (``server.admin_host``) keeps an ``admin`` key.

What a cut at a line's end cannot be told from a change, and so still applies
(docs/operating.md#reloading-the-configuration): a cut inside the ``keys`` list revokes the keys after the cut; a
new key cut after its ``key_sha256`` line has the defaults for the fields it lost (every model, no limit, the
``inference`` scope only); a cut inside ``backends`` removes (drains) the later backends or drops a backend's
settings after the cut (its key, ``max_concurrency``); any other section after the cut returns to its defaults
(``routing``, ``timeouts``, ``retries``, the ``models`` aliases); a block list cut short is shorter (fewer
``models``, fewer ``scopes``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.config import ADMIN_ON_NETWORK, ConfigError, Settings

# a key's fields that restrict it or set its share: left out of a kept key's entry, each would fall back to its
# default (the widest, for most)
RESTRICTIONS = ("models", "scopes", "requests_per_minute", "tokens_per_minute", "max_in_flight", "priority",
                "max_priority", "weight")
# what, beside a key's own fields, bounds every key (its budget, its priority, what one request may ask, how many
# may wait): left out, each would return to its default, the widest for most (``None``: every field of the section)
SHARED_RESTRICTIONS: dict[str, tuple[str, ...] | None] = {"auth": ("reserve_tokens",), "admission": None,
                                                          "limits": None}


def check_reload(running: Settings, new: Settings) -> None:
    """Raise ConfigError when ``new`` would widen access, or drop every backend, by what it leaves out rather
    than by what it says (see the module's docstring)."""
    if running.auth.keys and not new.auth.keys and not new.auth.open:
        raise ConfigError(
            f"auth.keys: the file has no API keys, and {len(running.auth.keys)} are in use: it may have been "
            "read half-written (or emptied); to serve without keys on purpose, say auth: {open: true}")
    if running.backends and "backends" not in new.model_fields_set:
        raise ConfigError(
            f"backends: the file has no backends section, and {len(running.backends)} backends are configured: it "
            "may have been read half-written; to remove every backend on purpose, say backends: []")
    if running.server.admin_on_network() and not new.auth.has_admin_key():
        # (the listener runs as started: a restart-only section's new value is not what is listening)
        raise ConfigError(ADMIN_ON_NETWORK.format(host=running.server.admin_host))
    if not new.auth.keys:
        return
    kept = {key.name: key for key in running.auth.keys}
    for key in new.auth.keys:
        before = kept.get(key.name)
        if before is None:
            continue
        for field in RESTRICTIONS:
            if field not in key.model_fields_set and getattr(key, field) != getattr(before, field):
                raise ConfigError(
                    f"auth.keys ({key.name}).{field}: left out of the file, which would change it from "
                    f"{getattr(before, field)!r} to the default {getattr(key, field)!r}: it may have been read "
                    f"half-written; to change it, write it ({field}: null lifts a limit)")
    for flag in ("protect_health", "protect_metrics"):
        if getattr(running.auth, flag) and flag not in new.auth.model_fields_set:
            raise ConfigError(f"auth.{flag}: left out of the file while it is on: it may have been read "
                              f"half-written; to turn it off, say {flag}: false")
    for section, fields in SHARED_RESTRICTIONS.items():
        before, after = getattr(running, section), getattr(new, section)
        for field in fields or type(after).model_fields:
            if field not in after.model_fields_set and getattr(after, field) != getattr(before, field):
                raise ConfigError(f"{section}.{field}: left out of the file, which would set it back to its default "
                                  f"{getattr(after, field)!r} (it bounds every key): it may have been read "
                                  "half-written; to change it, write it")


async def stable_contents(read: Callable[[], Awaitable[bytes | None]], every: float, settle: float, *,
                          in_force: bytes | None = None,
                          sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncIterator[bytes]:
    """Read the file every ``every`` seconds (``read``: its bytes, None when it cannot be read) and yield each new
    content once consecutive reads have found it unchanged for at least ``settle`` seconds. ``in_force``: the
    content the running configuration was read from (None: the first read is taken for it); a content that goes
    back to it before settling is no change."""
    steady = max(1, math.ceil(settle / every))  # reads that must agree after the first, each ``every`` apart
    seen = in_force if in_force is not None else await read()
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
