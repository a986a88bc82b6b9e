"""The Python gateway's flow-control queue (gateway.yaml `flow:`, docs/guides/flow-control.md) in
front of the fake vLLM on loopback: a request that cannot make its band's deadline is 429 at once,
the interactive band is served before batch, a flooding tenant does not hold back another, the
counts reach /metrics and /kvtune/ledger (never the API key), and under a random load with
cancellations every block comes back."""

from __future__ import annotations

import asyncio
import random
import time

from enforcers import chat, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

URL = "/v1/chat/completions"


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def flow(token_time_s: float = 0.001, interactive_s: float = 60.0, **extra) -> dict:
    return {"token_time_s": token_time_s,
            "bands": [{"name": "interactive", "deadline_s": interactive_s}, {"name": "batch", "deadline_s": 60}],
            **extra}


def test_a_request_that_cannot_make_its_deadline_is_429_at_once_and_batch_waits():
    async def run():
        # the held request (50 blocks, cap 64) ends 64 x 0.1 = 6.4 s from now by the forecast
        async with running(flow=flow(token_time_s=0.1, interactive_s=1.0)) as (session, base, gateway, fake):
            hold = asyncio.create_task(session.post(f"{base}{URL}", json=chat(736, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 50)
            started = time.monotonic()
            async with session.post(f"{base}{URL}", json=chat(896)) as resp:  # 60 blocks: does not fit
                body = await resp.json()
                assert resp.status == 429 and body["error"]["code"] == "deadline_unreachable"
                assert resp.headers["Retry-After"] == "7"
            assert time.monotonic() - started < 0.5  # at once, not after waiting in vain
            batch = asyncio.create_task(session.post(f"{base}{URL}", json=chat(896),
                                                     headers={"x-kvtune-priority": "batch"}))
            await wait_for(lambda: gateway.admission.waiting == 1)
            fake.release()
            (await hold).release()
            resp = await batch
            assert resp.status == 200
            resp.release()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)
            assert gateway.admission.queue.gate.held_count == 0

    asyncio.run(run())


def test_interactive_before_batch_and_a_flooding_tenant_does_not_hold_back_another():
    async def run():
        async with running(flow=flow()) as (session, base, gateway, fake):
            hold = asyncio.create_task(session.post(f"{base}{URL}", json=chat(1536, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 100)
            # each needs 60 blocks: one at a time, so the engine sees them in the order granted
            sent = []

            async def call(name: str, headers: dict) -> int:
                async with session.post(f"{base}{URL}", json=chat(896, x_id=name), headers=headers) as resp:
                    await resp.read()
                    return resp.status
            for name, headers in [("A1", {"x-kvtune-flow": "A", "x-kvtune-priority": "batch"}),
                                  ("A2", {"x-kvtune-flow": "A", "x-kvtune-priority": "batch"}),
                                  ("A3", {"x-kvtune-flow": "A", "x-kvtune-priority": "batch"}),
                                  ("B1", {"x-kvtune-flow": "B", "x-kvtune-priority": "batch"}),
                                  ("I1", {"Authorization": "Bearer sk-very-secret"})]:
                sent.append(asyncio.create_task(call(name, headers)))
                queued = len(sent)
                await wait_for(lambda: gateway.admission.waiting == queued)  # noqa: B023 (awaited here)
            fake.release()
            (await hold).release()
            assert await asyncio.gather(*sent) == [200] * 5
            assert [b.get("x_id") for b in fake.seen[1:]] == ["I1", "A1", "B1", "A2", "A3"]
            async with session.get(f"{base}/kvtune/ledger") as resp:
                ledger = await resp.json()
            async with session.get(f"{base}/metrics") as resp:
                metrics = await resp.text()
            batch = ledger["flow"]["bands"][1]
            assert batch["admitted"] == 4 and {f["flow"]: f["admitted"] for f in batch["flows"]} == {"A": 3, "B": 1}
            assert sorted(f["flow"][:4] for f in ledger["flow"]["bands"][0]["flows"]) == ["anon", "key-"]
            assert 'kvtune_gateway_flow_admitted_total{band="batch",flow="A"} 3.0' in metrics
            assert 'kvtune_gateway_flow_wait_seconds_count{band="batch",flow="B"} 1.0' in metrics
            assert "sk-very-secret" not in metrics and "sk-very-secret" not in str(ledger)
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)

    asyncio.run(run())


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16))
def test_under_load_with_cancellations_the_ledger_drains_to_zero(seed):
    rng = random.Random(seed)

    async def run():
        cfg = flow(token_time_s=0.002, interactive_s=0.3, max_waiting=12, max_waiting_per_flow=4)
        async with running(flow=cfg) as (session, base, gateway, fake):
            fake.itl_s = 0.002

            async def call(i: int) -> int:
                await asyncio.sleep(rng.random() * 0.3)
                headers = {"x-kvtune-flow": rng.choice("abc"), "x-kvtune-priority": rng.choice(["interactive", "batch"])}
                body = chat(rng.choice([100, 400, 900]), stream=rng.random() < 0.5)
                async with session.post(f"{base}{URL}", json=body, headers=headers) as resp:
                    await resp.read()
                    return resp.status

            tasks = [asyncio.create_task(call(i)) for i in range(40)]
            await asyncio.sleep(0.2)
            for task in rng.sample(tasks, 8):  # clients that leave, waiting or mid-answer
                task.cancel()
            statuses = [s for s in await asyncio.gather(*tasks, return_exceptions=True) if isinstance(s, int)]
            assert set(statuses) <= {200, 429} and 200 in statuses
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0 and gateway.admission.waiting == 0)
            assert gateway.ledger.inflight_requests == 0 and gateway.admission.queue.gate.held_count == 0
            bands = gateway.admission.queue.gate.report()["bands"]
            assert gateway.admission.queue.gate.waiting_peak >= 1 and sum(b["shed"] for b in bands) >= 1

    asyncio.run(run())
