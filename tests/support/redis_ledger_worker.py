"""One gateway replica's worth of ledger traffic, as its own OS process, for tests/integration/test_redis_ledger.py.

    python tests/support/redis_ledger_worker.py CONFIG_JSON

CONFIG_JSON: {"url", "prefix", "owner", "lease_s", "budgets": {upstream: blocks}, "seed",
"concurrency", "max_blocks", "hold_ms": [lo, hi], "grants": N (churn until N granted in all),
"cancel_p": p (cancel that share of reserves at a random step, as a client that goes away),
"fixed": K (reserve K long-held reservations per upstream first, print {"ready": [ids]}, then
churn until a line arrives on stdin)}. At the end it releases what it holds and prints one JSON
line: granted, refused, released (True answers, or queued after raising), not_released (False
answers), fixed_released, cancelled, unavailable (LedgerUnavailableError answers), held_at_end (what this
owner still held after its last release was given back: 0), leases_lost, seconds.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from kvtune.errors import LedgerUnavailableError
from kvtune.gateway.redis_ledger import RedisLedger


async def main(cfg: dict) -> dict:
    rng = random.Random(cfg["seed"])
    budgets: dict[str, int] = cfg["budgets"]
    upstreams = sorted(budgets)
    lo_ms, hi_ms = cfg["hold_ms"]
    counts = {"granted": 0, "refused": 0, "released": 0, "not_released": 0, "fixed_released": 0, "unavailable": 0,
              "cancelled": 0}
    target = cfg.get("grants")
    stop = asyncio.Event()
    started = time.monotonic()
    async with RedisLedger(cfg["url"], owner=cfg["owner"], key_prefix=cfg["prefix"], lease_s=cfg["lease_s"],
                           op_timeout_s=2.0) as ledger:  # this machine's 2 cores are shared
        fixed: list[str] = []
        for upstream in upstreams:
            for i in range(cfg.get("fixed", 0)):
                rid = f"{cfg['owner']}-fixed-{upstream}-{i}"
                if not await ledger.reserve(upstream, rid, rng.randint(1, cfg["max_blocks"]), budgets[upstream]):
                    raise SystemExit(f"fixed reservation {rid} refused: the test's budgets are too small")
                fixed.append(rid)
        if fixed:
            print(json.dumps({"ready": fixed}), flush=True)
            loop = asyncio.get_running_loop()

            def on_stdin() -> None:
                loop.remove_reader(sys.stdin.fileno())
                stop.set()

            loop.add_reader(sys.stdin.fileno(), on_stdin)
        serial = 0

        async def one_task() -> None:
            nonlocal serial
            while not stop.is_set() and (target is None or counts["granted"] < target):
                serial += 1
                rid = f"{cfg['owner']}-{serial}"
                upstream = rng.choice(upstreams)
                blocks = rng.randint(1, cfg["max_blocks"])
                try:
                    if rng.random() < cfg.get("cancel_p", 0.0):  # the client goes away mid-reserve
                        reserving = asyncio.create_task(ledger.reserve(upstream, rid, blocks, budgets[upstream]))
                        for _ in range(rng.randint(0, 3)):
                            await asyncio.sleep(0)
                        reserving.cancel()
                        try:
                            granted = await reserving
                        except asyncio.CancelledError:
                            counts["cancelled"] += 1  # the store gives it back if Redis recorded it
                            continue
                    else:
                        granted = await ledger.reserve(upstream, rid, blocks, budgets[upstream])
                except LedgerUnavailableError:  # a 503 at the gateway; the store gives it back if held
                    counts["unavailable"] += 1
                    continue
                if not granted:
                    counts["refused"] += 1
                    await asyncio.sleep(0.002)
                    continue
                counts["granted"] += 1
                await asyncio.sleep(rng.uniform(lo_ms, hi_ms) / 1000)
                try:
                    counts["released" if await ledger.release(rid) else "not_released"] += 1
                except LedgerUnavailableError:  # queued: the store gives it back when Redis answers
                    counts["unavailable"] += 1
                    counts["released"] += 1

        async with asyncio.TaskGroup() as group:
            for _ in range(cfg["concurrency"]):
                group.create_task(one_task())
        if fixed:
            await stop.wait()
        for rid in fixed:
            counts["fixed_released"] += await ledger.release(rid)
        for _ in range(500):
            if ledger.pending_releases == 0:
                break
            await asyncio.sleep(0.01)
        counts["held_at_end"] = await ledger.held()  # before closing retires whatever is left
        counts["leases_lost"] = ledger.leases_lost
    counts["seconds"] = round(time.monotonic() - started, 3)
    return counts


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
