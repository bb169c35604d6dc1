"""The Lua scripts the shared state runs in Redis: each is one atomic step, one round trip.

Token buckets are hashes ``{l: level, t: updated (ms, Redis's clock)}`` refilled continuously at
``capacity / 60 s``. They carry no TTL (each write PERSISTs one an older gateway set): a bucket in debt keeps
its debt until it has refilled, however long that takes (an expiry used to forgive a key's overrun after two
minutes), and Redis's ``volatile-*`` eviction never picks one (what it may evict carries a TTL: stored
responses, settlements' ids). There is one per limited API key and kind. In-flight
counts of a backend with a ``max_concurrency`` are a hash per backend, one field per replica (the slots it
holds: in flight there, or kept free for its next request, see ``SharedState``), so a replica that dies can be
reaped field by field. A replica that finds a backend full says so on the *wanted* channel, and the others
give back the slots they keep.

Redis holds strings, and anyone who can reach it may have written any of them: every script reads a number with
``num`` (anything not a finite number is none), and a key of another type than the script expects (a bucket set
as a string, an in-flight hash as a list) is garbage it deletes and reads as empty. So one corrupt key repairs
itself (a bucket as full, a count as nothing) and fails no other key's admission, and no script stops half-way
with an error after writing some of what it meant to (Redis does not roll a script back).

Every script here is declared ``allow-oom``: Redis runs it even past its ``maxmemory`` (under ``noeviction``, or
``volatile-*`` with nothing left to evict), so a Redis filled by other things never stops the limits. What they
write is small and bounded by the configuration (keys, backends, replicas), besides the settlements' ids, which
expire in two minutes. The flags need Redis 7 (or Valkey).
"""

from __future__ import annotations

_FLAGS = "#!lua flags=allow-oom\n"  # (first line of every script)

_ROBUST = """
local function num(x)
  local n = tonumber(x)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end
local function read(command, key, ...)
  local r = redis.pcall(command, key, ...)
  if type(r) == 'table' and r.err then
    redis.call('DEL', key)
    return redis.call(command, key, ...)
  end
  return r
end
local function held(key)
  local n = 0
  for _, v in ipairs(read('HVALS', key)) do n = n + math.max(0, num(v) or 0) end
  return n
end
local function add(key, field, by)
  local r = redis.pcall('HINCRBY', key, field, by)
  if type(r) == 'table' and r.err then
    read('HLEN', key)
    redis.call('HSET', key, field, math.max(0, by))
  elseif r < 0 then
    redis.call('HSET', key, field, 0)
  end
end
"""  # (num: a finite number or nil; read: a read that deletes a key of another type first; held: an in-flight
# hash's counts summed, garbage counting nothing; add: a replica's count changed, never below 0, garbage replaced)

_LEVEL = """
local now_t = redis.call('TIME')
local now = now_t[1] * 1000 + math.floor(now_t[2] / 1000)
local function level(key, cap)
  local b = read('HMGET', key, 'l', 't')
  local l, t = num(b[1]), num(b[2])
  if l == nil or t == nil then return cap end
  return math.min(cap, l + math.max(0, now - t) * cap / 60000)
end
local function wait(ms) return math.min(ms, 1e15) end
"""  # (Redis's clock in ms, and a bucket's level refilled to it: a bucket that holds no number is full)

# ADMIT: rate limits and a slot on the first candidate with one, all or nothing.
#   KEYS[1] requests bucket, KEYS[2] tokens bucket, KEYS[3] the key's in-flight hash,
#   KEYS[4..] each candidate's in-flight hash
#   ARGV[1] replica id, ARGV[2] requests per minute (0: none), ARGV[3] tokens per minute (0: none),
#   ARGV[4] tokens to reserve, ARGV[5] the key's max_in_flight (0: none),
#   ARGV[6] lease divisor (0: no lease), ARGV[7] the most requests leased at once, ARGV[8] the most tokens,
#   ARGV[9] the most slots to keep besides the request's own,
#   ARGV[10..] each candidate's max_concurrency (0: no limit, no slot taken)
# A lease: besides what the request takes, up to ARGV[7] more of the requests bucket's requests and ARGV[8] of
# the tokens bucket's tokens (never more than a bucket's level / ARGV[6]: none as it runs low, nor tokens
# fewer than this request reserved), for the replica's next requests to take without a round trip. Kept slots
# likewise: up to ARGV[9] more slots of the chosen candidate (never more than half of those still free after
# the request's own), for the replica to keep for its next requests.
# Returns {0, i, requests leased, tokens leased, slots kept}: admitted on candidate i (0-based); {1, ms} / {2, ms}:
# requests / tokens per minute exhausted, retry in ms; {3, 0}: every candidate is full (nothing was taken; the
# replica announces it on the wanted channel); {4, 0}: the key has max_in_flight requests in flight (nothing was
# taken).
ADMIT = _FLAGS + _ROBUST + _LEVEL + """
local rpm, tpm, reserve = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local rl, tl
if rpm > 0 then
  rl = level(KEYS[1], rpm)
  if rl < 1 then return {1, wait(math.ceil((1 - rl) * 60000 / rpm))} end
end
if tpm > 0 then
  tl = level(KEYS[2], tpm)
  if tl <= 0 then return {2, wait(math.ceil((1e-9 - tl) * 60000 / tpm) + 1)} end
end
local cap = tonumber(ARGV[5])
if cap > 0 and held(KEYS[3]) >= cap then return {4, 0} end
local chosen, kept = 0, 0
for i = 4, #KEYS do
  local limit = tonumber(ARGV[i + 6])
  if limit == 0 then chosen = i break end
  local total = held(KEYS[i])
  if total < limit then
    kept = math.max(0, math.min(tonumber(ARGV[9]), math.floor((limit - total - 1) / 2)))
    add(KEYS[i], ARGV[1], 1 + kept)
    chosen = i
    break
  end
end
if #KEYS > 3 and chosen == 0 then return {3, 0} end
if cap > 0 then add(KEYS[3], ARGV[1], 1) end
local divisor = tonumber(ARGV[6])
local leased, tleased = 0, 0
if rpm > 0 then
  if divisor > 0 then leased = math.max(0, math.min(tonumber(ARGV[7]), math.floor((rl - 1) / divisor))) end
  redis.call('HSET', KEYS[1], 'l', tostring(rl - 1 - leased), 't', now)
  redis.call('PERSIST', KEYS[1])
end
if tpm > 0 then
  if divisor > 0 then tleased = math.min(tonumber(ARGV[8]), math.floor((tl - reserve) / divisor)) end
  if tleased < math.max(1, reserve) then tleased = 0 end  -- (less than one such request's reservation: useless)
  redis.call('HSET', KEYS[2], 'l', tostring(tl - reserve - tleased), 't', now)
  redis.call('PERSIST', KEYS[2])
end
if chosen > 0 then return {0, chosen - 4, leased, tleased, kept} end
return {0, 0, leased, tleased, 0}
"""

# LEASE: a key's lease topped up ahead of need (the replica's lease ran low), no request of its own: up to ARGV[4]
# requests and ARGV[5] tokens, never more than a bucket's level / ARGV[3], nor tokens fewer than ARGV[6] (one
# reservation: fewer would be useless). Nothing is refused or taken but what is leased.
#   KEYS[1] requests bucket, KEYS[2] tokens bucket
#   ARGV[1] requests per minute (0: none), ARGV[2] tokens per minute (0: none), ARGV[3] lease divisor,
#   ARGV[4] the most requests, ARGV[5] the most tokens, ARGV[6] the fewest tokens worth leasing
# Returns {requests leased, tokens leased}.
LEASE = _FLAGS + _ROBUST + _LEVEL + """
local rpm, tpm, divisor = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local leased, tleased = 0, 0
if rpm > 0 then
  local rl = level(KEYS[1], rpm)
  leased = math.max(0, math.min(tonumber(ARGV[4]), math.floor(rl / divisor)))
  if leased > 0 then
    redis.call('HSET', KEYS[1], 'l', tostring(rl - leased), 't', now)
    redis.call('PERSIST', KEYS[1])
  end
end
if tpm > 0 then
  local tl = level(KEYS[2], tpm)
  tleased = math.max(0, math.min(tonumber(ARGV[5]), math.floor(tl / divisor)))
  if tleased < math.max(1, tonumber(ARGV[6])) then tleased = 0 end
  if tleased > 0 then
    redis.call('HSET', KEYS[2], 'l', tostring(tl - tleased), 't', now)
    redis.call('PERSIST', KEYS[2])
  end
end
return {leased, tleased}
"""

# ACQUIRE: a slot on one backend (a failover attempt), if it has one free.
#   KEYS[1] the backend's in-flight hash; ARGV[1] replica id, ARGV[2] its max_concurrency
# Returns 1 (taken) or 0 (full: the replica announces it on the wanted channel).
ACQUIRE = _FLAGS + _ROBUST + """
if held(KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
add(KEYS[1], ARGV[1], 1)
return 1
"""

# SETTLE: a finished request's tokens (the difference to what was reserved; negative gives back, never above
# the capacity; KEYS[1] may as well be a requests bucket, to give back unused leased requests) and slots given
# back (its own, or those a replica kept; announced on the free-slot channel so the replicas' waiters wake).
# Idempotent: a settlement is applied once whatever the retries (its id is remembered two minutes), so one sent
# again after a connection broke mid-way is not charged twice.
#   KEYS[1] tokens bucket, KEYS[2] in-flight hash, KEYS[3] the settlement's id key, KEYS[4] the key's
#   in-flight hash
#   ARGV[1] replica id, ARGV[2] tokens per minute (0: none), ARGV[3] tokens used - reserved,
#   ARGV[4] how many slots to give back, ARGV[5] the free-slot channel, ARGV[6] its message (sealed: the backend,
#   from the replica), ARGV[7] 1 to release the key's in-flight place
SETTLE = _FLAGS + _ROBUST + _LEVEL + """
if not redis.call('SET', KEYS[3], 1, 'NX', 'PX', 120000) then return 0 end
local tpm, delta = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and delta ~= 0 then
  redis.call('HSET', KEYS[1], 'l', tostring(math.min(tpm, level(KEYS[1], tpm) - delta)), 't', now)
  redis.call('PERSIST', KEYS[1])
end
local slots = tonumber(ARGV[4])
if slots > 0 then
  add(KEYS[2], ARGV[1], -slots)
  redis.call('PUBLISH', ARGV[5], ARGV[6])
end
if ARGV[7] == '1' then add(KEYS[4], ARGV[1], -1) end
return 1
"""

# HEARTBEAT: this replica is alive (now, Redis's clock); replicas silent past the TTL are forgotten and their
# slots freed. With ARGV[5] = 1 its own counts are written as they are (after Redis was unreachable, when
# some increments or decrements may have been lost). Then the counts the other replicas hold, per hash.
#   KEYS[1] replicas sorted set, KEYS[2..] every in-flight hash
#   ARGV[1] replica id, ARGV[2] TTL ms, ARGV[3] the free-slot channel, ARGV[4] the message a reap announces there
#   (sealed: any backend), ARGV[5] 1: resync, ARGV[6..] own count per hash
# Returns {the replicas it reaped, how many replicas are alive, {the others' count per hash}}.
HEARTBEAT = _FLAGS + _ROBUST + """
local now_t = redis.call('TIME')
local now = now_t[1] * 1000 + math.floor(now_t[2] / 1000)
read('ZCARD', KEYS[1])
redis.call('ZADD', KEYS[1], now, ARGV[1])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
local freed = false
for _, replica in ipairs(dead) do
  redis.call('ZREM', KEYS[1], replica)
  for i = 2, #KEYS do
    if read('HDEL', KEYS[i], replica) > 0 then freed = true end
  end
end
if freed then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
local others = {}
for i = 2, #KEYS do
  if ARGV[5] == '1' then
    read('HLEN', KEYS[i])
    redis.call('HSET', KEYS[i], ARGV[1], ARGV[i + 4])
  end
  local n = 0
  local fields = read('HGETALL', KEYS[i])
  for j = 1, #fields, 2 do
    if fields[j] ~= ARGV[1] then n = n + math.max(0, num(fields[j + 1]) or 0) end
  end
  others[i - 1] = math.floor(n)
end
return {dead, redis.call('ZCARD', KEYS[1]), others}
"""
