"""Sealed messages between replicas: what a gateway process publishes on Redis for the others (peer messages:
sessions, prompt blocks, drains, backends added or removed, routing changes, reloads; freed slots; backends
wanted) carries an HMAC keyed with a secret every replica holds and Redis does not. Whoever can PUBLISH to the
gateways' Redis cannot speak for a replica: a message that fails its seal is dropped and counted.

The envelope is ``sender \\0 stamp mac body``: ``stamp`` the sender's clock in microseconds (16 hex digits,
strictly increasing per process), ``mac`` the first 16 bytes of HMAC-SHA256 over the channel, the sender, the
stamp and the body (32 hex digits), so a message can be neither changed nor moved to another channel. Hex, so
that a replica of the version before sealing reads a sealed message as text it ignores (a backend or a batch it
does not know) during a rolling upgrade, rather than failing on bytes that are not UTF-8. A message stamped
more than :data:`WINDOW` seconds from the receiver's clock is dropped (stale); on an ordered channel (the
peers', which a replica publishes one message at a time) one no newer than the last of its sender is dropped
(replayed), and on any channel one sealed before the receiver began to listen (:meth:`Seal.listening`): it
was heard then, or sent while the receiver was not listening, so what arrives now is a copy (replayed). A worker
started again, or a replica that started a moment ago, knew nothing of its senders' last messages, and took a
drain recorded and replayed within the minute for new (sweep 2).

The secret: the environment variable ``state.secret_env`` names, else one derived from what every replica's
configuration holds and Redis does not (:func:`fleet_secret`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.config import StateSettings

WINDOW = 60.0  # seconds a message's stamp may be from the receiver's clock (delivery takes milliseconds)
MAC_BYTES = 16
_HEAD = 16 + 2 * MAC_BYTES  # (the stamp's and the MAC's hex digits)
REASONS = ("unauthenticated", "stale", "replayed", "malformed")  # why a message was dropped


class Rejected(Exception):
    """A message that fails its seal; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Opened:
    sender: str
    body: bytes


class Seal:
    """Seals this process's messages (as ``sender``) and opens the others'. ``clock``: seconds since the epoch
    (the replicas' clocks must agree within :data:`WINDOW`)."""

    def __init__(self, secret: bytes, sender: str, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._sender = sender.encode()
        self._clock = clock
        self._stamp = 0
        self._last: dict[tuple[bytes, bytes], int] = {}  # (channel, sender) -> its newest stamp (ordered channels)
        self._since = int(clock() * 1e6)  # (a message sealed before is a copy: see listening)

    def _mac(self, channel: bytes, sender: bytes, stamp: bytes, body: bytes) -> bytes:
        signed = len(channel).to_bytes(2, "big") + channel + sender + b"\0" + stamp + body
        return hmac.digest(self._secret, signed, "sha256")[:MAC_BYTES].hex().encode()

    def seal(self, channel: bytes, body: bytes) -> bytes:
        self._stamp = max(self._stamp + 1, int(self._clock() * 1e6))
        stamp = b"%016x" % self._stamp
        return self._sender + b"\0" + stamp + self._mac(channel, self._sender, stamp, body) + body

    def listening(self) -> None:
        """This process is about to (re)subscribe: from now on it hears every message sealed for it, so one sealed
        before now that reaches it later is a copy (it heard the original, or the original was sent while it did
        not listen) and is dropped. The replicas' clocks must agree: a sender whose clock runs ahead by a second
        leaves its messages of the second before this process listened open to a replay, one whose clock runs
        behind has its first second's messages dropped (workers of one machine share one clock)."""
        self._since = int(self._clock() * 1e6)

    def open(self, channel: bytes, data: bytes, *, ordered: bool = False) -> Opened:
        """The sender and body of ``data`` received on ``channel``; raises :class:`Rejected`."""
        sender, _, rest = data.partition(b"\0")
        if len(rest) < _HEAD:
            raise Rejected("unauthenticated")
        stamp, mac, body = rest[:16], rest[16:_HEAD], rest[_HEAD:]
        if not hmac.compare_digest(mac, self._mac(channel, sender, stamp, body)):
            raise Rejected("unauthenticated")
        when = int(stamp, 16)  # (hex digits: the MAC held, so this replica's fleet wrote them)
        if abs(when - self._clock() * 1e6) > WINDOW * 1e6:
            raise Rejected("stale")
        if when < self._since:
            raise Rejected("replayed")
        if ordered:
            last = self._last.get((channel, sender))
            if last is not None and when <= last:
                raise Rejected("replayed")
            self._last[(channel, sender)] = when
        return Opened(sender.decode("utf-8", "replace"), body)

    def forget_old(self) -> None:
        """Forget the senders heard from last more than :data:`WINDOW` ago (their messages are stale now)."""
        oldest = (self._clock() - WINDOW) * 1e6
        for which in [w for w, last in self._last.items() if last < oldest]:
            del self._last[which]


def seal_value(secret: bytes, name: str, value: bytes) -> bytes:
    """``value`` as it is kept under the Redis key ``name``: an HMAC of both first (32 hex digits), so whoever can
    write to Redis can neither change a kept value nor move one to another key's name (another owner's)."""
    return _value_mac(secret, name, value) + value


def open_value(secret: bytes, name: str, kept: bytes) -> bytes | None:
    """The value :func:`seal_value` kept under ``name``, or None when its seal does not hold."""
    mac, value = kept[:2 * MAC_BYTES], kept[2 * MAC_BYTES:]
    return value if hmac.compare_digest(mac, _value_mac(secret, name, value)) else None


def _value_mac(secret: bytes, name: str, value: bytes) -> bytes:
    key = name.encode()
    signed = b"value\0" + len(key).to_bytes(4, "big") + key + value
    return hmac.digest(secret, signed, "sha256")[:MAC_BYTES].hex().encode()


def fleet_secret(settings: StateSettings, key_digests: Iterable[str] = ()) -> bytes | None:
    """The secret every replica seals its messages with: the value of the environment variable
    ``settings.secret_env`` names; else derived from the Redis password (``settings.url``) and the API keys'
    digests, which every replica's configuration holds and Redis does not; None when there are neither (then
    anyone who can reach Redis can compute the seal: see docs/scaling.md)."""
    if settings.secret_env:
        return os.environ[settings.secret_env].encode()
    password = urlsplit(settings.url or "").password or ""
    digests = sorted(set(key_digests))
    if not password and not digests:
        return None
    material = "\0".join(["gateway-state-seal", settings.prefix, password, *digests])
    return hashlib.sha256(material.encode()).digest()


PUBLIC = b"gateway-state-seal: no secret configured"  # (the key when fleet_secret finds none)
