"""Limits and routing state shared by every gateway process and replica, in Redis (or Valkey).

What is shared, and how it stays off the hot path:

* **Admission** (:meth:`SharedState.admit`): a key's requests and tokens per minute and its
  ``max_in_flight`` on arrival, before the request is validated or routed (no candidates), then a slot on a
  backend with a ``max_concurrency`` after routing (no budget), each an atomic script
  (:mod:`gateway.state.scripts`): at most a round trip each, and none at all for a request of an unlimited key
  to backends without a ``max_concurrency``. Settling (the tokens really used, the slot given back) is sent
  after the response, in the background.
* **Kept slots**: a replica keeps some slots of a backend (up to ``max_concurrency // 8``, at most 64) for its
  next requests, which then take one without asking Redis: a key without limits pays no round trip at all
  while its replica has one. It keeps the slots its finished requests free, and an admission's round trip
  takes some more with the request's own (never more than half of those still free), so that a burst of
  requests arriving together pays one round trip, not one each: while an admission is on its way, the
  requests of the same key wait for it and then look again. Kept slots count as held for everyone else, so
  ``max_concurrency`` still holds across replicas; they go back to Redis when unused for a heartbeat, and at
  once when another replica finds the backend full (it says so on the *wanted* channel).
* **Leases**: a key without ``max_in_flight`` takes, with an admission's round trip, some more of its buckets'
  requests and tokens (about ``LEASE_MAX`` requests' worth, never more than a bucket's level over
  ``LEASE_SHARE`` x the replicas: none as the bucket runs low, so the limit stays exact there); its next
  requests on this replica take theirs from the lease without asking Redis, and with a kept slot pay no round
  trip at all. A lease taken below ``LEASE_LOW`` requests' worth is topped up by ``LEASE_MAX`` requests' worth
  in the background, ahead of need (one round trip no request waits on, unless it finds the lease empty
  first). A request's worth of tokens is its reservation plus what the key's requests have lately used beyond
  theirs. A request's tokens are settled against its reservation as ever, into the lease while there is
  one (what it used less goes back to the lease, what it used more comes out of it), else in Redis. Leases
  unused for a heartbeat go back to the buckets.
* **Free slots**: a released slot is announced on a channel; every replica's waiting requests (the admission
  queue) wake and route again.
* **Peers** (:meth:`publish`, :meth:`subscribe`): what routing learns (session -> backend, the prompt blocks
  routed to a backend) is published, batched every few milliseconds, and applied to every other replica's
  own tables, so routing reads only local memory. Every message between replicas (these, the operator's
  changes, freed slots, backends wanted) is sealed with a secret they share and Redis does not hold
  (:mod:`gateway.state.sealing`): whoever else can publish to Redis is not heard.
* **Stored responses** (``/v1/responses`` with ``previous_response_id``): kept in Redis with their TTL, bound
  to their API key and bounded in all and per key (:mod:`gateway.state.stored_responses`, ``self.responses``).
  A failed read or write of one fails that operation alone (counted, logged at most once a minute), never the
  state.

Redis full: what limits keep (buckets, in-flight counts) carries no TTL, so ``volatile-*`` eviction never takes
it, and its scripts run past ``maxmemory`` (:mod:`gateway.state.scripts`); a write Redis refuses for memory is a
stored response's, which fails alone.

Redis stalling: an admission that timed out (or whose client left) still runs in Redis when it resumes; its
answer, when it comes, has the replica give back what it took (:meth:`SharedState._admission_abandoned`).

Redis failing: every operation has a short timeout; the state is then *down* (``gateway_state_up`` 0,
``gateway_state_errors_total``, a log line per minute at most) until a heartbeat answers again. Meanwhile
limits pass (``on_failure: open``, counted in ``gateway_state_fail_open_total``) or refuse with 503
(``closed``), ``max_concurrency`` is enforced by each replica on its own, routing uses local state only, and
settlements wait in a bounded queue to be sent when Redis is back; a replica then writes its own slot counts
as they are, since increments or decrements may have been lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from gateway.clock import SYSTEM, Clock
from gateway.config import StateSettings
from gateway.redaction import redact_url
from gateway.state import replies, scripts
from gateway.state.autopipeline import AutoPipeline
from gateway.state.errors import StateUnavailable as StateUnavailable  # (where callers import it from)
from gateway.state.loop_lag import LoopLag
from gateway.state.resp import RespConnection
from gateway.state.sealing import PUBLIC, REASONS, WINDOW, Rejected, Seal, fleet_secret
from gateway.state.stored_responses import StoredResponses

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger("gateway.state")

PUBLISH_INTERVAL = 0.005  # seconds a peer message may wait to be batched with others
POOL_CONNECTIONS = 16  # connections to Redis per process (besides the subscriber's)
OPERATIONS = ("admit", "acquire", "lease", "settle", "heartbeat", "subscribe", "publish", "get_response",
              "put_response", "drain")
MAX_PENDING = 10_000  # settlements kept while Redis is down (beyond: the oldest are dropped and counted)
KEPT_SHARE = 8  # a replica keeps up to max_concurrency // KEPT_SHARE freed slots of a backend ...
KEPT_MAX = 64  # ... and at most this many
LEASE_SHARE = 16  # a lease takes at most 1/(LEASE_SHARE x replicas) of what is left in a key's bucket ...
LEASE_MAX = 16  # ... and at most this many requests (of tokens: this many requests' worth, see _unit) at a time
LEASE_LOW = LEASE_MAX  # a lease taken below this many requests('s worth) is topped up ahead of need: a burst's
# worth is left while the top-up is on its way (a round trip that, in a burst, waits behind the burst's own work)


@dataclass(frozen=True, slots=True)
class Admitted:
    """``chosen``: the index of the candidate a slot was taken on (0 when none needed one); ``limited``:
    "requests" or "tokens" when the key's budget is spent (``retry_after`` seconds), "in_flight" when it has
    ``max_in_flight`` requests in flight; ``full`` when every
    candidate with a ``max_concurrency`` is at it (nothing was taken)."""

    chosen: int = 0
    limited: str | None = None
    retry_after: float = 0.0
    full: bool = False
    slot: bool = False  # a slot was taken (give it back with settle)
    key_place: bool = False  # one of the key's max_in_flight places was taken (give it back with settle)


@dataclass(frozen=True, slots=True)
class Budget:
    """What admission checks of a key: its name and limits (None: unlimited)."""

    key: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_in_flight: int | None = None


@dataclass(frozen=True, slots=True)
class Slotted:
    """A candidate backend as admission sees it: its name and ``max_concurrency`` (None: no slot needed)."""

    name: str
    max_concurrency: int | None


class Candidate(Protocol):
    """What admission reads of a candidate backend: a :class:`Slotted`, or the pool's ``Backend`` itself (the
    proxy passes its routing decision's backends as they are, with no copy per request)."""

    @property
    def name(self) -> str: ...

    @property
    def max_concurrency(self) -> int | None: ...


# the answers of an admission decided in memory (most of them): made once, not per request
_LOCAL_SLOT = Admitted(chosen=0, slot=True)
_LOCAL_NO_SLOT = Admitted(chosen=0, slot=False)


def _limits(budget: Budget | None) -> tuple[str, int, int, int]:
    """(name, requests_per_minute, tokens_per_minute, max_in_flight) of ``budget``, 0 where unlimited."""
    if budget is None:
        return "_", 0, 0, 0
    return (budget.key, budget.requests_per_minute or 0, budget.tokens_per_minute or 0,
            budget.max_in_flight or 0)


def _consumed(reply: asyncio.Future[Any]) -> None:
    if not reply.cancelled():
        reply.exception()  # (read, so that asyncio does not log it as never retrieved)


def key_place_of(key: str) -> str:
    """What a key's ``max_in_flight`` count is named among the in-flight counts, beside the backends' slots (the
    backends are named by their names): ``#key:<key>``, a name no backend can have (a backend's name begins with
    a letter or a digit). In Redis its hash is ``inflight:key:<key>`` (see :meth:`SharedState._inflight`)."""
    return f"#key:{key}"


class SharedState:
    """One process's connection to the shared state. ``start`` connects and starts the heartbeat and the
    subscriber; every operation is safe to call while Redis is down (see the module docstring)."""

    def __init__(self, settings: StateSettings, *, replica_id: str | None = None,
                 client: aioredis.Redis | None = None, secret: bytes | None = None, clock: Clock = SYSTEM) -> None:
        """``secret``: what the messages to the other replicas are sealed with (:mod:`gateway.state.sealing`;
        the composition root derives it from the configuration: :func:`fleet_secret`). ``clock``: the time
        its leases, kept slots and heartbeats read (Redis's own expiry is Redis's)."""
        assert settings.url is not None or client is not None
        self.settings = settings
        self.clock = clock
        self.replica = replica_id or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._timeout = settings.timeout_ms / 1000
        # redis-py is imported here, not with the module: it takes ~150 ms, which a gateway without shared
        # state need not pay at start
        import redis.asyncio
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import NoScriptError, RedisError, ResponseError

        self._errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
        self._no_script = NoScriptError
        self._refused = ResponseError  # an error reply: Redis answered, and refused that one command
        # a bounded pool: a burst of requests shares a few connections instead of opening one each (opening one
        # takes several round trips, which is what timed out under bursts)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            settings.url or "", max_connections=POOL_CONNECTIONS, timeout=self._timeout,
            socket_timeout=max(1.0, 10 * self._timeout), socket_connect_timeout=max(1.0, 10 * self._timeout),
            # once again at once on a broken connection (after Redis restarted, each pooled connection fails
            # on its first use), never on a timeout
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError], health_check_interval=0)
        self._redis = client if client is not None else redis.asyncio.Redis(connection_pool=pool)
        # the admissions' round trips on a connection of their own, packed and parsed by hiredis (resp.py)
        self._fast = (RespConnection(dict(pool.connection_kwargs), max(1.0, 10 * self._timeout))
                      if client is None and RespConnection.supports(settings.url or "")
                      else None)
        self._pipeline = AutoPipeline(self._redis, self._spawn, self._fast)
        p = settings.prefix
        self._freed_channel = f"{p}freed"
        self._wanted_channel = f"{p}wanted"  # a replica found these backends full: give back the kept slots
        self._sender = self.replica.encode() + b"\0"  # heads every message it seals (its own are skipped unread)
        self._peers_channel = f"{p}peers"
        self._channels = {c.encode(): c for c in (self._peers_channel, self._freed_channel, self._wanted_channel)}
        secret = secret if secret is not None else fleet_secret(settings)
        self._weak_secret = secret is None
        self._seal = Seal(secret or PUBLIC, self.replica)
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)  # messages dropped, by why
        self._last_reject_log = 0.0
        self._flushing = asyncio.Lock()  # (peer messages go one at a time, in order: see sealing's "replayed")
        self._replicas_key = f"{p}replicas"
        self._drained_key = f"{p}drained"  # the backends an operator drained (a set), for every replica
        # set with the first write of that set: its absence says Redis lost its data (restarted without
        # persistence, flushed), so an empty set there is not every replica's undrain
        self._drained_mark = f"{p}drained:kept"
        self._drained_read: set[str] | None = None  # as the last heartbeat read it (None: not read yet)
        self._on_drained: list[Callable[[str, bool], None]] = []
        self._drain_writes: dict[str, int] = {}  # backend -> this replica's writes of it not yet answered
        self._drained_reading = asyncio.Lock()
        self._drained_due = False  # (another replica changed the set since the read on its way began)
        self._drained_rereading = False
        self._shas: dict[str, str] = {}
        self.up = False
        self.beats = 0  # heartbeats answered (what waits for the replicas to have read something, reads)
        self.errors: dict[str, int] = dict.fromkeys(OPERATIONS, 0)  # operation -> failures (all from zero)
        self.fail_open = 0  # requests passed unlimited because Redis was down
        # admissions by how they were decided: from what this replica holds ("local"), from what another
        # request's round trip brought ("waited"), or with a round trip of their own ("redis")
        self.admissions: dict[str, int] = {"local": 0, "waited": 0, "redis": 0}
        self.refills = 0  # leases topped up ahead of need (round trips in the background)
        self.dropped = 0  # settlements dropped (the queue was full while Redis was down)
        # round trips answered after their request gave up (timed out, or left) or after a resync: what they took
        # was given back
        self.abandoned = 0
        self._last_log = 0.0
        self._last_alone_log = 0.0  # (operations that fail alone log apart: the state's own lines are not hidden)
        self._needs_resync = True
        # counts each resync: what was queued (a settlement) or sent (an admission) before the latest resync is in
        # the counts it wrote, so its slots and places are not given back on top of them
        self._epoch = 0
        self._checking_fast = False  # (a look at the admissions' connection is under way: see _check_fast)
        self._lag = LoopLag()  # (Redis's timeouts do not count the event loop's lateness: see loop_lag.py)
        self._held: dict[str, int] = {}  # backend -> slots this replica's requests hold (its own truth)
        # backend -> slots this replica holds in Redis but no request uses: kept for its next requests
        self._kept: dict[str, int] = {}
        self._kept_used: dict[str, float] = {}  # backend -> when a kept slot was last taken or kept (monotonic)
        self._limits: dict[str, int] = {}  # backend -> its max_concurrency, as the last slot taken saw it
        self._wanted: dict[str, float] = {}  # backend -> when another replica last found it full (monotonic)
        # (key, "requests" or "tokens") -> [what of that bucket is leased here, its limit, when last leased or
        # taken from]
        self._leases: dict[tuple[str, str], list[float]] = {}
        # (key name, best-ranked backend) -> done when the admission round trip on its way for them (a key
        # without max_in_flight) is back
        self._admitting: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._refilling: dict[str, asyncio.Future[None]] = {}  # key name -> done when its lease's top-up is back
        self._overuse: dict[str, float] = {}  # key name -> tokens its requests lately used beyond their reservation
        self._reserves: dict[str, int] = {}  # key name -> the tokens its latest request reserved
        self._dry: dict[str, float] = {}  # key name -> when a top-up last brought nothing (monotonic)
        self.remote: dict[str, int] = {}  # backend -> slots the other replicas hold, as last read
        # settlements waiting for Redis: (the epoch they were queued in, keys, args)
        self._pending: deque[tuple[int, list[str], list[Any]]] = deque()
        self._draining = False
        self._settlements = 0  # (numbers this replica's settlements: their ids)
        self.replicas = 1  # replicas alive, as the last heartbeat counted them (this one included)
        self._outbox: list[tuple[str, Any]] = []
        self._handlers: dict[str, list[Callable[[Any], None]]] = {}
        self._on_freed: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_scheduled = False
        # the backends with a max_concurrency (their in-flight is kept here), as the pool has them now
        self.slotted: Callable[[], set[str]] = set
        self._background: set[asyncio.Task[None]] = set()  # (referenced until done, as asyncio requires)
        self.responses = StoredResponses(self._redis, p, self._timeout * 5, self._errors, self._failed_alone,
                                         self._spawn, secret or PUBLIC)

    # -- keys ---------------------------------------------------------------------------------------------------
    def _bucket(self, key: str, kind: str) -> str:
        return f"{self.settings.prefix}bucket:{kind}:{key}"

    def _inflight(self, name: str) -> str:
        """The in-flight hash of a backend (``name``: its name) or of a key's places (:func:`key_place_of`). A key's
        is ``inflight:key:<key>``, where it always was; a backend's ``inflight:<name>``, but for a name that
        begins with ``key:`` (or ``#``): ``inflight:#<name>``. So no backend shares a key's count (a backend named
        ``key:lim`` counted key lim's requests as its slots, and its slots as lim's requests in flight), and a
        backend of any other name keeps its hash across an upgrade."""
        if name.startswith("#key:"):
            return f"{self.settings.prefix}inflight:{name[1:]}"
        if name.startswith(("key:", "#")):
            return f"{self.settings.prefix}inflight:#{name}"
        return f"{self.settings.prefix}inflight:{name}"

    # -- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._lag.start()
        if self._weak_secret:
            log.warning("shared state: neither state.secret_env nor a Redis password or API keys to derive a secret "
                        "from: the messages between replicas are sealed with a key anyone who can reach Redis can "
                        "compute, so whoever can PUBLISH there can drain, add or change backends on every replica; "
                        "set state.secret_env (docs/scaling.md)")
        await self._heartbeat()  # (down is fine: it retries)
        # the admission scripts, loaded before the first burst of requests (each would load them otherwise)
        with contextlib.suppress(*self._errors):
            for name, source in (("admit", scripts.ADMIT), ("acquire", scripts.ACQUIRE), ("lease", scripts.LEASE)):
                if name not in self._shas:
                    self._shas[name] = await asyncio.wait_for(self._redis.script_load(source), self._timeout * 5)
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="state-heartbeat"),
                       asyncio.create_task(self._subscribe_loop(), name="state-subscriber")]

    async def stop(self) -> None:
        self._lag.stop()
        """Leave (the others need not wait for the TTL to free this replica's slots) and close; bounded in
        time whatever Redis does."""
        if self._refilling:  # (a top-up on its way would otherwise land after the leases went back)
            await asyncio.wait(list(self._refilling.values()), timeout=1.0)
        for lease in list(self._leases):  # what is leased goes back (sent again if a drain has it: idempotent)
            self._give_back_lease(lease)
        if self._pending and self.up:
            with contextlib.suppress(*self._errors, TimeoutError):
                await asyncio.wait_for(self._settle_batch(list(self._pending)), 1.0)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks = []
        with contextlib.suppress(*self._errors):
            await asyncio.wait_for(self._flush(), 1.0)
            if self.up:
                await asyncio.wait_for(self._forget_self(), 1.0)
        with contextlib.suppress(*self._errors):
            await asyncio.wait_for(self._redis.aclose(), 1.0)
        if self._fast is not None:
            self._fast.close()

    async def _forget_self(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrem(self._replicas_key, self.replica)
        for backend in self.slotted():
            pipe.hdel(self._inflight(backend), self.replica)
        pipe.publish(self._freed_channel, self._seal.seal(self._freed_channel.encode(), b"*"))
        await pipe.execute()

    # -- failures -----------------------------------------------------------------------------------------------
    def _failed(self, operation: str, exc: BaseException) -> None:
        """An operation failed. A timeout of one request's operation only fails that request (a slow moment
        under load is not an outage; the heartbeat decides that; what Redis gives it when it answers after all
        goes back: see the ``late`` of :meth:`_script`); an error reply (Redis answered, and refused that one
        command: a key holding what the script cannot read) fails that operation alone; anything else, and any
        failure of the heartbeat, takes the state down until a heartbeat answers."""
        if isinstance(exc, TimeoutError) and operation in ("admit", "acquire", "lease"):
            self.errors[operation] = self.errors.get(operation, 0) + 1
            return
        if isinstance(exc, self._refused) and operation != "heartbeat":
            self._failed_alone(operation, exc)
            return
        self._lost(operation, exc)

    def _lost(self, operation: str, exc: BaseException) -> None:
        """Redis is unreachable (or may have run a command whose answer is lost): the state is down until a
        heartbeat answers, which then writes this replica's counts afresh."""
        self.errors[operation] = self.errors.get(operation, 0) + 1
        if self.up:
            self._needs_resync = True
            # the resync writes what this replica's requests hold: the kept slots go with it
            self._kept.clear()
        self.up = False
        now = self.clock.monotonic()
        if now - self._last_log >= 60:
            self._last_log = now
            log.warning("shared state (Redis) unavailable (%s: %s: %s); limits fail %s, routing uses local "
                        "state until it answers again", operation, type(exc).__name__, exc, self.settings.on_failure)

    def _failed_alone(self, operation: str, exc: BaseException) -> None:
        """An operation whose failure is its own (a stored response read or written: Redis past its maxmemory,
        or slow; any command Redis answered with an error) failed: counted, and logged at most once a minute;
        the state stays as it is (one stored response, or one key's corrupt data, must not switch every key's
        limits off; the heartbeat decides whether Redis is down)."""
        self.errors[operation] = self.errors.get(operation, 0) + 1
        now = self.clock.monotonic()
        if now - self._last_alone_log >= 60:
            self._last_alone_log = now
            log.warning("shared state: %s failed (%s: %s); that operation alone failed, the state stays up",
                        operation, type(exc).__name__, exc)

    async def _script(self, name: str, source: str, keys: list[str], args: list[Any],
                      late: Callable[[Any], None] | None = None, *, timed: bool = False) -> Any:
        """Run a script, with whatever else is being run now, in one pipeline (:mod:`autopipeline`). ``late``:
        called with Redis's answer should it come after the caller gave up (timed out, or was cancelled), to give
        back what the script took. ``timed``: within the state's timeout, measured on Redis, not on this
        process's event loop (see AutoPipeline.run); TimeoutError."""
        within = self._timeout if timed else None
        sha = self._shas.get(name)
        if sha is None:
            sha = self._shas[name] = await self._load(source, within)
        try:
            return await self._pipeline.run("EVALSHA", sha, len(keys), *keys, *args, late=late, within=within)
        except self._no_script:  # Redis restarted (its script cache is empty)
            self._shas[name] = await self._load(source, within)
            return await self._pipeline.run("EVALSHA", self._shas[name], len(keys), *keys, *args, late=late,
                                            within=within)

    async def _load(self, source: str, within: float | None) -> str:
        if within is None:
            return str(await self._redis.script_load(source))
        # (rare: once a script, and after Redis restarted)
        return str(await self._lag.wait(self._redis.script_load(source), 5 * within))

    # -- admission ----------------------------------------------------------------------------------------------
    def needed(self, budget: Budget | None, candidates: Sequence[Candidate]) -> bool:
        """Whether admission has anything to check (else it costs no round trip)."""
        if budget is not None and (budget.requests_per_minute or budget.tokens_per_minute or budget.max_in_flight):
            return True
        return any(candidate.max_concurrency for candidate in candidates)

    def try_local(self, budget: Budget | None, reserve: int, candidates: Sequence[Candidate]) -> Admitted | None:
        """:meth:`admit` from what this replica holds (kept slots, leases), with no round trip and no await;
        None when that does not do (then :meth:`admit_remote`). Most requests are admitted here, and at 16
        streams each microsecond a request spends before its first upstream byte is spent before the others'
        too."""
        name, rpm, tpm, cap = _limits(budget)
        if cap or not self.up:
            return None  # (a key's requests in flight are counted in Redis, each)
        if tpm:
            self._reserves[name] = reserve  # (the key's latest: what a top-up from its settlements sizes by)
        else:
            reserve = 0
        # the best-ranked candidate, when it needs a slot: a kept slot of it is taken (one that needs none
        # needs nothing here)
        head = candidates[0] if candidates and candidates[0].max_concurrency else None
        if not self._local(name, rpm, tpm, reserve, head):
            return None
        self.admissions["local"] += 1
        return _LOCAL_SLOT if head is not None else _LOCAL_NO_SLOT

    async def admit(self, budget: Budget | None, reserve: int, candidates: Sequence[Candidate]) -> Admitted:
        """The key's budget and a slot on the first candidate that has one (candidates without a
        ``max_concurrency`` always do): from what this replica holds when it does (:meth:`try_local`), else in
        one round trip (:meth:`admit_remote`). Raises StateUnavailable when Redis cannot answer."""
        admitted = self.try_local(budget, reserve, candidates)
        return admitted if admitted is not None else await self.admit_remote(budget, reserve, candidates)

    async def admit_remote(self, budget: Budget | None, reserve: int, candidates: Sequence[Candidate]) -> Admitted:
        """:meth:`admit` after :meth:`try_local` said None: one round trip (or, while one of the same key to the
        same backend is on its way, a wait for what it brings). Raises StateUnavailable."""
        name, rpm, tpm, cap = _limits(budget)
        reserve = reserve if tpm else 0
        head = candidates[0] if candidates and candidates[0].max_concurrency else None
        local = not cap and self.up
        # the candidates up to (and including) the first that needs no slot: none after it is ever chosen
        chosen_from: list[Candidate] = []
        if head is not None:
            for candidate in candidates:
                chosen_from.append(candidate)
                if not candidate.max_concurrency:
                    break
        flight = (name, head.name if head is not None else "")  # (see _admitting)
        if local:
            # A round trip of the same key to the same best-ranked backend is on its way: it brings leases and
            # kept slots enough for a burst, so wait for it rather than send another (the one sent first answers
            # first), then look again.
            ahead = self._admitting.get(flight)
            if ahead is None and self._lease_short(name, rpm, tpm, reserve):
                ahead = self._refilling.get(name)  # (the lease's top-up is on its way: what it brings will do)
            if ahead is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._timeout):
                        await asyncio.shield(ahead)
                if self.up and self._local(name, rpm, tpm, reserve, head):
                    self.admissions["waited"] += 1
                    return _LOCAL_SLOT if head is not None else _LOCAL_NO_SLOT
        keys = [self._bucket(name, "requests"), self._bucket(name, "tokens"), self._inflight(key_place_of(name)),
                *(self._inflight(c.name) for c in chosen_from)]
        divisor = LEASE_SHARE * max(1, self.replicas) if (rpm or tpm) and not cap else 0
        room = self._keep_room(chosen_from[0].name, chosen_from[0].max_concurrency) if chosen_from else 0
        most_tokens = LEASE_MAX * self._unit(name, reserve)  # (leased at most: the answer is checked against it)
        args = [self.replica, rpm, tpm, reserve, cap, divisor, LEASE_MAX, most_tokens, room,
                *(c.max_concurrency or 0 for c in chosen_from)]
        if not self.up:  # (it went down while this waited: a resync is due, and nothing may be sent before it)
            raise StateUnavailable("down")
        self.admissions["redis"] += 1
        done: asyncio.Future[None] | None = None
        if not cap and flight not in self._admitting:
            done = self._admitting[flight] = asyncio.get_running_loop().create_future()
        epoch = self._epoch
        undo = partial(self._admission_abandoned, name, rpm, tpm, reserve, cap, chosen_from, epoch, most_tokens, room)
        try:
            reply = await self._script("admit", scripts.ADMIT, keys, args, undo, timed=True)
        except self._errors as exc:
            self._failed("admit", exc)
            raise StateUnavailable(str(exc)) from None
        finally:
            if done is not None:
                del self._admitting[flight]
                done.set_result(None)
        if epoch != self._epoch:  # a resync was sent meanwhile: it wrote this replica's counts without this one
            undo(reply)
            raise StateUnavailable("the shared state was resynchronised during the admission")
        try:
            status, value, leased, tleased, extra = replies.admitted(reply, len(chosen_from), LEASE_MAX, most_tokens,
                                                                     room)
        except replies.BadReply as exc:
            self._lost("admit", exc)  # (what it may have taken is unknown: the heartbeat writes the counts afresh)
            raise
        if status == 0:
            for kind, limit, amount in (("requests", rpm, leased), ("tokens", tpm, tleased)):
                if amount > 0:
                    self._lease(name, kind, limit, amount)
        if status == 1 or status == 2:
            return Admitted(limited="requests" if status == 1 else "tokens", retry_after=value / 1000)
        if status == 3:
            self._announce(self._wanted_channel, self._wanted_message(chosen_from))
            return Admitted(full=True)
        if status == 4:
            return Admitted(limited="in_flight")
        if cap:
            place = key_place_of(name)
            self._held[place] = self._held.get(place, 0) + 1
        index = value
        slot = bool(chosen_from) and bool(chosen_from[index].max_concurrency)
        if slot:
            self._took(chosen_from[index])
            if extra > 0:
                self._kept_extra(chosen_from[index], extra)
        return Admitted(chosen=index, slot=slot, key_place=bool(cap))

    def _admission_abandoned(self, name: str, rpm: int, tpm: int, reserve: int, cap: int,
                             chosen_from: list[Candidate], epoch: int, most_tokens: int, room: int,
                             reply: Any) -> None:
        """Redis's answer to an admission no request uses (its request gave up: timed out or left; or a resync
        was sent meanwhile): what it took goes back, the key's requests and tokens included (the request was
        not admitted by it). A slot or place it took is not given back after a resync: the resync wrote this
        replica's counts without it. No answer at all (the connection broke): it may have run, so the state
        goes down, and the heartbeat that brings it back writes the counts afresh."""
        self.abandoned += 1
        if isinstance(reply, BaseException):
            if not isinstance(reply, self._refused):  # (an error reply: it took nothing)
                self._lost("admit", reply)
            return
        try:
            status, index, leased, tleased, kept = replies.admitted(reply, len(chosen_from), LEASE_MAX, most_tokens,
                                                                    room)
        except replies.BadReply as exc:
            self._lost("admit", exc)
            return
        if status != 0:
            return  # (refused: it took nothing)
        if rpm:
            self._queue_settle(name, rpm, -(1 + leased), None, 0, None, bucket="requests")
        counted = epoch == self._epoch
        slot = chosen_from[int(index)] if chosen_from and counted else None
        backend = slot.name if slot is not None and slot.max_concurrency else None
        place = key_place_of(name) if cap and counted else None
        tokens = -(reserve + tleased) if tpm else 0
        if tokens or backend is not None or place is not None:
            self._queue_settle(name, tpm, tokens, backend, 1 + kept if backend is not None else 0, place)

    def _local(self, name: str, rpm: int, tpm: int, reserve: int, head: Candidate | None) -> bool:
        """Admit from what this replica has, without a round trip, if it has what the request needs: a leased
        request (if the key has a requests_per_minute), its reservation's tokens leased (tokens_per_minute), a
        kept slot of ``head``, the best-ranked backend (if it has a max_concurrency)."""
        requests = self._leases.get((name, "requests")) if rpm else None
        tokens = self._leases.get((name, "tokens")) if tpm else None
        if ((not rpm or (requests is not None and requests[0] >= 1 and requests[1] == rpm))
                and (not tpm or (tokens is not None and tokens[0] >= reserve and tokens[1] == tpm))
                and (rpm or tpm or head is not None)
                and (head is None or self._take_kept(head))):
            if requests is None and tokens is None:
                return True
            now = self.clock.monotonic()
            if requests is not None:
                requests[0] -= 1
                requests[2] = now
            if tokens is not None:
                tokens[0] -= reserve
                tokens[2] = now
            if ((requests is not None and requests[0] < LEASE_LOW)
                    or (tokens is not None and tokens[0] < LEASE_LOW * self._unit(name, reserve))):
                self._top_up(name, rpm, tpm, reserve)
            return True
        return False

    def _unit(self, name: str, reserve: int) -> int:
        """The tokens one request of the key takes from a lease: its reservation, and what the key's requests
        have lately used beyond theirs (settled from the lease too)."""
        return max(1, reserve) + int(self._overuse.get(name, 0.0))

    def _lease_short(self, name: str, rpm: int, tpm: int, reserve: int) -> bool:
        """Whether this replica's lease of the key lacks what a request needs (a request, its reservation)."""
        requests = self._leases.get((name, "requests")) if rpm else None
        tokens = self._leases.get((name, "tokens")) if tpm else None
        return bool((rpm and (requests is None or requests[0] < 1))
                    or (tpm and (tokens is None or tokens[0] < reserve)))

    def _top_up(self, name: str, rpm: int, tpm: int, reserve: int) -> None:
        """Top the key's lease up by ``LEASE_MAX`` requests('s worth of tokens) in the background, so that its
        next requests (a burst of them) find it stocked rather than wait for a round trip. One at a time per
        key; none while Redis is down."""
        if name in self._refilling or not self.up:
            return
        if self.clock.monotonic() - self._dry.get(name, -1e9) < self.settings.heartbeat_seconds:
            return  # (the last brought little: the bucket runs low, and requests may as well ask Redis)
        done = self._refilling[name] = asyncio.get_running_loop().create_future()
        self._spawn(self._refill(name, rpm, tpm, reserve, done))

    async def _refill(self, name: str, rpm: int, tpm: int, reserve: int, done: asyncio.Future[None]) -> None:
        try:
            want = LEASE_MAX if rpm else 0
            want_tokens = LEASE_MAX * self._unit(name, reserve) if tpm else 0
            keys = [self._bucket(name, "requests"), self._bucket(name, "tokens")]
            args = [rpm, tpm, LEASE_SHARE * max(1, self.replicas), want, want_tokens, reserve]
            try:
                leased, tokens = replies.leased(
                    await self._script("lease", scripts.LEASE, keys, args,
                                       partial(self._lease_abandoned, name, rpm, tpm, want, want_tokens), timed=True),
                    want, want_tokens)
            except replies.BadReply as exc:
                self._lost("lease", exc)
                return
            except self._errors as exc:
                self._failed("lease", exc)
                return
            self.refills += 1
            if (rpm and int(leased) < want // 4) or (tpm and int(tokens) < want_tokens // 4):
                self._dry[name] = self.clock.monotonic()  # (the bucket runs low: leases bring little now)
            for kind, limit, amount in (("requests", rpm, int(leased)), ("tokens", tpm, int(tokens))):
                if amount > 0:
                    self._lease(name, kind, limit, amount)
        finally:
            del self._refilling[name]
            done.set_result(None)

    def _lease_abandoned(self, name: str, rpm: int, tpm: int, want: int, want_tokens: int, reply: Any) -> None:
        """Redis's answer to a top-up that gave up waiting: what it leased goes back to the buckets."""
        self.abandoned += 1
        if isinstance(reply, BaseException):
            return  # (no answer: what it may have leased is lost to the key until its buckets refill)
        try:
            leased = replies.leased(reply, want, want_tokens)
        except replies.BadReply as exc:
            self._lost("lease", exc)
            return
        for kind, limit, amount in (("requests", rpm, leased[0]), ("tokens", tpm, leased[1])):
            if amount > 0:
                self._queue_settle(name, limit, -amount, None, 0, None, bucket=kind)

    async def acquire(self, backend: Candidate) -> bool:
        """A slot on one backend with a ``max_concurrency`` (a failover attempt). Raises StateUnavailable."""
        assert backend.max_concurrency
        if self._take_kept(backend):
            return True
        if not self.up:
            raise StateUnavailable("down")
        epoch = self._epoch
        undo = partial(self._slot_abandoned, backend.name, epoch)
        try:
            taken = replies.acquired(await self._script("acquire", scripts.ACQUIRE, [self._inflight(backend.name)],
                                                        [self.replica, backend.max_concurrency], undo, timed=True))
        except replies.BadReply as exc:
            self._lost("acquire", exc)
            raise
        except self._errors as exc:
            self._failed("acquire", exc)
            raise StateUnavailable(str(exc)) from None
        if epoch != self._epoch:  # (as in admit_remote)
            undo(taken)
            raise StateUnavailable("the shared state was resynchronised while a slot was taken")
        if taken:
            self._took(backend)
        else:
            self._announce(self._wanted_channel, self._wanted_message([backend]))
        return bool(taken)

    def _slot_abandoned(self, backend: str, epoch: int, reply: Any) -> None:
        """Redis's answer to a slot taken for no request (as :meth:`_admission_abandoned`)."""
        self.abandoned += 1
        if isinstance(reply, BaseException):
            if not isinstance(reply, self._refused):
                self._lost("acquire", reply)
        elif reply == 1 and epoch == self._epoch:
            self._queue_settle("_", 0, 0, backend, 1, None)

    # -- kept slots ---------------------------------------------------------------------------------------------
    def _took(self, backend: Candidate) -> None:
        assert backend.max_concurrency
        self._held[backend.name] = self._held.get(backend.name, 0) + 1
        self._limits[backend.name] = backend.max_concurrency

    def _take_kept(self, backend: Candidate) -> bool:
        """A slot this replica kept, for a request to ``backend``; False when it keeps none (or, its
        ``max_concurrency`` lowered by a reload, too many: they are given back)."""
        kept = self._kept.get(backend.name, 0)
        if not kept or not backend.max_concurrency or not self.up:
            return False
        if self._held.get(backend.name, 0) + kept > backend.max_concurrency:
            self._give_back_kept(backend.name)
            return False
        self._kept[backend.name] = kept - 1
        self._kept_used[backend.name] = self.clock.monotonic()
        self._took(backend)
        return True

    def _keep(self, backend: str) -> bool:
        """Whether a slot a request of this replica just freed is kept for its next request (not while
        another replica recently found the backend full, nor while Redis is down)."""
        now = self.clock.monotonic()
        if self._keep_room(backend, self._limits.get(backend, 0), now) <= 0:
            return False
        self._kept[backend] = self._kept.get(backend, 0) + 1
        self._kept_used[backend] = now
        return True

    def _keep_room(self, backend: str, max_concurrency: int | None, now: float | None = None) -> int:
        """How many more slots of ``backend`` this replica may keep (none while another replica recently
        found it full, nor while Redis is down)."""
        if not max_concurrency or not self.up:
            return 0
        wanted = self._wanted.get(backend)
        now = self.clock.monotonic() if now is None else now
        if wanted is not None and now - wanted < self.settings.heartbeat_seconds:
            return 0
        return max(0, min(KEPT_MAX, max_concurrency // KEPT_SHARE) - self._kept.get(backend, 0))

    def _kept_extra(self, backend: Candidate, extra: int) -> None:
        """``extra`` slots of ``backend`` taken with an admission, to keep; beyond the room it has (a backend
        other than the one asked for was chosen), given back."""
        keep = min(extra, self._keep_room(backend.name, backend.max_concurrency))
        if keep:
            self._kept[backend.name] = self._kept.get(backend.name, 0) + keep
            self._kept_used[backend.name] = self.clock.monotonic()
        if extra > keep:
            self._queue_settle("_", 0, 0, backend.name, extra - keep, None)

    def _give_back_kept(self, backend: str) -> None:
        slots = self._kept.pop(backend, 0)
        if slots:
            self._queue_settle("_", 0, 0, backend, slots, None)

    # -- leases -------------------------------------------------------------------------------------------------
    def _lease(self, key: str, kind: str, limit: int, amount: int) -> None:
        lease = self._leases.get((key, kind))
        if lease is not None and lease[1] != limit:  # (the limit changed: what was leased under the old goes back)
            self._give_back_lease((key, kind))
            lease = None
        if lease is None:
            self._leases[(key, kind)] = [float(amount), float(limit), self.clock.monotonic()]
        else:
            lease[0] += amount
            lease[2] = self.clock.monotonic()

    def _give_back_lease(self, which: tuple[str, str]) -> None:
        lease = self._leases.pop(which, None)
        if lease is not None and int(lease[0]) > 0:
            key, kind = which
            self._queue_settle(key, int(lease[1]), -int(lease[0]), None, 0, None, bucket=kind)

    def leased(self, key: str, kind: str = "requests") -> int:
        """What of ``key``'s requests (or tokens) per minute this replica holds leased for its next requests."""
        lease = self._leases.get((key, kind))
        return int(lease[0]) if lease is not None else 0

    def _wanted_message(self, candidates: Sequence[Candidate]) -> str:
        return "\0".join(c.name for c in candidates if c.max_concurrency)

    def _announce(self, channel: str, body: str) -> None:
        """Publish ``body``, sealed, on ``channel`` with the next commands sent, not waited for (a message lost
        costs at most a heartbeat: the replicas look again)."""
        self._pipeline.call("PUBLISH", channel, self._seal.seal(channel.encode(), body.encode())).add_done_callback(
            _consumed)

    def kept(self, backend: str) -> int:
        """The slots of ``backend`` this replica keeps for its next requests."""
        return self._kept.get(backend, 0)

    def settle(self, budget: Budget | None, tokens_delta: int, slot_backend: str | None, *,
               key_place: bool = False) -> None:
        """In the background: the tokens used beyond (or below) the reservation, the backend's slot given back,
        and (``key_place``) the key's in-flight place."""
        tpm = (budget.tokens_per_minute or 0) if budget is not None else 0
        key_place = key_place and budget is not None
        if tpm and budget is not None:  # (a moving average: how much more than reserved a request really uses)
            over = self._overuse.get(budget.key, 0.0)
            self._overuse[budget.key] = over + (max(0, tokens_delta) - over) / 8
        if tpm and budget is not None and self.up:
            # settled against the key's lease of tokens when it has one: what the request used less goes back
            # to the lease (and with it, unused, to the bucket), what it used more comes out of it
            lease = self._leases.get((budget.key, "tokens"))
            if lease is not None and lease[1] == tpm:
                if tokens_delta and lease[0] >= tokens_delta:
                    lease[0] -= tokens_delta
                    tokens_delta = 0
                reserve = self._reserves.get(budget.key, 0)
                if lease[0] < LEASE_LOW * self._unit(budget.key, reserve):  # (drained by what was used beyond)
                    self._top_up(budget.key, budget.requests_per_minute or 0, tpm, reserve)
        if not (tpm and tokens_delta) and slot_backend is None and not key_place:
            return
        released = 0
        if slot_backend is not None:
            self._held[slot_backend] = max(0, self._held.get(slot_backend, 0) - 1)
            released = 0 if self._keep(slot_backend) else 1
        place = None
        if key_place:
            place = key_place_of(budget.key if budget is not None else "_")
            self._held[place] = max(0, self._held.get(place, 0) - 1)
        if not (tpm and tokens_delta) and not released and place is None:
            return  # (the slot is kept: nothing to tell Redis)
        self._queue_settle(budget.key if budget is not None else "_", tpm, tokens_delta if tpm else 0,
                           slot_backend, released, place)

    def _queue_settle(self, key: str, tpm: int, tokens_delta: int, slot_backend: str | None, slots: int,
                      place: str | None, bucket: str = "tokens") -> None:
        self._settlements += 1
        keys = [self._bucket(key, bucket), self._inflight(slot_backend or "_"),
                f"{self.settings.prefix}settled:{self.replica}:{self._settlements}", self._inflight(place or "_")]
        # (the free-slot message is sealed as it is sent: see _settle_batch)
        args = [self.replica, tpm, tokens_delta, str(slots), self._freed_channel, slot_backend or "",
                "1" if place is not None else "0"]
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((self._epoch, keys, args))
        if not self._draining:
            self._spawn(self._drain())

    async def _drain(self) -> None:
        """Send the waiting settlements, all that wait in one pipelined round trip at a time, in order; one
        drain at a time. A batch that fails is sent again later (settlements are idempotent)."""
        if self._draining:
            return
        self._draining = True
        try:
            while self._pending and self.up:
                batch = list(self._pending)
                try:
                    await self._lag.wait(self._settle_batch(batch), self._timeout * 5)
                except self._errors as exc:
                    self._failed("settle", exc)
                    return  # the heartbeat drains the rest once Redis answers
                for _ in batch:
                    self._pending.popleft()
        finally:
            self._draining = False

    async def _settle_batch(self, batch: list[tuple[int, list[str], list[Any]]]) -> None:
        """Send ``batch``; raises if it must be sent again (Redis unreachable). One that Redis refuses with an
        error reply (its keys hold what the script cannot read) never applies: it is counted and dropped."""
        freed = self._freed_channel.encode()
        todo = []
        for epoch, keys, args in batch:
            if epoch != self._epoch:
                # queued before the latest resync, which wrote this replica's counts without what it gives back:
                # only its tokens are still to settle
                args = [*args[:3], "0", args[4], "", "0"]
            elif args[3] != "0":
                args = [*args[:5], self._seal.seal(freed, args[5].encode()), *args[6:]]
            todo.append((keys, args))
        sha = self._shas.get("settle")
        if sha is None:
            sha = self._shas["settle"] = await self._redis.script_load(scripts.SETTLE)
        for attempt in (1, 2):
            pipe = self._redis.pipeline(transaction=False)
            for keys, args in todo:
                pipe.evalsha(sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
            # (Redis restarted: those did not run, its script cache is empty)
            todo = [sent for sent, reply in zip(todo, replies, strict=True) if isinstance(reply, self._no_script)]
            for reply in replies:
                if isinstance(reply, self._refused) and not isinstance(reply, self._no_script):
                    self._failed_alone("settle", reply)
            if not todo:
                return
            if attempt == 2:
                raise self._no_script("the settlement script is missing after it was loaded")
            sha = self._shas["settle"] = await self._redis.script_load(scripts.SETTLE)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def holds(self, backend: str) -> int:
        return self._held.get(backend, 0)

    def remote_in_flight(self, backend: str) -> int:
        """The slots of ``backend`` the other replicas hold, as the last heartbeat read them (0 while Redis is
        down)."""
        return self.remote.get(backend, 0) if self.up else 0

    def on_freed(self, callback: Callable[[str], None]) -> None:
        """``callback(backend)`` when another replica frees a slot (``"*"``: any backend, a replica left)."""
        self._on_freed.append(callback)

    # -- peers --------------------------------------------------------------------------------------------------
    def publish(self, topic: str, payload: Any) -> None:
        """Send ``payload`` (msgpack-able) to the other replicas' ``topic`` handlers, batched; nothing while
        this replica is the only one (as the last heartbeat counted)."""
        if not self._tasks or self.replicas <= 1:
            return
        self._outbox.append((topic, payload))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(PUBLISH_INTERVAL, self._schedule_flush)

    def subscribe(self, topic: str, handler: Callable[[Any], None]) -> None:
        self._handlers.setdefault(topic, []).append(handler)

    def _schedule_flush(self) -> None:
        self._flush_scheduled = False
        self._spawn(self._flush())

    async def _flush(self) -> None:
        async with self._flushing:  # (one at a time: the others take a message older than the last for a replay)
            if not self._outbox:
                return
            batch, self._outbox = self._outbox, []
            if not self.up:
                return  # (routing is local while Redis is down: the others will learn from their own requests)
            message = self._seal.seal(self._peers_channel.encode(), msgpack.packb(batch))
            try:
                await self._lag.wait(self._redis.publish(self._peers_channel, message), self._timeout * 5)
            except self._errors as exc:
                self._failed("publish", exc)

    async def _subscribe_loop(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                self._seal.listening()  # (what was sealed before this subscription is a copy when it comes)
                await pubsub.subscribe(self._peers_channel, self._freed_channel, self._wanted_channel)
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except self._errors as exc:
                self._failed("subscribe", exc)
            except Exception as exc:
                log.exception("shared state subscriber failed")
                self._failed("subscribe", exc)
            finally:
                with contextlib.suppress(*self._errors):
                    await asyncio.wait_for(pubsub.aclose(), 1.0)  # type: ignore[no-untyped-call, unused-ignore]
            await self.clock.sleep(self.settings.heartbeat_seconds)

    async def _listen(self, pubsub: Any) -> None:
        """Hand on what comes on the subscription; while nothing comes for a heartbeat, PING it: answered by
        nothing for two more, its connection is dead (a half-open flow after a partition or a proxy's restart
        is never closed by the kernel: the replica stayed deaf to the others' messages until it restarted,
        sweep 17), and the subscriber connects afresh."""
        beat = self.settings.heartbeat_seconds
        heard = self.clock.monotonic()
        while True:
            message = await pubsub.get_message(timeout=beat)
            now = self.clock.monotonic()
            if message is not None:
                heard = now
                if message.get("type") == "message":
                    try:
                        self._received(message)
                    except Exception:  # (a message that is not one must not end the subscriber)
                        self._reject("malformed", message.get("channel"))
                continue
            if now - heard > 3 * beat + 5 * self._timeout:
                raise ConnectionError("the subscription answered no PING")
            await pubsub.ping()

    def _received(self, message: dict[str, Any]) -> None:
        """A message another replica published: applied if its seal holds (:mod:`gateway.state.sealing`), else
        dropped and counted. Its own are skipped unread (its own release woke its own waiters already)."""
        channel, data = message.get("channel"), message.get("data")
        if not isinstance(channel, bytes) or not isinstance(data, bytes) or data.startswith(self._sender):
            return
        name = self._channels.get(channel)
        if name is None:
            return
        try:
            body = self._seal.open(channel, data, ordered=name == self._peers_channel).body
        except Rejected as rejected:
            self._reject(rejected.reason, channel)
            return
        if name == self._freed_channel:
            backend = body.decode("utf-8", "replace")
            for callback in self._on_freed:
                callback(backend)
            return
        if name == self._wanted_channel:
            now = self.clock.monotonic()
            for backend in body.decode("utf-8", "replace").split("\0"):
                self._wanted[backend] = now
                self._give_back_kept(backend)
            return
        try:
            batch = msgpack.unpackb(body)
        except (ValueError, TypeError, msgpack.UnpackException):
            self._reject("malformed", channel)
            return
        for topic, payload in batch:
            for handler in self._handlers.get(topic, ()):
                try:
                    handler(payload)
                except Exception:  # a malformed message must not end the subscriber
                    log.debug("peer message on %s failed", topic, exc_info=True)

    def _reject(self, reason: str, channel: object) -> None:
        """A message dropped (see :data:`gateway.state.sealing.REASONS`): counted, and logged at most once a
        minute."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        now = self.clock.monotonic()
        if now - self._last_reject_log >= 60:
            self._last_reject_log = now
            shown = channel.decode("utf-8", "replace") if isinstance(channel, bytes) else channel
            log.warning("shared state: dropped a message on %s (%s): one sealed with another secret (a replica "
                        "whose state.secret_env, Redis password or API keys differ), a clock over %d s off, or "
                        "someone else publishing to this Redis", shown, reason, int(WINDOW))

    # -- drained backends ---------------------------------------------------------------------------------------
    def on_drained(self, callback: Callable[[str, bool], None]) -> None:
        """``callback(backend, drained)`` when the shared set of drained backends changes (another replica drained
        or undrained one): read at once when a replica says it changed it, and by every heartbeat (so a replica
        that starts later, or missed the message, learns it too). Only the set is the truth: a message applies
        nothing of its own, so one replayed, or one whose write Redis refused, drains nothing, and no change a
        replica applies outlasts the set."""
        if not self._on_drained:
            self.subscribe("drain", self._drain_heard)
        self._on_drained.append(callback)

    def _drain_heard(self, _payload: Any) -> None:
        """A replica changed the drained set (the message's own ``[backend, drained]`` is for the replicas of the
        versions before, which apply it): read it now, once for any number of messages heard meanwhile."""
        self._drained_due = True
        if not self._drained_rereading:
            self._drained_rereading = True
            self._spawn(self._reread_drained())

    async def _reread_drained(self) -> None:
        try:
            while self._drained_due:
                self._drained_due = False
                try:
                    await self._read_drained()
                except self._errors as exc:  # (the heartbeat reads it again, and decides whether Redis is down)
                    self._failed_alone("drain", exc)
                    return
        finally:
            self._drained_rereading = False

    def set_drained(self, backend: str, drained: bool) -> None:
        """Record an operator's drain (or undrain) of ``backend`` for every replica, in the background: written to
        the shared set, then the other replicas are told to read it (while Redis is down, or refuses the write,
        it stays this replica's alone, and a line is logged)."""

        async def write() -> None:
            try:
                pipe = self._redis.pipeline(transaction=False)
                (pipe.sadd if drained else pipe.srem)(self._drained_key, backend)
                pipe.set(self._drained_mark, "1")
                await self._lag.wait(pipe.execute(), self._timeout * 5)
                # taken as read here, between two reads (the lock): else a read that came before it is this
                # replica's last, and another replica's undrain of the backend, read next, changes nothing from it
                # (the test of replicas saw a backend this replica drained stay drained after another undrained it)
                async with self._drained_reading:
                    if self._drained_read is not None:
                        (self._drained_read.add if drained else self._drained_read.discard)(backend)
                self.publish("drain", [backend, drained])
            except self._errors as exc:
                self._failed("drain", exc)
                log.warning("shared state: the %s of backend %s holds on this replica only (%s)",
                            "drain" if drained else "undrain", backend, exc)
            finally:
                left = self._drain_writes.pop(backend, 1) - 1
                if left:
                    self._drain_writes[backend] = left

        self._drain_writes[backend] = self._drain_writes.get(backend, 0) + 1
        self._spawn(write())

    async def _read_drained(self) -> None:
        async with self._drained_reading:  # (one read at a time: an older read's answer never follows a newer's)
            await self._read_drained_once()

    async def _read_drained_once(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(self._drained_mark)
        pipe.smembers(self._drained_key)
        marked, members = await self._lag.wait(pipe.execute(raise_on_error=False), self._timeout * 5)
        if isinstance(members, self._refused):  # (not a set: garbage, replaced by what this replica read last)
            self._failed_alone("drain", members)
            await self._lag.wait(self._redis.delete(self._drained_key), self._timeout * 5)
            marked, members = False, set()
        now = {m.decode("utf-8", "replace") if isinstance(m, bytes) else str(m) for m in members}
        before = self._drained_read
        if not marked and before is not None:
            # Redis lost what it held (or no drain was ever written): the set this replica read last is the truth,
            # written back, not an undrain of every backend (QA saw a restarted Redis undo a drain, and replicas
            # then disagree). A drain or undrain since writes the mark, and is read as it is. A replica with no
            # earlier read knows nothing to write back, and leaves the mark to those that do.
            known = sorted(before)
            pipe = self._redis.pipeline(transaction=False)
            if known:
                pipe.sadd(self._drained_key, *known)
            pipe.set(self._drained_mark, "1")
            await self._lag.wait(pipe.execute(), self._timeout * 5)
            if known:
                log.warning("shared state: Redis had lost the drained backends; written back: %s", ", ".join(known))
            now |= set(known)
        # only what changed in the shared set since the last read, and not for a backend this replica is writing:
        # its own drain or undrain still on its way to Redis is not undone by a read that predates it. Such a
        # change is not taken as read either: the next read finds it again (taken as read, another replica's
        # undrain that came while this one's drain was on its way left the backend drained here for good)
        changes = [(b, True) for b in sorted(now - (before or set()))]
        if before is not None:
            changes += [(b, False) for b in sorted(before - now)]
        kept = set(now)
        for backend, drained in changes:
            if backend in self._drain_writes:
                (kept.discard if drained else kept.add)(backend)
                continue
            for callback in self._on_drained:
                callback(backend, drained)
        self._drained_read = kept

    # -- heartbeat ----------------------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        while True:
            await self.clock.sleep(self.settings.heartbeat_seconds)
            try:
                await self._heartbeat()
            except Exception as exc:  # the loop must outlive anything one heartbeat meets
                log.exception("shared state heartbeat failed")
                self._failed("heartbeat", exc)

    async def _heartbeat(self) -> None:
        """Renew this replica, reap the silent ones, read the others' slot counts; after a failure, write its
        own counts afresh and send the settlements that waited."""
        now = self.clock.monotonic()
        for backend in [b for b, n in self._kept.items() if n]:
            if now - self._kept_used.get(backend, 0.0) >= self.settings.heartbeat_seconds:
                self._give_back_kept(backend)  # unused for a heartbeat
        for which in [w for w, lease in self._leases.items() if now - lease[2] >= self.settings.heartbeat_seconds]:
            self._give_back_lease(which)  # (likewise)
        self._seal.forget_old()
        slotted = sorted(self.slotted())
        keys = [self._replicas_key, *(self._inflight(b) for b in slotted)]
        resync = self._needs_resync
        if resync:
            # what was queued or sent before now is in the counts this writes: see _settle_batch, admit_remote
            self._epoch += 1
        args = [self.replica, int(1000 * self.settings.replica_ttl_seconds), self._freed_channel,
                self._seal.seal(self._freed_channel.encode(), b"*"), "1" if resync else "0",
                *(self._held.get(b, 0) + self._kept.get(b, 0) for b in slotted)]
        try:
            dead, alive, others = await self._lag.wait(self._script("heartbeat", scripts.HEARTBEAT, keys, args),
                                                         self._timeout * 5)
            self.replicas = int(alive)
            for backend, count in zip(slotted, others, strict=True):
                self.remote[backend] = int(count)
            if self._on_drained:
                await self._read_drained()
        except self._errors as exc:
            if isinstance(exc, TimeoutError) and self._fast is not None and not self._checking_fast:
                self._checking_fast = True
                self._spawn(self._check_fast(self._fast))
            self._failed("heartbeat", exc)
            return
        if dead:  # (the others hear of the slots it freed on the channel; its own waiters, deaf to its own, here)
            for callback in self._on_freed:
                callback("*")
        if resync:
            self._needs_resync = False
        if not self.up:
            self.up = True
            log.info("shared state (Redis) reachable at %s", redact_url(self.settings.url or ""))
            self._spawn(self._check_eviction())
        if self._pending:
            await self._drain()
        self.beats += 1

    async def _check_fast(self, fast: RespConnection) -> None:
        """The heartbeat met no answer on the admissions' connection. Redis may be stalled (stopped, forking, a
        slow script): its answers will come, and what they took is given back when they do (see ``late``), so
        the connection is kept. Or the flow is dead while Redis answers a new one (a half-open connection: a
        proxy in front of Redis whose upstream died, a partition), which the kernel does not close for ~15 min:
        every admission and heartbeat timed out on it for as long, the state down, every limit lifted or every
        limited key refused (sweep 16). Told apart by asking Redis on another connection: when it answers there
        and this one still answers nothing a heartbeat's timeout later, this one is dropped (the next command
        connects afresh)."""
        try:
            replies, owed = fast.replies, len(fast.waiting)
            if not owed:
                return
            await self._lag.wait(self._redis.ping(), self._timeout * 5)
            await self.clock.sleep(self._timeout * 5)
            if fast.replies == replies and fast.waiting:
                log.warning("shared state: Redis answers, but not on the admissions' connection: it is dropped")
                fast.broken(ConnectionError("Redis answered other connections but not this one"))
        except self._errors:
            return  # (Redis answers no one: stalled, or gone; the heartbeat goes on asking)
        finally:
            self._checking_fast = False

    async def _check_eviction(self) -> None:
        """Warn when Redis may evict any key (``maxmemory-policy allkeys-*``): a key's bucket (its debt forgiven)
        or a backend's in-flight counts. Said at start and each time Redis answers again; nothing when Redis
        does not let its configuration be read (a managed Redis often refuses CONFIG)."""
        try:
            reply = await self._lag.wait(self._redis.config_get("maxmemory-policy"), self._timeout * 5)
        except self._errors:
            return
        policy = next(iter(reply.values()), b"") if isinstance(reply, dict) else b""
        policy = policy.decode("utf-8", "replace") if isinstance(policy, bytes) else str(policy)
        if policy.startswith("allkeys-"):
            log.warning("shared state: Redis evicts any key when it is full (maxmemory-policy %s): it may evict a "
                        "key's token bucket (its debt forgiven) or a backend's in-flight count (its max_concurrency "
                        "then exceeded); use volatile-lru or noeviction (docs/scaling.md)", policy)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
