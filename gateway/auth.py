"""Gateway API keys and their limits.

Keys are configured by their SHA-256 (``key_sha256``) or read from the environment (``key_env``); the
gateway keeps only digests and compares them in constant time. A client presents its key as
``Authorization: Bearer <key>`` or ``x-api-key``; it is never forwarded (backends get their own keys).

Limits are token buckets per key, refilled continuously: ``requests_per_minute`` is charged one per request
on arrival. ``tokens_per_minute`` is reserved on arrival and settled when the request ends: a request is
admitted while the bucket is positive and takes its reservation at once (its prompt, estimated from its
bytes, plus ``max_tokens`` or ``auth.reserve_tokens``), so one large request may take the bucket below zero
and hold the next ones back until it refills, and a burst of concurrent requests cannot all pass on one
positive reading. At the end the difference to the real prompt + completion tokens is given back (or
charged); a stream cut before its usage chunk, or an answer whose usage is no count, is charged the gateway's
estimate (``gateway.api.proxy_endpoint._tokens_used``). Each gateway process keeps its
own buckets, unless ``state.url`` names a shared store: then the buckets live there (:mod:`gateway.state`),
one set for every process and replica. Either way a key's checks come first, before its request is validated,
translated or routed (``gateway.api.proxy_endpoint``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from gateway.clock import SYSTEM, Clock
from gateway.config import ApiKeySettings, AuthSettings
from gateway.config_reload import REMEMBERED_KEYS
from gateway.errors import GatewayError
from gateway.routing.cache_domain import SHARED, CacheDomain


class TokenBucket:
    __slots__ = ("capacity", "clock", "level", "rate", "updated")

    def __init__(self, per_minute: int, now: float | None = None, clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = float(per_minute)
        self.updated = clock.monotonic() if now is None else now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float, now: float | None = None) -> float:
        """Take ``amount`` if the bucket holds at least that much (0 taken: just check it is positive);
        returns 0 on success, else the seconds until it would."""
        now = self.clock.monotonic() if now is None else now
        self._refill(now)
        needed = amount if amount > 0 else 1e-9
        if self.level >= needed:
            self.level -= amount
            return 0.0
        return (needed - self.level) / self.rate

    def resized(self, per_minute: int, now: float | None = None) -> TokenBucket:
        """A bucket of another limit holding this one's level (up to its capacity), a debt included: a changed
        limit neither refills a spent budget nor forgives what was overdrawn."""
        now = self.clock.monotonic() if now is None else now
        self._refill(now)
        bucket = TokenBucket(per_minute, now, self.clock)
        bucket.level = min(bucket.capacity, self.level)
        return bucket

    def charge(self, amount: float, now: float | None = None) -> None:
        """Take ``amount`` unconditionally (the level may go below zero); a negative amount gives back, up to
        the capacity."""
        self._refill(self.clock.monotonic() if now is None else now)
        self.level = min(self.capacity, self.level - amount)


@dataclass
class Client:
    """An authenticated API key."""

    name: str
    settings: ApiKeySettings
    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0  # requests of this key in flight in this process (kept while max_in_flight is set)
    cache_domain: CacheDomain = SHARED  # whose cached prompts its requests may profit from (see cache_domains)

    def allows(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.settings.models)


def _bucket(per_minute: int | None, clock: Clock) -> TokenBucket | None:
    return TokenBucket(per_minute, clock=clock) if per_minute else None


def _rebucket(old: TokenBucket | None, per_minute: int | None, clock: Clock) -> TokenBucket | None:
    """The bucket for a changed limit: ``old``'s, resized, where there was one (a limit set where there was
    none starts full)."""
    if old is None or not per_minute:
        return _bucket(per_minute, clock)
    return old.resized(per_minute)


ANONYMOUS = "_anonymous"


def cache_domains(settings: AuthSettings) -> dict[str, CacheDomain]:
    """Key name -> its cache domain (:mod:`gateway.routing.cache_domain`): a key's ``cache_domain``, else its
    own name. Keys that cannot send inference requests own no domain. While only one domain exists, every key
    is in :data:`SHARED` (nothing to keep apart). A domain's salt is an HMAC of its name keyed with the
    ``cache_salt_env`` secret when one is configured, else with its own keys' digests (secret from every other
    domain's keys; one salt for every replica)."""
    members: dict[str, list[ApiKeySettings]] = {}
    for key in settings.keys:
        if "inference" in key.scopes:
            members.setdefault(key.cache_domain or key.name, []).append(key)
    if len(members) <= 1:
        return {key.name: SHARED for key in settings.keys}
    secret = os.environ[settings.cache_salt_env].encode() if settings.cache_salt_env else None
    domains: dict[str, CacheDomain] = {}
    for name, keys in members.items():
        keyed = secret if secret is not None else hashlib.sha256(
            b"\0".join(sorted(k.digest().encode() for k in keys))).digest()
        salt = hmac.new(keyed, b"gateway-cache-domain\0" + name.encode(), hashlib.sha256).hexdigest()
        domains[name] = CacheDomain(name, salt)
    return {key.name: domains.get(key.cache_domain or key.name, SHARED) for key in settings.keys}


KeyScope = Literal["inference", "metrics", "admin"]  # what a key may reach (ApiKeySettings.scopes)


class KeyStore:
    def __init__(self, settings: AuthSettings, removed: int = REMEMBERED_KEYS, clock: Clock = SYSTEM) -> None:
        self.clock = clock  # (the keys' rate-limit buckets')
        self._clients: list[tuple[str, Client]] = []
        # the clients of keys a change removed, by name, the longest gone first: the last ``removed`` are kept
        self._gone: OrderedDict[str, Client] = OrderedDict()
        self._removed = removed
        self.update(settings)

    def update(self, settings: AuthSettings) -> None:
        """Take a reloaded ``auth`` section. A key kept under the same name keeps its client (its requests in
        flight count on) and its buckets' levels (where its limit changed, up to the new capacity, a debt
        included): a reload neither refills nor forgives a budget. A key removed stops authenticating at once;
        its client is kept (the last ``REMEMBERED_KEYS``), and a key added again under its name takes it back,
        buckets and debt with it (as the shared store's buckets, which carry no TTL, do)."""
        old = {client.name: client for _, client in self._clients}
        domains = cache_domains(settings)
        clients = []
        for k in settings.keys:
            client = old.pop(k.name, None) or self._gone.pop(k.name, None)
            if client is None:
                client = Client(k.name, k, _bucket(k.requests_per_minute, self.clock),
                                _bucket(k.tokens_per_minute, self.clock))
            else:
                if client.settings.requests_per_minute != k.requests_per_minute:
                    client.requests = _rebucket(client.requests, k.requests_per_minute, self.clock)
                if client.settings.tokens_per_minute != k.tokens_per_minute:
                    client.tokens = _rebucket(client.tokens, k.tokens_per_minute, self.clock)
                client.settings = k
            client.cache_domain = domains[k.name]
            clients.append((k.digest(), client))
        self._gone.update(old)
        while len(self._gone) > self._removed:
            self._gone.popitem(last=False)
        self.settings = settings
        self._clients = clients

    @property
    def enabled(self) -> bool:
        return bool(self._clients)

    def authenticate(self, authorization: bytes | None, api_key: bytes | None,
                     scope: KeyScope | None = "inference") -> Client | None:
        """The client behind the request's key; None when auth is off. Raises a 401 GatewayError for a
        missing or unknown key, 403 (``insufficient_scope``) for a key whose scopes lack ``scope`` (None:
        any key will do)."""
        if not self._clients:
            return None
        key = None
        if authorization and authorization[:7].lower() == b"bearer ":
            key = authorization[7:].strip()
        elif api_key:
            key = api_key.strip()
        if not key:
            raise GatewayError(401, "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'",
                               code="missing_api_key")
        digest = hashlib.sha256(key).hexdigest()
        found = None
        for known, client in self._clients:  # constant time per comparison, and every key compared
            if hmac.compare_digest(known, digest):
                found = client
        if found is None:
            raise GatewayError(401, "Incorrect API key provided", code="invalid_api_key")
        if scope is not None and scope not in found.settings.scopes:
            raise GatewayError(403, f"The API key '{found.name}' lacks the '{scope}' scope",
                               code="insufficient_scope")
        return found

    @staticmethod
    def cache_domain(client: Client | None) -> CacheDomain:
        """The request's cache domain: its key's (no key: auth is off, one domain)."""
        return client.cache_domain if client is not None else SHARED

    @staticmethod
    def explains_routing(client: Client | None, debug: bytes | None) -> bool:
        """Whether an answer may carry the routing internals (``x-gateway-policy``, ``x-gateway-route-reason``:
        every scorer's value, which tells what other keys' prompts left in the caches): only when the request
        asks (``x-gateway-debug: route``) and its key has the ``admin`` scope. Without keys there are no tenants
        to hide them from: the header alone will do."""
        if not debug or b"route" not in (part.strip() for part in debug.lower().split(b",")):
            return False
        return client is None or "admin" in client.settings.scopes

    @staticmethod
    def check_model(client: Client, model: str) -> None:
        """Raises 403 when the key may not use ``model``."""
        if not client.allows(model):
            raise GatewayError(403, f"The API key '{client.name}' may not use model '{model}'",
                               param="model", code="model_not_allowed")

    @staticmethod
    def rate_limited(client_name: str, what: str, wait: float) -> GatewayError:
        return GatewayError(429, f"Rate limit reached for {what} per minute on key '{client_name}'; retry in "
                                 f"{wait:.1f} s", code=f"rate_limit_{what}",
                            headers={"retry-after": str(max(1, math.ceil(wait)))})

    @staticmethod
    def too_many(client_name: str, cap: int) -> GatewayError:
        return GatewayError(429, f"Too many requests in flight on key '{client_name}' (max_in_flight {cap}); "
                                 "retry when one has finished", code="concurrency_limit",
                            headers={"retry-after": "1"})

    @staticmethod
    def hold(client: Client) -> bool:
        """One of the key's ``max_in_flight`` places, in this process (a gateway without shared state): True
        when taken (give it back with :meth:`release`), False when the key has no cap. Raises 429."""
        cap = client.settings.max_in_flight
        if cap is None:
            return False
        if client.in_flight >= cap:
            raise KeyStore.too_many(client.name, cap)
        client.in_flight += 1
        return True

    @staticmethod
    def release(client: Client) -> None:
        client.in_flight = max(0, client.in_flight - 1)

    @staticmethod
    def admit(client: Client, model: str, reserve: int = 0) -> int:
        """Model permission and the request and token budgets, on arrival. Raises 403 / 429. Returns the
        tokens reserved (``reserve`` when the key has a token limit, else 0); settle them with :meth:`settle`."""
        KeyStore.check_model(client, model)
        # a request takes one from its bucket; the token bucket is only checked here (0 taken) and charged the
        # reservation below, once every check passed
        for bucket, what, amount in ((client.requests, "requests", 1.0), (client.tokens, "tokens", 0.0)):
            if bucket is None:
                continue
            wait = bucket.take(amount)
            if wait > 0:
                raise KeyStore.rate_limited(client.name, what, wait)
        if client.tokens is None or reserve <= 0:
            return 0
        client.tokens.charge(reserve)
        return reserve

    @staticmethod
    def settle(client: Client, reserved: int, used: int) -> None:
        """The request ended having used ``used`` tokens: give back (or charge) the difference."""
        if client.tokens is not None and used != reserved:
            client.tokens.charge(used - reserved)
