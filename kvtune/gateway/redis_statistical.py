"""The statistical policy on the shared Redis ledger: admit while the Chernoff bound on P(every
replica's held sequences outgrow the upstream's budget) stays within epsilon.

It is the RedisLedger (kvtune.gateway.redis_ledger: leases, sweeps, idempotent reserve, exactly
once release, tombstones, LedgerUnavailableError) with one more reserve script and a progress
script. Each reservation stores its own log-moment rows (rows x THETAS floats, the sum of its
sequences' rows) and worst case in P:rows:<owner>; every upstream keeps their sums in P:stat
(floats) and P:worst (integers), so an admission costs one row set, not a pass over what is
held. Floats are sent and stored as packed little-endian doubles (encode_rows; Lua's struct):
exact, as the decimal text they replaced (%.17g) was, at a fifth of Redis' CPU. Release and the
sweep of an expired owner subtract exactly what the reserve added (the prelude's unhold_rows), a
progress update replaces a reservation's rows. Float drift: the sums are re-added from the
reservations every RESUM_EVERY removals, and dropped to exactly 0 when an upstream holds
nothing, inside the script that removes.

The reserve script admits iff the worst-case sum fits the budget (the probability is then 0), or
the Chernoff bound of (sum + the candidate's rows) is at most epsilon, computed in Lua with the
formula of overflow.chernoff_tail and combine. It never convolves (too costly server-side): the
bound is never below the exact probability, so the shared ledger admits at most what the
in-memory StatisticalLedger admits, never more.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from kvtune.errors import LedgerUnavailableError
from kvtune.gateway.ledger import LedgerSnapshot
from kvtune.gateway.overflow import THETAS
from kvtune.gateway.redis_ledger import _FITS_BLOCKS, _PRELUDE, _REREGISTER, RedisLedger

_THETAS_LUA = "{" + ", ".join(f"{t:.17g}" for t in THETAS) + "}"

# the bound of a sum of rows (a flat list, row-major, len(THETAS) a row), as overflow.chernoff_tail + combine
_BOUND = """
local THETAS = THETAS_LUA
local function bound(s, capacity)
  local nt = #THETAS
  local nrows = #s / nt
  local intervals, final = 0, 1
  for r = 0, nrows - 1 do
    local e = math.huge
    for k = 1, nt do
      local v = s[r * nt + k] - THETAS[k] * (capacity + 1)
      if v < e then e = v end
    end
    local tail = math.min(1, math.exp(math.min(e, 0)))
    if r == nrows - 1 then final = tail else intervals = intervals + tail end
  end
  return math.min(1, final, intervals)
end

local function probability(upstream, capacity, extra_worst, extra)
  local worst = tonumber(redis.call('HGET', worst_key, upstream) or '0') + extra_worst
  if worst <= capacity then return 0 end
  local cur = redis.call('HGET', stat_key, upstream)
  local s = cur and parse(cur) or {}
  for i = 1, #extra do s[i] = (s[i] or 0) + extra[i] end
  if #s == 0 then return 0 end
  return bound(s, capacity)
end
""".replace("THETAS_LUA", _THETAS_LUA)

# ARGV[5..11]: upstream, id, blocks, budget, epsilon, worst, rows
# -> {granted, had lease, reserved after, reclaimed, probability (a string)}
_RESERVE_ROWS = _PRELUDE + _BOUND + """
local upstream, id, blocks, budget = ARGV[5], ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local epsilon, worst = tonumber(ARGV[9]), tonumber(ARGV[10])
local had = lease()
local reserved = tonumber(redis.call('HGET', reserved_key, upstream) or '0')
if had == 0 then return {0, had, reserved, reclaimed, '0'} end  -- fenced: register again first
redis.call('HSET', limit_key, upstream, budget)
if redis.call('HEXISTS', own_key, id) == 1 then return {1, had, reserved, reclaimed, '0'} end
if redis.call('ZSCORE', void_key, id) then return {0, had, reserved, reclaimed, '0'} end
local rows = parse(ARGV[11])
local p = probability(upstream, budget, worst, rows)
if p > 0 and (epsilon <= 0 or p > epsilon) then return {0, had, reserved, reclaimed, string.format('%.17g', p)} end
redis.call('HINCRBY', reserved_key, upstream, blocks)
redis.call('HINCRBY', inflight_key, upstream, 1)
redis.call('HSET', own_key, id, blocks .. ' ' .. upstream)
redis.call('HSET', prefix .. ':rows:' .. owner, id, with_worst(worst, ARGV[11]))
redis.call('HINCRBY', worst_key, upstream, worst)
add_rows(upstream, rows, 1)
return {1, had, reserved + blocks, reclaimed, string.format('%.17g', p)}
"""

# ARGV[5..6]: id, rows (its worst case is kept) -> {replaced, had lease, reclaimed}
_PROGRESS = _PRELUDE + """
local had = lease()
local id = ARGV[5]
local rows_key = prefix .. ':rows:' .. owner
local old = redis.call('HGET', rows_key, id)
local v = redis.call('HGET', own_key, id)
if not old or not v then return {0, had, reclaimed} end
local upstream = string.match(v, '^%d+ (.*)$')
local before = parse(old)
local worst = table.remove(before, 1)
local rows = parse(ARGV[6])
add_rows(upstream, before, -1)
add_rows(upstream, rows, 1)
redis.call('HSET', rows_key, id, with_worst(worst, ARGV[6]))
return {1, had, reclaimed}
"""

# ARGV[5..]: upstream, budget, ... -> per upstream the bound on P(its held KV outgrows it) (strings)
_OVERFLOW = _PRELUDE + _BOUND + """
local out = {reclaimed}
for i = 5, #ARGV, 2 do
  table.insert(out, string.format('%.17g', probability(ARGV[i], tonumber(ARGV[i + 1]), 0, {})))
end
return out
"""

# ARGV[5..7]: upstream, budget, candidate rows (none: empty) -> the bound (a string); nothing changes
_BOUND_OF = _PRELUDE + _BOUND + """
return string.format('%.17g', probability(ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), parse(ARGV[8])))
"""


# the statistical rule for a reservation held again after a lost lease: what _RESERVE_ROWS checks
# (the guaranteed rule for one without rows), and its rows held with it
_REREGISTER_ROWS = _PRELUDE + _BOUND + _FITS_BLOCKS + """
local function fits(upstream, blocks, limit, epsilon, worst, rows)
  if rows == '' then return fits_blocks(upstream, blocks, limit) end
  local p = probability(upstream, limit, worst, parse(rows))
  return p == 0 or (epsilon > 0 and p <= epsilon)
end
local function hold_rows(upstream, id, worst, rows)
  if rows == '' then return end
  redis.call('HSET', prefix .. ':rows:' .. owner, id, with_worst(worst, rows))
  redis.call('HINCRBY', worst_key, upstream, worst)
  add_rows(upstream, parse(rows), 1)
end
""" + _REREGISTER


def encode_rows(log_mgf: np.ndarray) -> bytes:
    """A reservation's rows as the scripts read them: row-major little-endian doubles (exact)."""
    return np.ascontiguousarray(log_mgf, dtype="<f8").tobytes()


class RedisStatisticalLedger(RedisLedger):
    """The shared ledger under the statistical policy; see the module docstring. `reserve` (the
    guaranteed rule) stays available; the statistical one is `reserve_rows`."""

    def __init__(self, url: str, *, epsilon: float, **kwargs: Any) -> None:
        if not 0.0 <= epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
        super().__init__(url, **kwargs)
        self.epsilon = epsilon
        self._budgets: dict[str, int] = {}
        for name, source in (("reserve_rows", _RESERVE_ROWS), ("progress", _PROGRESS), ("overflow", _OVERFLOW),
                             ("bound_of", _BOUND_OF), ("reregister", _REREGISTER_ROWS)):
            self._scripts[name] = type(self._scripts["reserve"])(source)
        self._updates: set[asyncio.Task[None]] = set()
        self.last_probability = 0.0  # the bound the last reserve_rows computed

    async def reserve_rows(self, upstream: str, reservation_id: str, blocks: int, budget_blocks: int,
                           worst: int, log_mgf: np.ndarray) -> bool:
        """Hold `blocks` of `upstream` if every replica's worst cases plus `worst` fit the budget,
        or the Chernoff bound of their rows plus `log_mgf` is within epsilon. Idempotent by id,
        given back later if it raised, as RedisLedger.reserve."""
        self._check_started()
        if blocks < 1 or worst < 0:
            raise ValueError(f"a reservation needs at least 1 block, got {blocks}")
        granted, _, _, _, p = await self._admit(
            reservation_id, "reserve_rows", upstream, reservation_id, blocks, budget_blocks, repr(self.epsilon),
            worst, encode_rows(log_mgf))
        self.last_probability = float(p)
        return bool(granted)

    def _epsilon_arg(self) -> str:
        return repr(self.epsilon)

    async def progress(self, reservation_id: str, log_mgf: np.ndarray) -> bool:
        """Replace a held reservation's rows (its law conditioned on what it streamed); False if
        it is not held (released already, or never granted)."""
        self._check_started()
        epoch = self._epoch
        replaced, had, reclaimed = await self._run("progress", reservation_id, encode_rows(log_mgf))
        self._lease_seen(had, reclaimed, epoch)
        return bool(replaced)

    def progress_soon(self, reservation_id: str, log_mgf: np.ndarray) -> None:
        """progress without awaiting; best effort (an update Redis does not take leaves the older rows)."""
        async def update() -> None:
            try:
                await self.progress(reservation_id, log_mgf)
            except (LedgerUnavailableError, RuntimeError):
                pass
        task = asyncio.get_running_loop().create_task(update())
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)

    async def bound(self, upstream: str, budget_blocks: int, worst: int = 0,
                    log_mgf: np.ndarray | None = None) -> float:
        """What the reserve script would compute for a candidate now (0 when the worst cases fit);
        changes nothing."""
        self._check_started()
        rows = b"" if log_mgf is None else encode_rows(log_mgf)
        return float(await self._run("bound_of", upstream, budget_blocks, worst, rows))

    async def set_budgets(self, budgets: Any, limits: Any = None) -> None:
        self._budgets.update(budgets)
        await super().set_budgets(budgets, limits)

    async def overflow_probabilities(self, budgets: dict[str, int] | None = None) -> dict[str, float]:
        """Per upstream, the bound on P(every replica's held KV outgrows its budget), by the script."""
        self._check_started()
        budgets = budgets if budgets is not None else self._budgets
        args: list[str | int] = []
        for upstream, blocks in budgets.items():
            args += [upstream, blocks]
        out = await self._run("overflow", *args)
        self.reclaimed += int(out[0])
        return {u: float(p) for u, p in zip(budgets, out[1:], strict=True)}

    async def snapshot(self) -> dict[str, LedgerSnapshot]:
        snap = await super().snapshot()
        budgets = {u: s.budget_blocks for u, s in snap.items()}
        probabilities = await self.overflow_probabilities(budgets) if budgets else {}
        return {u: LedgerSnapshot(s.budget_blocks, s.reserved_blocks, s.inflight_requests,
                                  s.release_rate_blocks_per_s, s.limit_blocks, probabilities[u])
                for u, s in snap.items()}

    async def sums(self, upstream: str) -> tuple[int, list[float]]:
        """The stored worst-case sum and row sums of `upstream` (for tests and audits)."""
        self._check_started()
        worst = await self._redis.hget(f"{self.key_prefix}:worst", upstream)
        rows = await self._redis.hget(f"{self.key_prefix}:stat", upstream)
        return int(worst or 0), np.frombuffer(rows or b"", dtype="<f8").tolist()


__all__ = ["RedisStatisticalLedger", "encode_rows"]
