"""Stored ``/v1/responses`` conversations in Redis, for every replica: bounded in all and per API key, bound to
the key that made them, and never able to take the shared state down.

* **Bound to their key**: a response is kept under a name that holds its owner (the API key's name; "" when
  auth is off), so another key asking for the same id reads a name that does not exist: exactly what an
  unknown id reads.
* **Bounded**: one atomic script (:data:`PUT`) keeps the books (an order of every response by expiry, one per
  key, each one's counted size) and, before a response is written, forgets the key's own oldest while the key
  is past its bound, then the oldest of all while the store is. A response is counted as its JSON, its names
  (each is held four times: the value's key, two orders, the sizes) and :data:`ENTRY_OVERHEAD`, what Redis
  spends on an entry beyond them (measured: ``tests/state/test_stored_responses.py``), so the bound in bytes is
  what they hold of Redis's memory. The values keep their TTL; the books carry none (they are bounded by the
  entries), and forget what expired at the next write.
* **Failing alone**: a read or write that fails (Redis refuses writes past its ``maxmemory``, or is slow) fails
  that read or write only: counted in ``gateway_state_errors_total``, logged at most once a minute, never the
  state's *down* (the heartbeat alone decides that). A value Redis evicted (``volatile-lru``: values carry a
  TTL) reads as unknown, and stays counted until the books forget it, which only makes the bound stricter.
* **Repaired, as the limits' keys are**: garbage in the books (a usage that is a string, a figure that is no
  whole number or below zero, an order of another type) is repaired by the next write, never an error that
  fails every later write of every key on every replica until someone deletes it by hand (see :data:`PUT`).

The script declares itself (``#!lua``) without ``allow-oom``: Redis refuses it whole while past ``maxmemory``,
so the books are never left half-written. It names keys it is not given (the forgotten responses and their
keys' orders), which a standalone Redis or Valkey allows, as the gateway uses them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config import ResponsesSettings
from gateway.state.errors import StateUnavailable
from gateway.state.sealing import PUBLIC, open_value, seal_value

if TYPE_CHECKING:
    import redis.asyncio

# writes on their way at once: a burst of stored responses leaves the other pooled connections to the limits
WRITERS = 4
WAITING_MAX = 1024  # responses waiting to be written, at most (beyond, a write fails alone) ...
WAITING_BYTES = 64 * 1024 * 1024  # ... and their bytes
# what Redis holds per stored response beyond its value and its four names (measured, Redis 7.0: ~500), and per
# key with stored responses (its order: ~900)
log = logging.getLogger("gateway.state")

ENTRY_OVERHEAD = 768
OWNER_OVERHEAD = 1024


@dataclass(frozen=True, slots=True)
class StoreBounds:
    """How many responses, and how many bytes of them, are kept in all and per API key, and for how long. The
    owner "" (auth off: every response is one owner's) is bounded by the store's bounds alone."""

    entries: int = 10_000
    max_bytes: int = 256 * 1024 * 1024
    entries_per_key: int = 1_000
    bytes_per_key: int = 32 * 1024 * 1024
    ttl_seconds: float = 3600.0

    @classmethod
    def of(cls, settings: ResponsesSettings) -> StoreBounds:
        return cls(settings.store_entries, settings.store_bytes, settings.store_entries_per_key,
                   settings.store_bytes_per_key, settings.store_ttl_seconds)

    def of_owner(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) one owner may hold."""
        if not owner:
            return self.entries, self.max_bytes
        return min(self.entries, self.entries_per_key), min(self.max_bytes, self.bytes_per_key)


# PUT: keep a response, within the bounds.
#   KEYS[1] the response's value, KEYS[2] the order of all (score: expiry, ms), KEYS[3] the owner's order,
#   KEYS[4] the sizes (hash: value key -> "size:owner"), KEYS[5] the usage (hash: "*" -> bytes of all,
#   "o<owner>" -> the owner's)
#   ARGV[1] the value, ARGV[2] its counted size, ARGV[3] TTL ms, ARGV[4] most entries, ARGV[5] most bytes,
#   ARGV[6] the owner's most entries, ARGV[7] its most bytes, ARGV[8] the owner, ARGV[9] the owners' orders'
#   prefix (+ owner: that owner's order), ARGV[10] what an owner's order costs (counted in all while it has any),
#   ARGV[11] the values' prefix (+ the owner's length, ":", the owner, ":", the id: a value's key)
# Returns 1 (kept) or 0 (larger than a bound on its own: not kept).
# Garbage in the books (anyone who can reach Redis may write it) is repaired, never an error that fails every
# later write: a usage figure that is not a whole number (or the usage of another type) is counted again from the
# sizes; a size that is not one forgets its response; the orders or the sizes of another type forget every
# response the books still name (what they were counted is lost with them).
PUT = """#!lua
local now_t = redis.call('TIME')
local now = now_t[1] * 1000 + math.floor(now_t[2] / 1000)
local order, mine, sizes, usage = KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local size, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local owner, owners, cost, values = ARGV[8], ARGV[9], tonumber(ARGV[10]), ARGV[11]
local broken = false  -- (a usage figure was garbage, or went below 0: they are counted again)
local function is(key, kind)
  local t = redis.call('TYPE', key)['ok']
  return t == 'none' or t == kind
end
local function whole(v)  -- a count, as HINCRBY reads one; nil for anything else
  if type(v) ~= 'string' or #v > 15 or not string.match(v, '^%d+$') then return nil end
  return tonumber(v)
end
local function entry(e)  -- a sizes entry's size and owner; nil for garbage
  local n, who = string.match(e, '^(%d+):(.*)$')
  if whole(n) == nil then return nil end
  return tonumber(n), who
end
local function owner_of(member)  -- the owner a value's key names (its length first); nil for any other key
  if string.sub(member, 1, #values) ~= values then return nil end
  local len, rest = string.match(string.sub(member, #values + 1), '^(%d+):(.*)$')
  if whole(len) == nil then return nil end
  return string.sub(rest, 1, tonumber(len))
end
local function drop(member)  -- (only a value's key: garbage in an order names no other key to delete)
  if string.sub(member, 1, #values) == values then redis.call('DEL', member) end
end
local function bump(field, by)
  local r = redis.pcall('HINCRBY', usage, field, by)
  if type(r) == 'table' and r.err then broken = true return 0 end
  if r < 0 then broken = true end
  return r
end
local function recount()  -- the usage again from the sizes; a response whose size is garbage is forgotten
  redis.call('DEL', usage)
  local all, per = 0, {}
  local entries = redis.call('HGETALL', sizes)
  for i = 1, #entries, 2 do
    local n, who = entry(entries[i + 1])
    if n == nil then
      redis.call('HDEL', sizes, entries[i])
      redis.call('ZREM', order, entries[i])
      drop(entries[i])
    else
      if per[who] == nil then all = all + cost end
      per[who] = (per[who] or 0) + n
      all = all + n
    end
  end
  for who, n in pairs(per) do redis.call('HSET', usage, 'o' .. who, n) end
  if all > 0 then redis.call('HSET', usage, '*', all) end
  broken = false
end
local function forget(member)
  redis.call('ZREM', order, member)
  drop(member)
  local known = redis.call('HGET', sizes, member)
  if known then
    local n, who = entry(known)
    redis.call('HDEL', sizes, member)
    if n == nil then broken = true return end
    redis.call('ZREM', owners .. who, member)
    if redis.call('EXISTS', owners .. who) == 0 then bump('*', -cost) end
    bump('*', -n)
    if bump('o' .. who, -n) <= 0 then redis.call('HDEL', usage, 'o' .. who) end
  end
end
if not (is(order, 'zset') and is(sizes, 'hash')) then  -- the books lost: every response they still name goes
  local named = is(order, 'zset') and redis.call('ZRANGE', order, 0, -1) or {}
  if is(sizes, 'hash') then
    for _, member in ipairs(redis.call('HKEYS', sizes)) do table.insert(named, member) end
  end
  for _, member in ipairs(named) do
    local who = owner_of(member)
    if who ~= nil then redis.call('DEL', member, owners .. who) end
  end
  redis.call('DEL', order, sizes, usage, mine)
elseif not is(mine, 'zset') then  -- the owner's order lost: the owner's responses go
  redis.call('DEL', mine)
  local entries = redis.call('HGETALL', sizes)
  for i = 1, #entries, 2 do
    local _, who = entry(entries[i + 1])
    if who == owner then forget(entries[i]) end
  end
  broken = true
end
if not is(usage, 'hash') then
  redis.call('DEL', usage)
  broken = true
else
  local figures = redis.call('HMGET', usage, '*', 'o' .. owner)
  if (figures[1] and not whole(figures[1])) or (figures[2] and not whole(figures[2]))
     or (not figures[1] and redis.call('HLEN', sizes) > 0) then broken = true end
end
if broken then recount() end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', order, '-inf', now, 'LIMIT', 0, 64)) do forget(member) end
if redis.call('HEXISTS', sizes, KEYS[1]) == 1 then forget(KEYS[1]) end
if broken then recount() end
if size + cost > tonumber(ARGV[5]) or size > tonumber(ARGV[7]) then return 0 end
while true do  -- the owner's own oldest first
  local n = redis.call('ZCARD', mine)
  if n == 0 then redis.call('HDEL', usage, 'o' .. owner) break end
  if n < tonumber(ARGV[6]) and tonumber(redis.call('HGET', usage, 'o' .. owner) or '0') + size <= tonumber(ARGV[7])
  then break end
  local oldest = redis.call('ZRANGE', mine, 0, 0)[1]
  forget(oldest)
  redis.call('ZREM', mine, oldest)
  if broken then recount() end
end
local new
while true do  -- then everyone's oldest
  new = redis.call('EXISTS', mine) == 0  -- (a new owner's order costs besides)
  local n = redis.call('ZCARD', order)
  if n == 0 then redis.call('DEL', usage) break end
  if n < tonumber(ARGV[4]) and tonumber(redis.call('HGET', usage, '*') or '0') + size + (new and cost or 0)
     <= tonumber(ARGV[5]) then break end
  forget(redis.call('ZRANGE', order, 0, 0)[1])
  if broken then recount() end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', order, now + ttl, KEYS[1])
redis.call('ZADD', mine, now + ttl, KEYS[1])
redis.call('HSET', sizes, KEYS[1], size .. ':' .. owner)
bump('*', size + (new and cost or 0))
bump('o' .. owner, size)
if broken then recount() end
return 1
"""


class StoredResponses:
    """The shared copy of the stored responses (one per :class:`~gateway.state.SharedState`). ``failed(operation,
    exc)`` counts and logs a failure without taking the state down; ``spawn`` runs the writers in the
    background. Writes are sent by at most :data:`WRITERS` at once, in order; what waits is bounded."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str, timeout: float,
                 errors: tuple[type[BaseException], ...], failed: Callable[[str, BaseException], None],
                 spawn: Callable[[Coroutine[Any, Any, None]], None], secret: bytes = PUBLIC) -> None:
        self._redis = client
        # (each value is sealed with the replicas' secret: whoever could write to Redis rewrote a tenant's kept
        # conversation, and the next replica sent the engine that text as the tenant's own history, sweep 24)
        self._secret = secret
        self._prefix = prefix
        self._timeout = timeout
        self._errors = errors
        self._failed = failed
        self._spawn = spawn
        self._put = client.register_script(PUT)  # (EVALSHA, loading it again after Redis restarted)
        self._order = f"{prefix}responses:order"
        self._owners = f"{prefix}responses:key:"
        self._sizes = f"{prefix}responses:sizes"
        self._usage = f"{prefix}responses:usage"
        self._values = f"{prefix}response:"
        self._waiting: deque[tuple[list[str], list[bytes | str | int], int]] = deque()
        self._waiting_bytes = 0
        self._writers = 0

    def name(self, owner: str, response_id: str) -> str:
        """The value's key: the owner's name, length first (a name may hold any character), then the id."""
        return f"{self._values}{len(owner)}:{owner}:{response_id}"

    def counted(self, owner: str, response_id: str, raw: bytes) -> int:
        """What a response is counted in Redis: its value, its names, and the cost of an entry."""
        # (a value is held in the allocator's next size class: up to a quarter more)
        return len(raw) * 5 // 4 + 4 * len(self.name(owner, response_id)) + len(owner) + ENTRY_OVERHEAD

    async def get_response(self, owner: str, response_id: str) -> bytes | None:
        """``owner``'s stored conversation (its JSON), None when unknown, expired or another owner's; raises
        StateUnavailable when Redis cannot answer."""
        try:
            async with asyncio.timeout(self._timeout):
                raw = await self._redis.get(self.name(owner, response_id))
        except self._errors as exc:
            self._failed("get_response", exc)
            raise StateUnavailable(str(exc)) from None
        if not isinstance(raw, bytes):
            return None
        value = open_value(self._secret, self.name(owner, response_id), raw)
        if value is None:
            log.warning("a stored response's seal does not hold (written by another hand, or before sealing, or "
                        "with another secret): taken as unknown")
        return value

    def put_response(self, owner: str, response_id: str, raw: bytes, bounds: StoreBounds) -> None:
        """Keep ``owner``'s conversation (its JSON) within ``bounds``, in the background."""
        key_entries, key_bytes = bounds.of_owner(owner)
        keys = [self.name(owner, response_id), self._order, self._owners + owner, self._sizes, self._usage]
        args: list[bytes | str | int] = [
            seal_value(self._secret, keys[0], raw), self.counted(owner, response_id, raw),
            max(1, int(bounds.ttl_seconds * 1000)), bounds.entries,
            bounds.max_bytes, key_entries, key_bytes, owner, self._owners, OWNER_OVERHEAD, self._values]

        if len(self._waiting) >= WAITING_MAX or self._waiting_bytes + len(raw) > WAITING_BYTES:
            self._failed("put_response", OverflowError("too many stored responses wait to be written to Redis"))
            return
        self._waiting.append((keys, args, len(raw)))
        self._waiting_bytes += len(raw)
        if self._writers < WRITERS:
            self._writers += 1
            self._spawn(self._write())

    async def _write(self) -> None:
        """Write what waits, one at a time (one of at most WRITERS doing so)."""
        try:
            while self._waiting:
                keys, args, size = self._waiting.popleft()
                self._waiting_bytes -= size
                try:
                    async with asyncio.timeout(self._timeout):
                        await self._put(keys=keys, args=args)
                except self._errors as exc:
                    self._failed("put_response", exc)
        finally:
            self._writers -= 1
