"""The shared ledger (kvtune.gateway.redis_ledger) against a real redis-server (tests/support/redis_server.py).

Every invariant is read from Redis itself by an audit script of this module (not the store's own
code): each upstream's counter equals the sum of the reservation records, and never exceeds its budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from kvtune.errors import EndpointError, LedgerUnavailableError
from kvtune.gateway.redis_ledger import SWEEP_OWNERS, RedisLedger

WORKER = Path(__file__).resolve().parents[1] / "support" / "redis_ledger_worker.py"
REPO = Path(__file__).resolve().parents[2]

# Each upstream's counter, the sum of the records held under it, and how many: an oracle
# independent of the store's scripts (it reads every P:res:* hash).
AUDIT = """
local counters = redis.call('HGETALL', ARGV[1] .. ':reserved')
local sums, counts = {}, {}
for _, key in ipairs(redis.call('KEYS', ARGV[1] .. ':res:*')) do
  for _, v in ipairs(redis.call('HVALS', key)) do
    local b, u = string.match(v, '^(%d+) (.*)$')
    sums[u] = (sums[u] or 0) + tonumber(b)
    counts[u] = (counts[u] or 0) + 1
  end
end
local out = {}
for i = 1, #counters, 2 do
  local u = counters[i]
  table.insert(out, u); table.insert(out, tonumber(counters[i + 1]))
  table.insert(out, sums[u] or 0); table.insert(out, counts[u] or 0)
  sums[u] = nil
end
for u, s in pairs(sums) do
  table.insert(out, u); table.insert(out, -1); table.insert(out, s); table.insert(out, counts[u])
end
return out
"""


def audit(client: redis.Redis, prefix: str) -> dict[str, tuple[int, int, int]]:
    """upstream -> (counter, sum of records, records), in one atomic read."""
    out = client.eval(AUDIT, 0, prefix)
    return {out[i].decode(): (int(out[i + 1]), int(out[i + 2]), int(out[i + 3])) for i in range(0, len(out), 4)}


def run(coro):
    return asyncio.run(coro)


# --- one store, one Redis ------------------------------------------------------------------------


def test_grants_up_to_the_budget_exactly_and_refuses_past_it(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 4, 10)
            assert await ledger.reserve("u", "r2", 6, 10)  # 10 of 10: the edge itself fits
            assert not await ledger.reserve("u", "r3", 1, 10)
            assert await ledger.reserved("u") == 10
            assert await ledger.release("r1")
            assert not await ledger.reserve("u", "r4", 5, 10)  # 6 + 5 > 10: nothing is held
            assert await ledger.reserve("u", "r4", 4, 10)
            snap = (await ledger.snapshot())["u"]
            assert (snap.budget_blocks, snap.reserved_blocks, snap.inflight_requests) == (10, 10, 2)

    run(go())


def test_reserve_is_idempotent_for_the_same_id(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 7, 10)
            assert await ledger.reserve("u", "r1", 7, 10)  # again (a retried reply): granted, unchanged
            snap = (await ledger.snapshot())["u"]
            assert (snap.reserved_blocks, snap.inflight_requests) == (7, 1)
            assert await ledger.release("r1")
            assert await ledger.reserved("u") == 0

    run(go())


def test_release_is_exactly_once_and_an_unknown_id_changes_nothing(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 3, 10)
            assert await ledger.reserve("u", "r2", 2, 10)
            assert await ledger.release("r1")
            assert not await ledger.release("r1")
            assert not await ledger.release("never-reserved")
            snap = (await ledger.snapshot())["u"]
            assert (snap.reserved_blocks, snap.inflight_requests) == (2, 1)
            assert snap.release_rate_blocks_per_s > 0

    run(go())


def test_upstreams_have_their_own_budgets(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            await ledger.set_budgets({"http://e1": 8, "http://e2": 3}, limits={"http://e2": 4})
            assert {k: (v.budget_blocks, v.limit_blocks, v.reserved_blocks)
                    for k, v in (await ledger.snapshot()).items()} == {"http://e1": (8, 8, 0), "http://e2": (3, 4, 0)}
            assert await ledger.reserve("http://e1", "a1", 8, 8)
            assert not await ledger.reserve("http://e1", "a2", 1, 8)
            assert await ledger.reserve("http://e2", "b1", 3, 3)  # e1 full does not touch e2
            assert await ledger.release("a1")
            assert await ledger.reserved("http://e2") == 3
            assert not await ledger.reserve("http://e2", "b2", 1, 3)

    run(go())


def test_two_owners_share_one_budget_and_release_only_their_own(redis_server):
    async def go():
        a = RedisLedger(redis_server.url, owner="gw-a", key_prefix="t", op_timeout_s=2)
        b = RedisLedger(redis_server.url, owner="gw-b", key_prefix="t", op_timeout_s=2)
        await a.start()
        await b.start()
        try:
            assert await a.reserve("u", "x", 6, 10)
            assert not await b.reserve("u", "y", 5, 10)  # what a holds counts for b
            assert not await b.release("x")  # b cannot give back a's reservation
            assert await b.reserve("u", "y", 4, 10)
            assert await a.reserved("u") == 10
        finally:
            await a.aclose()
            await b.aclose()
        client = redis.Redis.from_url(redis_server.url)
        assert audit(client, "t") == {"u": (0, 0, 0)}  # closing retires each owner's reservations
        client.close()

    run(go())


def test_noscript_after_script_flush_is_recovered(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 2, 10)
            loads = ledger.script_loads
            client = redis.Redis.from_url(redis_server.url)
            client.script_flush()
            client.close()
            assert await ledger.reserve("u", "r2", 2, 10)  # NOSCRIPT -> SCRIPT LOAD -> EVALSHA
            assert await ledger.release("r1")
            assert ledger.script_loads == loads + 2  # reserve's and release's scripts, once each
            assert await ledger.reserved("u") == 2

    run(go())


def test_keys_live_under_the_prefix(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="{gw1}") as one, \
                RedisLedger(redis_server.url, owner="a", key_prefix="gw2") as two:
            assert await one.reserve("u", "r", 10, 10)
            assert await two.reserve("u", "r", 10, 10)  # another prefix is another ledger
            client = redis.Redis.from_url(redis_server.url)
            keys = sorted(k.decode() for k in client.keys("*"))
            client.close()
            assert all(k.startswith(("{gw1}:", "gw2:")) for k in keys)
            assert "{gw1}:res:a" in keys and "gw2:res:a" in keys

    run(go())


def test_an_expired_lease_is_reclaimed_and_its_owner_does_not_release_twice(redis_server):
    """A partition: a's heartbeat stops (heartbeat=False stands for it) for longer than its lease."""

    async def go():
        a = RedisLedger(redis_server.url, owner="gw-a", key_prefix="t", lease_s=0.3)
        b = RedisLedger(redis_server.url, owner="gw-b", key_prefix="t", lease_s=5)
        await a.start(heartbeat=False)
        await b.start()
        try:
            assert await a.reserve("u", "x", 6, 10)
            assert await b.reserve("u", "y", 4, 10)
            await asyncio.sleep(0.5)
            assert await b.reserve("u", "z", 6, 10)  # b's script swept a away: 4 + 6 fit
            assert b.reclaimed == 1
            assert not await a.release("x")  # a comes back: its release changes nothing
            assert a.leases_lost == 1  # and a learns its lease was lost
            assert await a.reserved("u") == 10
            assert not await a.renew()  # fenced: a lapsed lease is not renewed, it is taken again
            await a.reregister()  # under a new epoch
            assert await a.renew() and a.leases_lost == 1
        finally:
            await a.aclose()
            await b.aclose()

    run(go())


def test_one_script_reclaims_at_most_sweep_owners_and_the_next_ones_the_rest(redis_server):
    """20 owners die at once (their deadlines set in the past in P:owners, so no lease lapses while
    the others are still being set up on a loaded host): one script reclaims SWEEP_OWNERS of them
    and the next script the rest."""

    async def go():
        # op_timeout_s well above the default: what is claimed is the sweep's bound, not Redis' latency
        # on a host the other tests load (a call past 0.5 s failed this test in CI)
        live = RedisLedger(redis_server.url, owner="live", key_prefix="t", lease_s=5, op_timeout_s=4)
        await live.start(heartbeat=False)
        dead = [RedisLedger(redis_server.url, owner=f"dead-{i}", key_prefix="t", lease_s=60, op_timeout_s=4)
                for i in range(20)]
        try:
            for i, ledger in enumerate(dead):
                await ledger.start(heartbeat=False)
                assert await ledger.reserve("u", f"r{i}", 1, 100)
            assert live.reclaimed == 0
            redis.Redis.from_url(redis_server.url).zadd("t:owners", {f"dead-{i}": 0 for i in range(20)})
            await live.renew()
            assert live.reclaimed == SWEEP_OWNERS  # a bounded pause for Redis, whatever died
            assert await live.reserved("u") == 0  # and the next script takes the rest
            assert live.reclaimed == 20
        finally:
            await live.aclose()
            for ledger in dead:
                await ledger.aclose(retire=False)

    run(go())


def test_release_soon_is_given_back_by_the_heartbeat(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 5, 10)
            ledger.release_soon("r1")  # no await: as a `finally` does
            for _ in range(100):
                if await ledger.reserved("u") == 0:
                    break
                await asyncio.sleep(0.01)
            assert await ledger.reserved("u") == 0
            assert ledger.pending_releases == 0

    run(go())


def test_a_reserve_landing_after_its_queued_release_is_refused(redis_server):
    """A cancelled reserve's command may reach Redis after the release the store queued for it
    (another connection): the release leaves a tombstone and the late reserve is refused."""

    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            ledger.release_soon("late")  # as after a cancelled reserve of "late"
            for _ in range(100):
                if ledger.pending_releases == 0:
                    break
                await asyncio.sleep(0.01)
            assert not await ledger.reserve("u", "late", 2, 10)  # the command lands now: refused
            assert await ledger.reserve("u", "fresh", 2, 10)
            assert await ledger.reserved("u") == 2

    run(go())


def test_lifecycle_refuses_reuse_and_closes_idempotently(redis_server):
    async def go():
        ledger = RedisLedger(redis_server.url, owner="a", key_prefix="t")
        with pytest.raises(RuntimeError, match="not started"):
            await ledger.reserve("u", "r", 1, 10)
        await ledger.start()
        with pytest.raises(RuntimeError, match="cannot be started twice"):
            await ledger.start()
        assert await ledger.reserve("u", "r", 3, 10)
        await ledger.aclose()  # retires: r is given back
        await ledger.aclose()
        with pytest.raises(RuntimeError, match="closed, not started"):
            await ledger.release("r")
        async with RedisLedger(redis_server.url, owner="b", key_prefix="t") as other:
            assert await other.reserved("u") == 0

    run(go())


def test_no_redis_is_one_typed_error(redis_server):
    url = redis_server.url
    redis_server.kill()

    async def go():
        ledger = RedisLedger(url, owner="a", key_prefix="t")
        began = time.monotonic()
        with pytest.raises(LedgerUnavailableError) as caught:
            await ledger.start()
        assert time.monotonic() - began < 1.0
        assert isinstance(caught.value, EndpointError)
        assert str(caught.value).startswith(f"ledger t: the shared ledger at {url} failed: ")
        await ledger.aclose()
        with pytest.raises(LedgerUnavailableError):  # `async with` closes what it started, too
            async with RedisLedger(url, owner="b", key_prefix="t"):
                pass

    run(go())


def test_a_store_started_while_redis_is_down_works_once_it_is_up(redis_server):
    redis_server.stop()

    async def go():
        ledger = RedisLedger(redis_server.url, owner="a", key_prefix="t", lease_s=0.6)
        with pytest.raises(LedgerUnavailableError):
            await ledger.start()
        try:
            assert not ledger.available
            await asyncio.to_thread(redis_server.start)
            await asyncio.sleep(0.5)  # the heartbeat (every 0.2 s) reconnects and takes the lease
            assert ledger.available
            client = redis.Redis.from_url(redis_server.url)
            assert client.zscore("t:owners", "a") is not None
            client.close()
            assert await ledger.reserve("u", "r1", 3, 10)
        finally:
            await ledger.aclose()

    run(go())


def test_a_cancelled_reserve_is_given_back(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            for n in range(4):  # cancelled at each step of its way: sent, run by Redis, reply not read
                task = asyncio.create_task(ledger.reserve("u", f"r{n}", 4, 10))
                for _ in range(n):
                    await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):  # never swallowed (asyncio.wait_for on 3.11 did)
                    await task
            for _ in range(100):
                if ledger.pending_releases == 0:
                    break
                await asyncio.sleep(0.01)
            assert await ledger.reserved("u") == 0

    run(go())


def test_a_hung_redis_times_out_with_the_typed_error_and_recovers(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t", op_timeout_s=0.3) as ledger:
            assert await ledger.reserve("u", "r1", 2, 10)
            os.kill(redis_server.process.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                with pytest.raises(LedgerUnavailableError, match="timed out"):
                    await ledger.reserve("u", "r2", 2, 10)
                assert time.monotonic() - began < 0.6
            finally:
                os.kill(redis_server.process.pid, signal.SIGCONT)
            assert await ledger.reserve("u", "r3", 2, 10)
            for _ in range(100):  # r2 was queued for release in case Redis had recorded it
                if ledger.pending_releases == 0:
                    break
                await asyncio.sleep(0.01)
            assert await ledger.reserved("u") == 4

    run(go())


def test_a_dead_redis_raises_the_typed_error_and_queues_the_reserve_for_release(redis_server):
    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 2, 10)
            redis_server.kill()
            for call in (ledger.reserve("u", "r2", 2, 10), ledger.release("r1"), ledger.snapshot(), ledger.renew()):
                with pytest.raises(LedgerUnavailableError):
                    await call
            assert ledger.pending_releases == 2  # r2 in case Redis recorded it before dying, and r1

    run(go())


def test_state_survives_a_persistent_restart(make_redis):
    server = make_redis(appendonly=True)

    async def go():
        async with RedisLedger(server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 3, 10)
            assert await ledger.reserve("u", "r2", 4, 10)
            server.restart()
            assert await ledger.reserved("u") == 7  # reconnected, scripts reloaded, state from the AOF
            assert await ledger.release("r1")
            assert not await ledger.reserve("u", "r3", 7, 10)
            assert await ledger.reserved("u") == 4

    run(go())


def test_a_restart_without_persistence_forgets_what_was_in_flight(redis_server):
    """What the module docstring warns about: run Redis with appendonly for the shared ledger."""

    async def go():
        async with RedisLedger(redis_server.url, owner="a", key_prefix="t") as ledger:
            assert await ledger.reserve("u", "r1", 10, 10)
            redis_server.restart()
            assert await ledger.reserved("u") == 0  # the engine still runs r1's request
            assert await ledger.reserve("u", "r2", 10, 10)  # a second budget's worth is admitted
            assert not await ledger.release("r1")  # and r1's release finds nothing
            assert ledger.leases_lost == 1

    run(go())


# --- many processes, one Redis -------------------------------------------------------------------


class Sampler:
    """Audits Redis every 10 ms in a thread: each counter equals its records, within its budget."""

    def __init__(self, url: str, prefix: str, budgets: dict[str, int]) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.2)
        self.prefix = prefix
        self.budgets = budgets
        self.samples = 0
        self.unreachable = 0
        self.peak = dict.fromkeys(budgets, 0)
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            try:
                seen = audit(self.client, self.prefix)
            except redis.RedisError:
                self.unreachable += 1
                continue
            self.samples += 1
            for upstream, (counter, records, _) in seen.items():
                self.peak[upstream] = max(self.peak.get(upstream, 0), counter)
                if counter != records or counter > self.budgets[upstream]:
                    self.violations.append(f"{upstream}: counter {counter}, records {records}")


def spawn_worker(cfg: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_line(process: subprocess.Popen, timeout_s: float) -> dict:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        process.kill()
        pytest.fail(f"worker said nothing within {timeout_s} s: {process.stderr.read()}")
    line = process.stdout.readline()
    if not line:
        pytest.fail(f"worker exited with {process.wait()}: {process.stderr.read()}")
    return json.loads(line)


RACE_BUDGETS = {"http://engine-1": 48, "http://engine-2": 24}


@pytest.mark.slow
def test_three_processes_race_and_never_exceed_a_budget(redis_server):
    budgets = RACE_BUDGETS
    cfgs = [{"url": redis_server.url, "prefix": "race", "owner": f"gw-{i}", "lease_s": 10, "budgets": budgets,
             "seed": i, "concurrency": 40, "max_blocks": 8, "hold_ms": [0, 12], "grants": 1667, "cancel_p": 0.05}
            for i in range(3)]
    began = time.monotonic()
    with Sampler(redis_server.url, "race", budgets) as sampler, contextlib.ExitStack() as stack:
        workers = [stack.enter_context(spawn_worker(cfg)) for cfg in cfgs]
        results = [read_line(w, 60) for w in workers]
        for w in workers:
            assert w.wait(10) == 0, w.stderr.read()
    seconds = time.monotonic() - began
    client = redis.Redis.from_url(redis_server.url)
    final = audit(client, "race")
    client.close()
    print(f"race: {sum(r['granted'] for r in results)} granted, {sum(r['refused'] for r in results)} refused, "
          f"{sum(r['cancelled'] for r in results)} cancelled, {sum(r['unavailable'] for r in results)} unavailable, "
          f"{sampler.samples} samples, peaks {sampler.peak}, {seconds:.1f} s")
    assert sampler.violations == []
    assert sampler.samples >= 40 * seconds
    assert sum(r["cancelled"] for r in results) > 100  # clients that went away mid-reserve
    assert sum(r["granted"] for r in results) >= 5000
    assert all(r["not_released"] == 0 and r["released"] == r["granted"] for r in results)
    assert all(r["held_at_end"] == 0 and r["leases_lost"] == 0 for r in results)
    assert sum(r["refused"] for r in results) > 0  # the budgets were contended
    assert all(sampler.peak[u] > budgets[u] // 2 for u in budgets)
    assert final == dict.fromkeys(budgets, (0, 0, 0))


@pytest.mark.slow
@pytest.mark.parametrize("churn", [8, 0], ids=["under-load", "idle"])
def test_a_killed_replica_is_reclaimed_within_its_lease_and_the_others_are_untouched(redis_server, churn):
    """Under load the survivors' reserves sweep the dead owner; idle, only their heartbeats do."""
    lease_s = 2.0
    budgets = {"http://engine-1": 300, "http://engine-2": 200}
    cfgs = [{"url": redis_server.url, "prefix": "crash", "owner": f"gw-{i}", "lease_s": lease_s, "budgets": budgets,
             "seed": i, "concurrency": churn, "max_blocks": 4, "hold_ms": [5, 30], "fixed": 10} for i in range(3)]
    client = redis.Redis.from_url(redis_server.url)
    with Sampler(redis_server.url, "crash", budgets) as sampler, contextlib.ExitStack() as stack:
        workers = [stack.enter_context(spawn_worker(cfg)) for cfg in cfgs]
        try:
            fixed = [read_line(w, 30)["ready"] for w in workers]
            time.sleep(0.5)  # churn under way in all three
            victim, survivors = workers[0], workers[1:]
            held_at_kill = client.hlen("crash:res:gw-0")
            assert held_at_kill >= 20 if churn else held_at_kill == 20
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            victim.wait(5)
            while client.exists("crash:res:gw-0") or client.zscore("crash:owners", "gw-0") is not None:
                assert time.monotonic() - killed < lease_s + 1.0, "the killed replica's reservations outlived its lease"
                time.sleep(0.02)
            gone_after = time.monotonic() - killed
            seen = audit(client, "crash")  # the victim's blocks are back: counters equal the survivors' records
            assert all(counter == records for counter, records, _ in seen.values())
            for owner, ids in zip(("gw-1", "gw-2"), fixed[1:], strict=True):
                assert all(client.hexists(f"crash:res:{owner}", rid) for rid in ids)
            for w in survivors:
                w.stdin.write("stop\n")
                w.stdin.flush()
            results = [read_line(w, 30) for w in survivors]
            for w in survivors:
                assert w.wait(10) == 0, w.stderr.read()
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
    print(f"crash ({churn} tasks each): {held_at_kill} held by the killed replica, gone {gone_after:.2f} s after SIGKILL (lease {lease_s} s)")
    assert [r["fixed_released"] for r in results] == [20, 20]  # every survivor's long-held reservation was intact
    assert all(r["not_released"] == 0 and r["held_at_end"] == 0 and r["leases_lost"] == 0 for r in results)
    assert sampler.violations == []
    assert audit(client, "crash") == dict.fromkeys(budgets, (0, 0, 0))
    client.close()


@pytest.mark.slow
def test_a_redis_restart_mid_load_admits_nothing_it_cannot_record_and_resumes_by_itself(make_redis):
    server = make_redis(appendonly=True)
    budgets = RACE_BUDGETS
    rng = random.Random(7)
    counts = {"granted": 0, "raised": 0, "granted_after": 0, "release_raised": 0}
    raised_ids: list[str] = []
    phase = {"down": False, "back": False}

    async def go():
        async with RedisLedger(server.url, owner="gw", key_prefix="rs", lease_s=5) as ledger:
            stop = asyncio.Event()
            serial = 0

            async def one_task():
                nonlocal serial
                while not stop.is_set():
                    serial += 1
                    rid = f"r{serial}"
                    upstream = rng.choice(sorted(budgets))
                    try:
                        granted = await ledger.reserve(upstream, rid, rng.randint(1, 8), budgets[upstream])
                    except LedgerUnavailableError:
                        counts["raised"] += 1
                        raised_ids.append(rid)
                        await asyncio.sleep(0.05)
                        continue
                    if not granted:
                        await asyncio.sleep(0.002)
                        continue
                    counts["granted"] += 1
                    counts["granted_after"] += phase["back"]
                    try:
                        await asyncio.sleep(rng.uniform(0.002, 0.02))
                    finally:
                        try:
                            await ledger.release(rid)
                        except LedgerUnavailableError:
                            counts["release_raised"] += 1
                            ledger.release_soon(rid)

            async def timeline():
                await asyncio.sleep(1.0)
                loads = ledger.script_loads
                await asyncio.to_thread(server.stop)
                phase["down"] = True
                await asyncio.sleep(1.0)
                down_raised = counts["raised"]
                await asyncio.to_thread(server.start)
                phase["back"] = True
                await asyncio.sleep(1.5)
                stop.set()
                return loads, down_raised

            async with asyncio.TaskGroup() as group:
                for _ in range(30):
                    group.create_task(one_task())
                line = group.create_task(timeline())
            loads, down_raised = line.result()
            for _ in range(300):
                if ledger.pending_releases == 0:
                    break
                await asyncio.sleep(0.01)
            assert ledger.pending_releases == 0
            assert ledger.script_loads > loads  # NOSCRIPT after the restart: reloaded by itself
            return down_raised

    with Sampler(server.url, "rs", budgets) as sampler:
        down_raised = run(go())
    client = redis.Redis.from_url(server.url)
    final = audit(client, "rs")
    client.close()
    print(f"restart: {counts}, sampler {sampler.samples} samples, {sampler.unreachable} unreachable")
    assert down_raised > 0 and sampler.unreachable > 0  # it was down, and said so with the typed error
    assert counts["granted_after"] > 100  # admission resumed by itself
    assert sampler.violations == []
    # nothing a raised reserve may have recorded, nor any release that raised, is left behind
    assert final == dict.fromkeys(budgets, (0, 0, 0))


def test_the_error_line_never_shows_the_password():
    async def go():
        with pytest.raises(LedgerUnavailableError) as caught:
            async with RedisLedger("redis://gw:s3cret@127.0.0.1:1/0", owner="a", key_prefix="t"):
                pass
        assert "s3cret" not in str(caught.value)
        assert "redis://gw:***@127.0.0.1:1/0" in str(caught.value)

    run(go())


# --- a lost lease: what still runs is held again -------------------------------------------------

def test_a_lost_lease_holds_what_still_runs_again_as_far_as_it_fits_and_releases_it_once(redis_server):
    """a is paused past its lease (heartbeat=False stands for it): b sweeps its three reservations
    and admits into the room. a's renew reports the loss; one re-registration script holds again
    those of a's requests that fit now (in order), counts the one that does not, and tries it
    again once b's release makes room. Each release then gives back exactly once."""
    from kvtune.gateway.redis_ledger import InFlight

    async def go():
        a = RedisLedger(redis_server.url, owner="gw-a", key_prefix="t", lease_s=0.3)
        b = RedisLedger(redis_server.url, owner="gw-b", key_prefix="t", lease_s=5)
        running = {rid: InFlight(rid, "u", 3, 10) for rid in ("x1", "x2", "x3")}
        a.in_flight = lambda: list(running.values())
        await a.start(heartbeat=False)
        await b.start()
        try:
            for rid in running:
                assert await a.reserve("u", rid, 3, 10)
            await asyncio.sleep(0.5)
            assert await b.reserve("u", "y", 3, 10)  # b's script swept a's 9 blocks away
            assert await b.reserved("u") == 3
            assert not await a.renew() and a.leases_lost == 1  # a learns it
            await a.reregister()
            assert (a.reregistered, a.reregister_over, a.unregistered) == (2, 1, 1)  # 3 + 3 + 3 fit, not 4 x 3
            assert await a.reserved("u") == 9 and await a.held() == 2
            assert audit(redis.Redis.from_url(redis_server.url), "t") == {"u": (9, 9, 3)}
            assert not await b.reserve("u", "z", 3, 10)  # new admissions see what a runs
            await a.reregister()  # no room yet: still out
            assert a.unregistered == 1 and await a.reserved("u") == 9
            assert await b.release("y")
            await a.reregister()  # a heartbeat's retry: x3 fits now
            assert (a.reregistered, a.reregister_over, a.unregistered) == (3, 1, 0)
            assert await a.reserved("u") == 9 and await a.held() == 3
            await a.reregister()  # nothing lost, nothing out: no script
            for rid in list(running):
                assert await a.release(rid)
                assert not await a.release(rid)  # exactly once
                del running[rid]
            assert await a.reserved("u") == 0 and a.leases_lost == 1
        finally:
            await a.aclose()
            await b.aclose()

    run(go())


def test_a_release_racing_the_reregistration_gives_back_exactly_once(redis_server):
    """A request that ends while the re-registration script is on its way, its release landing
    just before or after the script (a release finding nothing then leaves a tombstone the
    script honours): either way nothing of it stays held, and the other is held once."""
    from kvtune.gateway.redis_ledger import InFlight

    async def go():
        a = RedisLedger(redis_server.url, owner="gw-a", key_prefix="t", lease_s=0.2)
        races: list[asyncio.Task[bool]] = []

        def running() -> list[InFlight]:  # read as the script leaves; the release races it
            async def release_late(delay: float) -> bool:
                await asyncio.sleep(delay)
                return await a.release("x2")
            races.append(asyncio.get_running_loop().create_task(release_late(0.0005 * len(races))))
            return [InFlight("x1", "u", 3, 10), InFlight("x2", "u", 3, 10)]

        a.in_flight = running
        await a.start(heartbeat=False)
        try:
            async with RedisLedger(redis_server.url, owner="sweeper", key_prefix="t") as sweeper:
                for _ in range(8):
                    assert await a.reserve("u", "x1", 3, 10) and await a.reserve("u", "x2", 3, 10)
                    await asyncio.sleep(0.3)
                    assert await sweeper.reserved("u") == 0  # swept
                    assert not await a.renew()
                    await a.reregister()
                    await races[-1]
                    assert await a.reserved("u") == 3 and await a.held() == 1  # x1 only, once
                    assert await a.release("x1") and not await a.release("x1")
                    assert await a.reserved("u") == 0
            print("release before the script:", sum(not t.result() for t in races), "of", len(races))
        finally:
            await a.aclose()

    run(go())


def test_the_heartbeat_holds_what_still_runs_again_by_itself(redis_server):
    """With its heartbeat on: a's renewals stop for longer than its lease (its task is paused by a
    blocking sleep, as a GC pause would), a sweeper reclaims a's rows; when a's loop runs again its
    heartbeat finds the loss and holds everything again, without anyone calling it."""
    from kvtune.gateway.redis_ledger import InFlight

    async def go():
        a = RedisLedger(redis_server.url, owner="gw-a", key_prefix="t", lease_s=0.6)
        a.in_flight = lambda: [InFlight("x", "u", 4, 10)]
        async with a, RedisLedger(redis_server.url, owner="sweeper", key_prefix="t", lease_s=5) as sweeper:
            assert await a.reserve("u", "x", 4, 10)
            time.sleep(0.9)  # the whole loop stalls: no renewal
            for _ in range(100):
                if await sweeper.reserved("u") == 4:
                    break
                await asyncio.sleep(0.02)
            assert await sweeper.reserved("u") == 4 and a.leases_lost >= 1 and a.reregistered >= 1
            assert await a.release("x") and await sweeper.reserved("u") == 0

    run(go())
