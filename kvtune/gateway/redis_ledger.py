"""One block ledger shared by every gateway replica, kept in Redis: exact, atomic, lease-protected.

Every mutation is one Lua script run server-side with EVALSHA (loaded with SCRIPT LOAD, reloaded
on NOSCRIPT, as after a Redis restart), so the check "reserved + blocks <= budget" and the add are
one step no other replica can interleave with: two gateways cannot over-admit in a race.

Keys, all under `key_prefix` (P); for Redis Cluster put a hash tag in it ("{kvtune}") so they
share one slot:
    P:owners        ZSET  owner -> when it is reclaimed: its lease deadline + reclaim_grace_s, in ms
                          of the Redis server's clock (TIME)
    P:res:<owner>   HASH  reservation id -> "<blocks> <upstream>", the reservations one owner holds
    P:void:<owner>  ZSET  reservation id -> ms: ids given up on (below), refused if their reserve
                          arrives after all; kept VOID_KEEP_S
    P:reserved      HASH  upstream -> blocks reserved, by every owner together
    P:inflight      HASH  upstream -> reservations held
    P:budget        HASH  upstream -> its budget, as the gateways state it (set_budgets; for reading)
    P:limit         HASH  upstream -> the limit the last reserve was checked against
    P:released      HASH  upstream -> "<sum> <ms>": blocks given back, decayed over RATE_WINDOW_S
    P:leases        HASH  owner -> "<lease deadline ms> <epoch>" (P:owners then holds its reclaim time)
    P:epoch         the last lease epoch given (INCR: each registration takes the next)
    P:engines       HASH  engine address (ip:port) -> the identity it is budgeted under
    P:engine_url    HASH  identity -> the URL it was first registered with (for the refusal)
    P:engine_users:<identity>  SET  owners that registered it (a clash counts while one is live)

"upstream" in these keys is the engine's identity (kvtune.gateway.engines): its engine_id, else
its canonical URL, so that every replica budgets one engine once however it spells the URL.

An owner is one gateway process. Its lease is its deadline and epoch in P:leases, and
P:owners holds when its reservations are reclaimed: the deadline plus reclaim_grace_s. A script
the owner runs under a live lease of its epoch pushes the deadline to now + lease_s, and a
background task (`start`) runs `renew` every min(lease_s / 3, 1 s) so an idle replica keeps it
too. Every script, whoever runs it, first sweeps: each owner whose reclaim time has passed by
Redis' clock (never a client's) is reclaimed, its blocks returned to their upstreams and its
hash deleted (at most SWEEP_OWNERS owners a script, so Redis pauses a bounded time whatever
died; the next scripts take the rest).

Between its deadline and its reclaim time an owner is lapsed: its reservations stay counted (a
replica paused or cut off still runs its requests on the engines, whose KV they hold), and it is
fenced: its admission scripts admit nothing, its renewals renew nothing, until it registers again
(`reregister`: a new epoch from the counter P:epoch) and holds what it still runs (the ids and rows `in_flight`
reports; those still held are kept as they are). A script sent under an older epoch (a reply
lost in a pause, a second process claiming the same owner) is fenced the same way. A lapsed
owner none of whose connections is open to Redis died (SIGKILL: the kernel closed them), and its
engines' requests with it: the heartbeat of any live replica (`reclaim_departed`, by CLIENT LIST
and the connection name each replica sets to its owner) reclaims it at once, within lease_s + 1 s
of its last heartbeat. A machine lost without closing its connections keeps the grace (until
Redis' tcp-keepalive drops them).

Past the grace the owner is reclaimed: one that comes back later finds its hash gone, registers
again and holds its still-running requests again, each only if it fits now by the policy's
reserve rule, so new admissions see them again and the ledger's budget still holds; those that
no longer fit (another replica admitted into their room) cannot be stopped, and for as long as
they run the engine holds more than its budget: they are counted (`reregister_over`, logged) and
tried again every heartbeat until they fit or end. Same ids, same owner: each release gives back
once (a release that finds nothing while a re-registration is on its way leaves a tombstone the
script honours).

release(id) deletes the id from the caller's own hash and subtracts only if it was there: exactly
once. reserve(id) is idempotent (an id already held answers granted, unchanged), which is also
what makes redis-py's retry of a command whose reply was lost safe. A reserve that raised
(LedgerUnavailableError, or cancelled) did not grant as far as the caller is concerned; in case
Redis recorded it anyway, the id is queued for release, and so is a release that raised: the
heartbeat task gives them back as soon as Redis answers again. A queued release that finds
nothing leaves a tombstone, so that a reserve still on its way (sent on a connection the
cancellation dropped) is refused when it lands instead of leaking. `release_soon` queues the
same way without awaiting, for a `finally` that must not await. Redis errors and timeouts (each
operation is bounded by op_timeout_s, redis-py retrying twice within it) surface as
LedgerUnavailableError, never as redis' own exceptions; the client reconnects by itself.

Redis restarts: with persistence (appendonly) the state and the leases survive; a downtime longer
than lease_s expires every lease, so every reservation is reclaimed at the first script after it
(the gateways' in-flight requests are then no longer counted). Without persistence the restarted
ledger is empty: in-flight reservations are forgotten, their releases return False, and until
those requests finish the engines hold more than the ledger says, so the gateways may admit up
to a whole budget more per upstream than fits. Run Redis with appendonly for this ledger.

The statistical policy runs on this same machinery (kvtune.gateway.redis_statistical): each
reservation's log-moment rows live in P:rows:<owner>, their sums per upstream in P:stat and
P:worst, and the prelude's give_back subtracts a reservation's rows wherever its blocks go back
(release or sweep), so both policies share one lease, sweep and release path. Its reserve
admits on the Chernoff bound alone (no convolution server-side): never more than in memory.
Overcommit's limit floor(k x budget) is what reserve's limit_blocks then is.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtune.errors import LedgerUnavailableError
from kvtune.gateway.ledger import RATE_WINDOW_S, LedgerSnapshot
from kvtune.gateway.statistical import RESUM_EVERY
from kvtune.masking import redact

log = logging.getLogger("kvtune.gateway")

#: How often the background task renews the lease and sweeps, at most (also lease_s / 3).
TEND_EVERY_S = 1.0
#: How many expired owners one script reclaims at most (the rest go to the next script).
SWEEP_OWNERS = 16
#: Pause after a failed heartbeat or release drain before trying again.
RETRY_PAUSE_S = 0.1
#: How long a queued release that found nothing keeps its id refused (a reserve still in flight).
VOID_KEEP_S = 60.0

# KEYS[1..5]: owners, reserved, inflight, released, budget; KEYS[6..7]: the caller's own hash and
# tombstones; KEYS[8]: limit. ARGV[1..4]: the key prefix, the caller's lease terms ("<lease ms>
# <grace ms> <epoch>"), release window ms, owner.
_PRELUDE = """
local owners_key, reserved_key, inflight_key = KEYS[1], KEYS[2], KEYS[3]
local released_key, budget_key, own_key, void_key, limit_key = KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local prefix, window_ms, owner = ARGV[1], tonumber(ARGV[3]), ARGV[4]
local lease_ms, grace_ms, epoch = string.match(ARGV[2], '^(%d+) (%d+) (%d+)$')
lease_ms, grace_ms, epoch = tonumber(lease_ms), tonumber(grace_ms), tonumber(epoch)
local leases_key = prefix .. ':leases'
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function decayed(upstream)
  local v = redis.call('HGET', released_key, upstream)
  if not v then return 0 end
  local s, at = string.match(v, '^(%S+) (%S+)$')
  return tonumber(s) * math.exp(-math.max(0, now_ms - tonumber(at)) / window_ms)
end

-- the statistical policy's rows (kvtune.gateway.redis_statistical): P:rows:<owner> id -> its worst
-- case then its rows, their sums per upstream in P:stat and P:worst (integers). Floats travel and
-- rest as little-endian doubles (struct), exact both ways and cheaper than decimal text.
local stat_key, worst_key, removals_key = prefix .. ':stat', prefix .. ':worst', prefix .. ':removals'

local function parse(s)
  local n = #s / 8
  if n < 1 then return {} end
  local t = {struct.unpack('<' .. string.rep('d', n), s)}
  t[n + 1] = nil  -- unpack's last value is the next position
  return t
end

local function fmt(t)
  return struct.pack('<' .. string.rep('d', #t), unpack(t))
end

local function with_worst(worst, rows)
  return struct.pack('<d', worst) .. rows
end

local function add_rows(upstream, rows, sign)
  local cur = redis.call('HGET', stat_key, upstream)
  local s = cur and parse(cur) or {}
  for i = 1, #rows do s[i] = (s[i] or 0) + sign * rows[i] end
  redis.call('HSET', stat_key, upstream, fmt(s))
end

local function resum(upstream)
  local s = {}
  for _, who in ipairs(redis.call('ZRANGE', owners_key, 0, -1)) do
    local held = redis.call('HGETALL', prefix .. ':rows:' .. who)
    for i = 1, #held, 2 do
      local v = redis.call('HGET', prefix .. ':res:' .. who, held[i])
      if v and string.match(v, '^%d+ (.*)$') == upstream then
        local rows = parse(held[i + 1])
        for k = 2, #rows do s[k - 1] = (s[k - 1] or 0) + rows[k] end
      end
    end
  end
  if #s == 0 then redis.call('HDEL', stat_key, upstream) else redis.call('HSET', stat_key, upstream, fmt(s)) end
end

local function unhold_rows(who, id, upstream)
  local rows_key = prefix .. ':rows:' .. who
  local v = redis.call('HGET', rows_key, id)
  if not v then return end
  redis.call('HDEL', rows_key, id)
  local rows = parse(v)
  local worst = table.remove(rows, 1)
  if redis.call('HINCRBY', worst_key, upstream, -worst) == 0 then  -- nothing held: the sums are exactly 0
    redis.call('HDEL', worst_key, upstream)
    redis.call('HDEL', stat_key, upstream)
  else
    add_rows(upstream, rows, -1)
    if redis.call('HINCRBY', removals_key, upstream, 1) % RESUM_EVERY == 0 then resum(upstream) end
  end
end

local function give_back(upstream, blocks, who, id)
  unhold_rows(who, id, upstream)
  redis.call('HINCRBY', reserved_key, upstream, -blocks)
  redis.call('HINCRBY', inflight_key, upstream, -1)
  redis.call('HSET', released_key, upstream, string.format('%.17g %d', decayed(upstream) + blocks, now_ms))
end

local function reclaim(who)
  local key = prefix .. ':res:' .. who
  local held = redis.call('HGETALL', key)
  for i = 1, #held, 2 do
    local blocks, upstream = string.match(held[i + 1], '^(%d+) (.*)$')
    give_back(upstream, tonumber(blocks), who, held[i])
  end
  redis.call('DEL', key, prefix .. ':void:' .. who, prefix .. ':rows:' .. who)
  redis.call('ZREM', owners_key, who)
  redis.call('HDEL', leases_key, who)
  return #held / 2
end

local reclaimed = 0
for _, who in ipairs(redis.call('ZRANGEBYSCORE', owners_key, '-inf', now_ms, 'LIMIT', 0, SWEEP_OWNERS)) do
  reclaimed = reclaimed + reclaim(who)
end

-- the caller's lease: live (its deadline not passed) and of the epoch the caller names
local function leased()
  local v = redis.call('HGET', leases_key, owner)
  if not v then return false end
  local deadline, e = string.match(v, '^(%d+) (%d+)$')
  return tonumber(deadline) >= now_ms and tonumber(e) == epoch
end

local function hold_lease(e)
  redis.call('HSET', leases_key, owner, string.format('%d %d', now_ms + lease_ms, e))
  redis.call('ZADD', owners_key, now_ms + lease_ms + grace_ms, owner)
end

-- renew the caller's live lease -> 1; a lapsed one (or one of an older epoch) is not renewed -> 0:
-- the caller is fenced until it registers again (register())
local function lease()
  if not leased() then return 0 end
  hold_lease(epoch)
  return 1
end

-- renew the caller's lease if live, else open a new epoch -> {had, epoch}
local function register()
  if leased() then
    hold_lease(epoch)
    return {1, epoch}
  end
  local e = redis.call('INCR', prefix .. ':epoch')  -- one counter for all: an epoch is never given twice
  hold_lease(e)
  return {0, e}
end
""".replace("SWEEP_OWNERS", str(SWEEP_OWNERS)).replace("RESUM_EVERY", str(RESUM_EVERY))

# ARGV[5..8]: upstream, id, blocks, limit -> {granted, had lease, reserved after, reclaimed}
_RESERVE = _PRELUDE + """
local upstream, id, blocks, limit = ARGV[5], ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local had = lease()
local reserved = tonumber(redis.call('HGET', reserved_key, upstream) or '0')
if had == 0 then return {0, had, reserved, reclaimed} end  -- fenced: register again first
redis.call('HSET', limit_key, upstream, limit)
if redis.call('HEXISTS', own_key, id) == 1 then return {1, had, reserved, reclaimed} end
if redis.call('ZSCORE', void_key, id) then return {0, had, reserved, reclaimed} end  -- given up on already
if reserved + blocks > limit then return {0, had, reserved, reclaimed} end
redis.call('HINCRBY', reserved_key, upstream, blocks)
redis.call('HINCRBY', inflight_key, upstream, 1)
redis.call('HSET', own_key, id, blocks .. ' ' .. upstream)
return {1, had, reserved + blocks, reclaimed}
"""

# ARGV[5..6]: id, tombstone (1: if it is not held, refuse it should its reserve arrive later)
# -> {released, had lease, reclaimed}
_RELEASE = _PRELUDE + """
local had = lease()
local v = redis.call('HGET', own_key, ARGV[5])
if not v then
  if ARGV[6] == '1' then redis.call('ZADD', void_key, now_ms, ARGV[5]) end
  return {0, had, reclaimed}
end
redis.call('HDEL', own_key, ARGV[5])
local blocks, upstream = string.match(v, '^(%d+) (.*)$')
give_back(upstream, tonumber(blocks), owner, ARGV[5])
return {1, had, reclaimed}
"""

# -> {had lease, reclaimed, held by this owner} (had 0: lapsed, not renewed: register again)
_RENEW = _PRELUDE + """
local had = lease()
redis.call('ZREMRANGEBYSCORE', void_key, '-inf', now_ms - VOID_KEEP_MS)
return {had, reclaimed, redis.call('HLEN', own_key)}
""".replace("VOID_KEEP_MS", str(round(VOID_KEEP_S * 1000)))

# ARGV[5..]: upstream, budget, limit, ... -> reclaimed
_SET_BUDGETS = _PRELUDE + """
for i = 5, #ARGV, 3 do
  redis.call('HSET', budget_key, ARGV[i], ARGV[i + 1])
  redis.call('HSET', limit_key, ARGV[i], ARGV[i + 2])
end
return reclaimed
"""

# -> {reclaimed, then per upstream: name, budget, limit, reserved, inflight, release rate per s
# (a string: Lua numbers become integers in a reply)}
_SNAPSHOT = _PRELUDE + """
local out = {reclaimed}
local seen = {}
for _, key in ipairs({budget_key, limit_key, reserved_key}) do
  for _, upstream in ipairs(redis.call('HKEYS', key)) do
    if not seen[upstream] then
      seen[upstream] = true
      local budget = redis.call('HGET', budget_key, upstream)
      local limit = redis.call('HGET', limit_key, upstream)
      table.insert(out, upstream)
      table.insert(out, tonumber(budget or limit or '0'))
      table.insert(out, tonumber(limit or budget or '0'))
      table.insert(out, tonumber(redis.call('HGET', reserved_key, upstream) or '0'))
      table.insert(out, tonumber(redis.call('HGET', inflight_key, upstream) or '0'))
      table.insert(out, string.format('%.17g', decayed(upstream) * 1000 / window_ms))
    end
  end
end
return out
"""

# The re-registration after a lost lease: ARGV[5]: epsilon (statistical), then 6 a reservation: id,
# upstream, blocks, limit, worst, rows (none: empty). Each is held again, in order, only if it fits
# now (fits(), the reserve rule of the policy's script); held again, its rows too (hold_rows()).
# The lease is renewed if live, else opened under a new epoch (register()).
# -> {had lease, reclaimed, re-registered, held already, epoch, then the ids that did not fit}
_REREGISTER = """
local registered = register()
local had = registered[1]
local epsilon = tonumber(ARGV[5])
local out = {had, reclaimed, 0, 0, registered[2]}
for i = 6, #ARGV, 6 do
  local id, upstream, blocks, limit = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local worst, rows = tonumber(ARGV[i + 4]), ARGV[i + 5]
  if redis.call('HEXISTS', own_key, id) == 1 then
    out[4] = out[4] + 1
  elseif redis.call('ZSCORE', void_key, id) then  -- released while this script was on its way
  elseif fits(upstream, blocks, limit, epsilon, worst, rows) then
    redis.call('HINCRBY', reserved_key, upstream, blocks)
    redis.call('HINCRBY', inflight_key, upstream, 1)
    redis.call('HSET', own_key, id, blocks .. ' ' .. upstream)
    hold_rows(upstream, id, worst, rows)
    out[3] = out[3] + 1
  else
    table.insert(out, id)
  end
end
return out
"""

_FITS_BLOCKS = """
local function fits_blocks(upstream, blocks, limit)
  return tonumber(redis.call('HGET', reserved_key, upstream) or '0') + blocks <= limit
end
"""

# the guaranteed rule: what _RESERVE checks
_REREGISTER_BLOCKS = _PRELUDE + _FITS_BLOCKS + """
local function fits(upstream, blocks, limit, epsilon, worst, rows) return fits_blocks(upstream, blocks, limit) end
local function hold_rows(upstream, id, worst, rows) end
""" + _REREGISTER

# ARGV[5..]: per engine its identity, its URL as written, the count of its addresses, then them.
# An address registered under another identity that a live owner uses (or that has blocks
# reserved) refuses the whole registration, nothing written -> {0} or {1, address, the other
# identity, the URL it was registered with, the refused identity}
_REGISTER_ENGINES = _PRELUDE + """
local engines_key, spelling_key = prefix .. ':engines', prefix .. ':engine_url'
local function in_use(identity)
  if tonumber(redis.call('HGET', reserved_key, identity) or '0') > 0 then return true end
  local users = prefix .. ':engine_users:' .. identity
  for _, who in ipairs(redis.call('SMEMBERS', users)) do
    if who ~= owner then
      if redis.call('ZSCORE', owners_key, who) then return true end
      redis.call('SREM', users, who)
    end
  end
  return false
end
local engines = {}
local i = 5
while i <= #ARGV do
  local n = tonumber(ARGV[i + 2])
  local e = {id = ARGV[i], url = ARGV[i + 1], addresses = {}}
  for k = 1, n do e.addresses[k] = ARGV[i + 2 + k] end
  table.insert(engines, e)
  i = i + 3 + n
end
for _, e in ipairs(engines) do
  for _, address in ipairs(e.addresses) do
    local other = redis.call('HGET', engines_key, address)
    if other and other ~= e.id and in_use(other) then
      return {1, address, other, redis.call('HGET', spelling_key, other) or other, e.id}
    end
  end
end
lease()
for _, e in ipairs(engines) do
  for _, address in ipairs(e.addresses) do redis.call('HSET', engines_key, address, e.id) end
  redis.call('HSETNX', spelling_key, e.id, e.url)
  local users = prefix .. ':engine_users:' .. e.id
  for _, who in ipairs(redis.call('SMEMBERS', users)) do  -- those gone: the set stays small
    if not redis.call('ZSCORE', owners_key, who) then redis.call('SREM', users, who) end
  end
  redis.call('SADD', users, owner)
end
return {0}
"""

# -> the owners, other than the caller, whose lease lapsed and whose grace runs still
_LAPSED = _PRELUDE + """
local out = {}
local held = redis.call('HGETALL', leases_key)
for i = 1, #held, 2 do
  local deadline = tonumber(string.match(held[i + 1], '^(%d+) '))
  if held[i] ~= owner and deadline < now_ms then table.insert(out, held[i]) end
end
return out
"""

# ARGV[5..]: lapsed owners no connection of which is open to Redis (they died): reclaimed now,
# each only if its lease is lapsed still -> reclaimed
_RECLAIM_DEPARTED = _PRELUDE + """
for i = 5, #ARGV do
  local v = redis.call('HGET', leases_key, ARGV[i])
  if v and ARGV[i] ~= owner and tonumber(string.match(v, '^(%d+) ')) < now_ms then
    reclaimed = reclaimed + reclaim(ARGV[i])
  end
end
return reclaimed
"""

# the owner gives up its lease and everything it holds -> reclaimed (its own included)
_RETIRE = _PRELUDE + """
return reclaimed + reclaim(owner)
"""


@dataclass(frozen=True, slots=True)
class InFlight:
    """A reservation this replica still runs, as it holds it again after losing its lease."""

    reservation_id: str
    upstream: str
    blocks: int
    limit_blocks: int  # what its reserve was checked against (statistical: the budget)
    worst: int = 0  # statistical: its worst-case blocks and log-moment rows (encode_rows; b"" for none)
    rows: bytes = b""


@dataclass(frozen=True, slots=True)
class EngineName:
    """One upstream as register_engines records it: the identity its budget is kept under, its
    URL as written, and the addresses it resolves to."""

    identity: str
    url: str
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineClash:
    """Why register_engines refused: `address` is registered under `registered` (first written as
    `registered_url`), in use, and this replica would budget it as `identity`."""

    address: str
    registered: str
    registered_url: str
    identity: str


@dataclass(slots=True)
class _Script:
    source: str
    sha: str = ""


class _State(enum.Enum):
    NEW = "new"
    STARTED = "started"
    CLOSED = "closed"


def default_owner() -> str:
    """An owner id unique to this process: host, pid and a random tag (a restart is a new owner)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class RedisLedger:
    """The shared ledger one gateway replica (`owner`) talks to; see the module docstring.

    `start()` connects, loads the scripts, takes the lease and starts the heartbeat; `aclose()`
    stops it and, with retire=True, gives back whatever this owner still holds. Every Redis error
    or timeout surfaces as LedgerUnavailableError; the client reconnects by itself."""

    def __init__(self, url: str, *, owner: str | None = None, key_prefix: str = "kvtune", lease_s: float = 10.0,
                 op_timeout_s: float = 0.5, connect_timeout_s: float = 0.25, max_connections: int = 64,
                 rate_window_s: float = RATE_WINDOW_S, reclaim_grace_s: float = 0.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        if reclaim_grace_s < 0:
            raise ValueError(f"reclaim_grace_s must not be negative, got {reclaim_grace_s}")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty")
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be positive, got {op_timeout_s}")
        self.url = url
        self.owner = owner or default_owner()
        self.key_prefix = key_prefix
        self.lease_s = lease_s
        self.reclaim_grace_s = reclaim_grace_s
        self.tend_every_s = min(lease_s / 3, TEND_EVERY_S)
        self.op_timeout_s = op_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        p = key_prefix
        self._keys = [f"{p}:owners", f"{p}:reserved", f"{p}:inflight", f"{p}:released", f"{p}:budget",
                      self.reservations_key(self.owner), f"{p}:void:{self.owner}", f"{p}:limit"]
        self._terms = f"{round(lease_s * 1000)} {round(reclaim_grace_s * 1000)}"
        self._epoch = 0  # the lease epoch Redis gave this owner (0: none yet); every script names it
        self._args = [p, f"{self._terms} 0", str(round(rate_window_s * 1000)), self.owner]
        self._scripts = {name: _Script(source) for name, source in (
            ("reserve", _RESERVE), ("release", _RELEASE), ("renew", _RENEW), ("set_budgets", _SET_BUDGETS),
            ("snapshot", _SNAPSHOT), ("retire", _RETIRE), ("reregister", _REREGISTER_BLOCKS),
            ("register_engines", _REGISTER_ENGINES), ("lapsed", _LAPSED), ("reclaim_departed", _RECLAIM_DEPARTED))}
        self._redis: Any = None
        self._state = _State.NEW
        self._leased = False
        self._pending: dict[str, None] = {}  # reservation ids to give back when Redis answers, in order
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # what this replica still runs (the gateway's SharedLedger sets it): held again after a lost lease
        self.in_flight: Callable[[], Iterable[InFlight]] | None = None
        self._lost = False  # the lease was found lost (or never taken), the re-registration not yet done
        self._registering = asyncio.Lock()  # one registration at a time: the heartbeat's or a fenced reserve's
        self._reregistering = False  # a re-registration is on its way: a release finding nothing leaves a tombstone
        self._unregistered: set[str] = set()  # in flight, not held in Redis: they did not fit when held again
        self._ended: set[str] = set()  # released while a re-registration was on its way
        # counters for /metrics
        self.leases_lost = 0  # times this owner found its lease expired (its reservations reclaimed)
        self.reclaimed = 0  # reservations of expired owners this owner's scripts reclaimed
        self.script_loads = 0  # SCRIPT LOADs, the first included (more: Redis restarted or flushed)
        self.errors = 0  # operations that raised LedgerUnavailableError
        self.available = False  # whether the last operation reached Redis (for /metrics, and fallbacks)
        self.reregistered = 0  # in-flight reservations held again after a lost lease
        self.reregister_over = 0  # in-flight reservations that no longer fit when their lease was lost

    def reservations_key(self, owner: str) -> str:
        """The hash of one owner's reservations (id -> "<blocks> <upstream>")."""
        return f"{self.key_prefix}:res:{owner}"

    @property
    def unregistered(self) -> int:
        """In-flight reservations Redis does not count now: they no longer fit when this replica's
        lost lease was taken again (retried every heartbeat until they fit or end)."""
        return len(self._unregistered)

    @property
    def pending_releases(self) -> int:
        """Reservation ids waiting for Redis to answer before they are given back."""
        return len(self._pending)

    # -- lifecycle

    async def start(self, *, heartbeat: bool = True) -> None:
        """Connect, load the scripts and take the lease, and renew it in the background unless
        heartbeat=False. LedgerUnavailableError if Redis does not answer now: the store stays
        started and keeps trying (the caller chooses to wait, to refuse, or to fall back)."""
        if self._state is not _State.NEW:
            raise RuntimeError(f"a RedisLedger cannot be started twice (it is {self._state.value})")
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialWithJitterBackoff

        self._state = _State.STARTED
        # No socket_timeout: redis-py then sends through asyncio.wait_for, which on Python 3.11
        # swallows a cancellation that lands as the send completes (the reserve of a client that
        # went away would carry on); each operation is bounded by asyncio.timeout in _run instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            self.url, max_connections=self._max_connections, timeout=self.op_timeout_s,
            socket_timeout=None, socket_connect_timeout=self._connect_timeout_s, client_name=self.owner,
            retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), retries=2), health_check_interval=0)
        self._redis = aioredis.Redis.from_pool(pool)  # closing the client closes the pool
        if heartbeat:
            self._task = asyncio.get_running_loop().create_task(self._tend(), name=f"kvtune-ledger-{self.owner}")
        await self._load_scripts()
        self._lost = True  # no lease yet: the first registration opens one (an epoch)
        await self.reregister()

    async def aclose(self, *, retire: bool = True) -> None:
        """Stop the heartbeat, give back queued releases and, with retire, everything this owner
        holds (best effort: what Redis does not take is reclaimed when the lease lapses). Idempotent."""
        if self._state is _State.CLOSED:
            return
        started = self._state is _State.STARTED
        self._state = _State.CLOSED
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if started:
            with contextlib.suppress(LedgerUnavailableError):
                if retire:
                    await self._run("retire")
                    self._pending.clear()
                else:
                    await self._drain()
            await self._redis.aclose()

    async def __aenter__(self) -> RedisLedger:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the ledger

    async def reserve(self, upstream: str, reservation_id: str, blocks: int, limit_blocks: int) -> bool:
        """Hold `blocks` of `upstream` under `reservation_id` if every replica's reservations plus
        these fit in `limit_blocks` (what BlockLedger calls it: the budget under the guaranteed
        policy, floor(k x budget) under overcommit). True if granted (or already held under this
        id). A reservation id that raised is spent: the store gives it back later in case Redis
        recorded it; use a fresh one."""
        self._check_started()
        if blocks < 1:
            raise ValueError(f"a reservation needs at least 1 block, got {blocks}")
        if limit_blocks < 1:
            raise ValueError(f"limit_blocks must be at least 1, got {limit_blocks}")
        out = await self._admit(reservation_id, "reserve", upstream, reservation_id, blocks, limit_blocks)
        return bool(out[0])

    async def _admit(self, reservation_id: str, name: str, *args: str | int | bytes) -> Any:
        """Run an admission script ({granted, had lease, reserved, reclaimed, ...}). Fenced (this
        owner's lease lapsed, or Redis knows a later epoch of it), it admits nothing: register
        again first (what still runs held again), then try once more. One that raised is queued
        for release: Redis may have recorded it all the same."""
        try:
            for attempt in range(2):
                epoch = self._epoch
                out = await self._run(name, *args)
                self._lease_seen(out[1], out[3], epoch)
                if out[1] or attempt:
                    break
                await self.reregister()
        except BaseException:  # unavailable, or cancelled
            self.release_soon(reservation_id)
            raise
        return out

    async def release(self, reservation_id: str) -> bool:
        """Give the reservation's blocks back; True the first time, False if it is not held (already
        released, never granted, or reclaimed after this owner's lease expired; or released by an
        earlier attempt whose reply was lost). One that raises (unavailable, cancelled) is queued
        and given back when Redis answers again, so no release is lost."""
        self._check_started()
        try:
            return await self._release(reservation_id)
        except BaseException:
            self.release_soon(reservation_id)
            raise

    async def _release(self, reservation_id: str, *, tombstone: bool = False) -> bool:
        self._forget(reservation_id)
        tombstone = tombstone or self._reregistering
        epoch = self._epoch
        released, had, reclaimed = await self._run("release", reservation_id, int(tombstone))
        self._lease_seen(had, reclaimed, epoch)
        return bool(released)

    def release_soon(self, reservation_id: str) -> None:
        """Queue a release without awaiting (for a `finally`); the heartbeat task gives it back,
        retrying while Redis is unavailable."""
        self._pending[reservation_id] = None
        self._forget(reservation_id)
        self._wake.set()

    async def renew(self) -> bool:
        """Push this owner's lease deadline to now + lease_s (and sweep expired owners). False if the
        lease had expired (or never existed): whatever this owner held was reclaimed."""
        self._check_started()
        epoch = self._epoch
        had, reclaimed, _ = await self._run("renew")
        return self._lease_seen(had, reclaimed, epoch)

    async def held(self) -> int:
        """How many reservations this owner holds in Redis now (renewing its lease on the way)."""
        self._check_started()
        epoch = self._epoch
        had, reclaimed, held = await self._run("renew")
        self._lease_seen(had, reclaimed, epoch)
        return int(held)

    async def set_budgets(self, budgets: Mapping[str, int], limits: Mapping[str, int] | None = None) -> None:
        """Record each upstream's budget (and limit, the budget unless given) for `snapshot`, as
        the gateway starts; reserve records the limit it checks too."""
        self._check_started()
        args: list[str | int] = []
        for upstream, blocks in budgets.items():
            args += [upstream, blocks, (limits or {}).get(upstream, blocks)]
        self.reclaimed += int(await self._run("set_budgets", *args))

    async def register_engines(self, engines: Iterable[EngineName]) -> EngineClash | None:
        """Record which identity each engine address is budgeted under, in one script; the first
        address already registered under another identity still in use (a live owner registered
        it, or blocks are reserved on it) refuses them all, nothing written: that clash is returned."""
        self._check_started()
        args: list[str | int] = []
        for engine in engines:
            args += [engine.identity, engine.url, len(engine.addresses), *engine.addresses]
        out = [x.decode() if isinstance(x, bytes) else x for x in await self._run("register_engines", *args)]
        if int(out[0]) == 0:
            return None
        return EngineClash(address=str(out[1]), registered=str(out[2]), registered_url=str(out[3]),
                           identity=str(out[4]))

    async def snapshot(self) -> dict[str, LedgerSnapshot]:
        """Every upstream's budget, blocks reserved and reservations held by all replicas together,
        and the rate at which blocks come back (after a sweep)."""
        self._check_started()
        out = await self._run("snapshot")
        self.reclaimed += int(out[0])
        snap: dict[str, LedgerSnapshot] = {}
        for i in range(1, len(out), 6):
            name = out[i].decode() if isinstance(out[i], bytes) else str(out[i])
            budget, limit, reserved, inflight = (int(x) for x in out[i + 1:i + 5])
            snap[name] = LedgerSnapshot(budget, reserved, inflight, float(out[i + 5]), limit)
        return snap

    async def reserved(self, upstream: str) -> int:
        """Blocks of `upstream` reserved by every replica together (after a sweep)."""
        got = (await self.snapshot()).get(upstream)
        return 0 if got is None else got.reserved_blocks

    async def reregister(self) -> None:
        """Take the lease again under a new epoch after it lapsed (or first, at start) and hold
        again, in one script, what this replica still runs (`in_flight`): each only if it fits now
        (the policy's reserve rule), so the ledger counts what runs again; those held still (the
        lapse was within reclaim_grace_s) are kept as they are. Those that do not fit cannot be
        stopped: they are counted (reregister_over, logged) and tried again every heartbeat until
        they fit or end. Until this is done, every admission of this owner is fenced. Without a
        lapsed lease, only those that did not fit are tried. Same ids, same owner: a release
        gives each back once."""
        self._check_started()
        async with self._registering:  # a fenced reserve waits for the heartbeat's, and the other way round
            lost, first = self._lost, not self._leased
            if not (lost or self._unregistered):
                return
            self._reregistering = True  # before reading what runs: a release racing the script tombstones
            try:
                running = list(self.in_flight()) if self.in_flight is not None and not first else []
                self._unregistered &= {held.reservation_id for held in running}  # those that ended need nothing
                if not lost and not self._unregistered:
                    return
                args: list[str | int | bytes] = [self._epsilon_arg()]
                for held in running:  # all of them: those Redis holds still are kept, not counted twice
                    args += [held.reservation_id, held.upstream, held.blocks, held.limit_blocks, held.worst,
                             held.rows]
                out = await self._run("reregister", *args)
            finally:
                self._reregistering = False
                ended, self._ended = self._ended, set()
            had, epoch = int(out[0]), int(out[4])
            self.reclaimed += int(out[1])
            if not had and not lost and not first:  # it lapsed unnoticed: a loss all the same
                self.leases_lost += 1
                lost = True
            self._epoch = epoch
            self._args[1] = f"{self._terms} {epoch}"
            self._leased, self._lost = True, False
            registered, kept = int(out[2]), int(out[3])
            over = {x.decode() if isinstance(x, bytes) else str(x) for x in out[5:]}
            self._unregistered = over - ended
            self.reregistered += registered
            if lost and not first:
                self.reregister_over += len(over)
                log.warning("the shared ledger lease of %s lapsed (epoch %d now): %d in-flight requests held "
                            "again, %d held still, %d no longer fit (counted in Redis once they do)",
                            self.owner, epoch, registered, kept, len(over))
            elif registered:
                log.warning("%d in-flight requests held again in the shared ledger, %d still do not fit",
                            registered, len(over))

    async def reclaim_departed(self) -> int:
        """Reclaim at once the lapsed owners no connection of which is open to Redis: a process
        that died (its connections closed with it) holds nothing on the engines either, so its
        grace is not waited for; one paused or cut off keeps its connections, and its grace.
        How many reservations were reclaimed (0 where Redis refuses CLIENT LIST: the grace alone)."""
        self._check_started()
        lapsed = [x.decode() if isinstance(x, bytes) else str(x) for x in await self._run("lapsed")]
        if not lapsed:
            return 0
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(self.op_timeout_s):
                connected = {c.get("name") for c in await self._redis.client_list()}
        except (RedisError, TimeoutError):
            return 0
        departed = [who for who in lapsed if who not in connected]
        if not departed:
            return 0
        got = int(await self._run("reclaim_departed", *departed))
        self.reclaimed += got
        return got

    # -- internals

    def _forget(self, reservation_id: str) -> None:
        """A reservation ended: no longer one to hold again."""
        self._unregistered.discard(reservation_id)
        if self._reregistering:
            self._ended.add(reservation_id)

    def _epsilon_arg(self) -> str:
        """The re-registration script's epsilon (the guaranteed rule ignores it)."""
        return "0"

    def _lease_seen(self, had: int, reclaimed: int, epoch: int) -> bool:
        """Note a script's reply, sent under `epoch`: had 0 means this owner's lease lapsed (or was
        never taken) and it is fenced until it registers again (the heartbeat, or the fenced
        reserve itself, does). A reply of an epoch already replaced says nothing new."""
        self.reclaimed += int(reclaimed)
        if not had and epoch == self._epoch and not self._lost:
            if self._leased:
                self.leases_lost += 1
            self._lost = True
            self._wake.set()
        return bool(had)

    async def _load_scripts(self) -> None:
        try:
            async with asyncio.timeout(self.op_timeout_s):
                for script in self._scripts.values():
                    script.sha = await self._redis.script_load(script.source)
                    self.script_loads += 1
        except Exception as exc:  # redis' errors and our own timeout alike
            self.errors += 1
            self.available = False
            raise self._unavailable(exc) from exc

    def _check_started(self) -> None:
        if self._state is not _State.STARTED:
            raise RuntimeError(f"the RedisLedger is {self._state.value}, not started")

    async def _run(self, name: str, *args: str | int | bytes) -> Any:
        """One script by EVALSHA; on NOSCRIPT (Redis restarted or flushed) load it and run it again."""
        from redis.exceptions import NoScriptError

        script = self._scripts[name]
        keys = self._keys
        try:
            async with asyncio.timeout(self.op_timeout_s):
                try:
                    if not script.sha:  # Redis was down when the scripts were first loaded
                        raise NoScriptError("not loaded yet")
                    out = await self._redis.evalsha(script.sha, len(keys), *keys, *self._args, *args)
                except NoScriptError:
                    script.sha = await self._redis.script_load(script.source)
                    self.script_loads += 1
                    out = await self._redis.evalsha(script.sha, len(keys), *keys, *self._args, *args)
        except Exception as exc:  # redis' errors and our own timeout alike; cancellation passes
            self.errors += 1
            self.available = False
            raise self._unavailable(exc) from exc
        self.available = True
        return out

    def _unavailable(self, exc: Exception) -> LedgerUnavailableError:
        what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc}"
        return LedgerUnavailableError(f"the shared ledger at {redact(self.url)} {what}",
                                      field=f"ledger {self.key_prefix}")

    async def _drain(self) -> None:
        """Give back the queued releases, a few at a time; what Redis does not take stays queued."""
        while self._pending:
            batch = list(itertools.islice(self._pending, 32))  # they stay queued until Redis answers
            results = await asyncio.gather(*(self._release(rid, tombstone=True) for rid in batch),
                                           return_exceptions=True)
            for rid, result in zip(batch, results, strict=True):
                if not isinstance(result, BaseException):
                    self._pending.pop(rid, None)
            for result in results:
                if isinstance(result, BaseException):
                    raise result  # LedgerUnavailableError: the heartbeat tries again

    async def _tend(self) -> None:
        """The heartbeat: renew (and sweep) every tend_every_s, give back queued releases at once."""
        loop = asyncio.get_running_loop()
        next_renew = loop.time() + self.tend_every_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_renew - loop.time())):
                    await self._wake.wait()
            self._wake.clear()
            try:
                if self._lost:
                    await self.reregister()
                if self._pending:
                    await self._drain()
                if loop.time() >= next_renew:
                    await self.renew()
                    await self.reclaim_departed()
                    next_renew = loop.time() + self.tend_every_s
                    if self._unregistered and not self._lost:
                        await self.reregister()
            except LedgerUnavailableError:
                await asyncio.sleep(RETRY_PAUSE_S)
                if self._pending or self._lost:
                    self._wake.set()


__all__ = ["RedisLedger", "InFlight", "EngineName", "EngineClash", "default_owner", "TEND_EVERY_S", "SWEEP_OWNERS",
           "VOID_KEEP_S"]
