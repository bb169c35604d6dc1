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
  of these: what it lost is absent, not emptied. A key that comes back (by name or by key hash) after an
  earlier change removed it counts as kept, with the restrictions it last had (:class:`KnownKeys`): a file cut
  before the key and then read again cut right after its ``key_sha256`` line removed the key and re-added it
  with no limit. A running admin listener on a non-loopback address (``server.admin_host``) keeps an ``admin``
  key.

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
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

from gateway.config import ADMIN_ON_NETWORK, ApiKeySettings, ConfigError, Settings

# a key's fields that restrict it or set its share: left out of a kept key's entry, each would fall back to its
# default (the widest, for most)
RESTRICTIONS = ("models", "scopes", "requests_per_minute", "tokens_per_minute", "max_in_flight", "priority",
                "max_priority", "weight")
# what, beside a key's own fields, bounds every key (its budget, its priority, what one request may ask, how many
# may wait): left out, each would return to its default, the widest for most (``None``: every field of the section)
SHARED_RESTRICTIONS: dict[str, tuple[str, ...] | None] = {"auth": ("reserve_tokens",), "admission": None,
                                                          "limits": None}


REMEMBERED_KEYS = 10_000  # removed keys whose last settings are kept (the oldest forgotten first)


class KnownKeys:
    """Every API key that has been in force in this process, by name and by key hash, with the settings it last
    had: those in force now and the last ``removed`` taken away."""

    def __init__(self, keys: Iterable[ApiKeySettings] = (), removed: int = REMEMBERED_KEYS) -> None:
        self._removed = removed
        # by name: the settings last in force and the key's hash, the longest gone first
        self._last: OrderedDict[str, tuple[ApiKeySettings, str]] = OrderedDict()
        self._names: dict[str, str] = {}  # key hash -> the name it was last in force under
        self.saw(keys)

    def saw(self, keys: Iterable[ApiKeySettings]) -> None:
        """``keys`` are in force now (after each change applied)."""
        now = 0
        for key in keys:
            digest = key.digest()
            earlier = self._last.pop(key.name, None)
            if earlier is not None and self._names.get(earlier[1]) == key.name:
                del self._names[earlier[1]]
            self._last[key.name] = (key, digest)
            self._names[digest] = key.name
            now += 1
        while len(self._last) > now + self._removed:
            name, (_, digest) = self._last.popitem(last=False)
            if self._names.get(digest) == name:
                del self._names[digest]

    def history(self) -> tuple[ApiKeySettings, ...]:
        """Every key remembered, oldest first, with the settings it last had (see ``InForce.known``)."""
        return tuple(key for key, _ in self._last.values())

    def last(self, key: ApiKeySettings) -> ApiKeySettings | None:
        """The settings ``key`` (its name, else its hash) last had in force, or None for a key never seen."""
        seen = self._last.get(key.name)
        if seen is None:
            name = self._names.get(key.digest())
            seen = self._last.get(name) if name is not None else None
        return None if seen is None else seen[0]


def check_reload(running: Settings, new: Settings, known: KnownKeys | None = None) -> None:
    """Raise ConfigError when ``new`` would widen access, or drop every backend, by what it leaves out rather
    than by what it says (see the module's docstring); ``known``: the keys in force before, a key that comes back
    held to what it last had."""
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
        back = ""
        if before is None and known is not None:
            before = known.last(key)
            back = f" (as it had when '{before.name}' was in force before)" if before is not None else ""
        if before is None:
            continue
        for field in RESTRICTIONS:
            if field not in key.model_fields_set and getattr(key, field) != getattr(before, field):
                raise ConfigError(
                    f"auth.keys ({key.name}).{field}: left out of the file, which would change it from "
                    f"{getattr(before, field)!r}{back} to the default {getattr(key, field)!r}: it may have been "
                    f"read half-written; to change it, write it ({field}: null lifts a limit)")
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
