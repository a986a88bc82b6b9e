"""Several upstreams behind one gateway, each with its own budget (kvtune.gateway.pool): over real
HTTP on loopback in front of several fake vLLMs (tests/support/fake_vllm.py). Routing by free budget,
health (a killed upstream is taken out within 2 s, one answering /health 200 again comes back),
a request whose connection is refused going to another upstream, every reservation released
exactly once on the upstream it was held on, the per-upstream ledger JSON and metrics; and
gateway.yaml's `upstreams:` parsed strictly."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from fake_vllm import FakeVllm
from hypothesis import given
from hypothesis import strategies as st
from ledger_race import wait_for

from kvtune.errors import InputError
from kvtune.gateway.config import GatewayConfig, GatewayUpstream, parse_gateway_config
from kvtune.gateway.ledger import BlockLedger
from kvtune.gateway.pool import UpstreamPool, local_ledger
from kvtune.gateway.proxy import GATEWAY, make_app, serve
from kvtune.gateway.statistical import StatisticalLedger

ROUTES = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64},
          {"name": "default", "max_new_tokens": 32}]


def doc(upstreams: list[dict], **overrides: Any) -> dict:
    return {"version": 1, "upstreams": upstreams, "block_size": 16, "max_model_len": 2048, "routes": ROUTES,
            "listen": {"port": 0}, **overrides}


def ten_blocks(**extra: Any) -> dict:
    """A chat request reserving exactly 10 blocks: 96 prompt tokens + the route's cap 64 = 160."""
    return {"model": "m", "messages": [{"role": "user", "content": " ".join(["w"] * 96)}], **extra}


class CountingLedger(BlockLedger):
    """An in-memory ledger that counts what it grants and what comes back (through the seam)."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.granted = 0
        self.given_back = 0

    def try_reserve(self, blocks, demand=None, keep_blocks=0):
        reservation = super().try_reserve(blocks, demand, keep_blocks)
        self.granted += reservation is not None
        return reservation

    def _give_back(self, reservation) -> None:
        self.given_back += 1
        super()._give_back(reservation)


def counting_ledgers(config: GatewayConfig, upstream: GatewayUpstream) -> BlockLedger:
    return CountingLedger(upstream.block_budget)


@contextlib.asynccontextmanager
async def gateway_over(fakes: list[FakeVllm], budgets: list[int], *, weights: list[float] | None = None,
                       make_ledger=local_ledger, **overrides: Any):
    """The gateway (run by `serve`, as the CLI runs it) in front of the started fakes; yields
    (session, base URL, Gateway)."""
    upstreams = [{"url": f.url, "block_budget": b} for f, b in zip(fakes, budgets, strict=True)]
    for u, w in zip(upstreams, weights or [], strict=False):
        u["weight"] = w
    config = parse_gateway_config(doc(upstreams, **overrides))
    app = make_app(config, make_ledger=make_ledger)
    stop = asyncio.Event()
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result, app=app))
    try:
        base = (await asyncio.wait_for(ready, 10)).split(",")[0]
        async with aiohttp.ClientSession() as session:
            yield session, base, app[GATEWAY]
    finally:
        stop.set()
        await asyncio.wait_for(server, 40)


async def ledger(session: aiohttp.ClientSession, base: str) -> dict:
    async with session.get(base + "/kvtune/ledger") as resp:
        assert resp.status == 200
        return await resp.json()


# ---------------------------------------------------------------- routing

def test_load_spreads_in_proportion_to_budgets():
    async def run():
        async with FakeVllm() as big, FakeVllm() as small:
            async with gateway_over([big, small], [200, 100]) as (session, base, gateway):
                held = [asyncio.create_task(session.post(base + "/v1/chat/completions",
                                                         json=ten_blocks(x_mode="hold"))) for _ in range(30)]
                await wait_for(lambda: big.active + small.active == 30)
                assert (big.active, small.active) == (20, 10)  # each full: 200 and 100 blocks
                a, b = gateway.pool.replicas
                assert (a.ledger.reserved_blocks, b.ledger.reserved_blocks) == (200, 100)
                async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
                    assert (await resp.json())["error"]["code"] == "kv_budget_exhausted"
                big.release()
                small.release()
                for resp in await asyncio.gather(*held):
                    assert resp.status == 200
                    resp.release()
                assert gateway.ledger.reserved_blocks == 0 and gateway.ledger.inflight_requests == 0

    asyncio.run(run())


def test_the_most_free_budget_goes_first_and_weight_scales_it():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            # equal budgets, a weighted 3: a takes requests until 3 x its free budget < b's
            async with gateway_over([a, b], [100, 100], weights=[3, 1]) as (session, base, gateway):
                held = [asyncio.create_task(session.post(base + "/v1/chat/completions",
                                                         json=ten_blocks(x_mode="hold"))) for _ in range(4)]
                await wait_for(lambda: a.active + b.active == 4)
                assert (a.active, b.active) == (4, 0)
                a.release()
                b.release()
                for resp in await asyncio.gather(*held):
                    resp.release()

    asyncio.run(run())


def test_a_full_gateway_queues_and_a_release_on_either_upstream_serves_the_waiter():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [20, 10], queue={"max_waiting": 4, "timeout_s": 10}) \
                    as (session, base, gateway):
                held = [asyncio.create_task(session.post(base + "/v1/chat/completions",
                                                         json=ten_blocks(x_mode="hold"))) for _ in range(3)]
                await wait_for(lambda: a.active + b.active == 3)
                waiter = asyncio.create_task(session.post(base + "/v1/chat/completions", json=ten_blocks()))
                await wait_for(lambda: gateway.admission.waiting == 1)
                assert (await ledger(session, base))["waiting"] == 1
                b.release()  # b's one request ends: the waiter takes its blocks there
                async with await waiter as resp:
                    assert resp.status == 200
                assert len(b.engine_calls) == 2
                a.release()
                for resp in await asyncio.gather(*held):
                    resp.release()
                assert gateway.ledger.reserved_blocks == 0

    asyncio.run(run())


def test_each_upstream_runs_its_own_ledger_of_the_policy():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            statistical = {"policy": "statistical", "epsilon": 0.01}
            async with gateway_over([a, b], [100, 40], admission=statistical) as (session, base, gateway):
                assert all(isinstance(r.ledger, StatisticalLedger) for r in gateway.pool.replicas)
                assert [r.ledger.budget_blocks for r in gateway.pool.replicas] == [100, 40]
                async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                    assert resp.status == 200
            async with gateway_over([a, b], [100, 40], admission={"policy": "overcommit", "factor": 1.5},
                                    max_model_len=4096, admin={"refusal_detail": "ledger"}) as (session, base, gateway):
                assert [r.ledger.limit_blocks for r in gateway.pool.replicas] == [150, 60]
                got = await ledger(session, base)
                assert got["limit"] == 210 and got["budget"] == 140
                # 413 against the largest upstream's limit: 151 blocks fit nowhere
                big = {"model": "m", "messages": [{"role": "user", "content": " ".join(["w"] * (151 * 16 - 64))}]}
                async with session.post(base + "/v1/chat/completions", json=big) as resp:
                    assert resp.status == 413
                    assert "the overcommit limit is 150 (1.5 x the largest upstream's budget 100)" in \
                        (await resp.json())["error"]["message"]

    asyncio.run(run())


def test_sticky_by_user_keeps_a_users_requests_on_one_upstream_while_they_fit():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [30, 200], sticky={"by": "user"}) as (session, base, gateway):
                home = gateway.pool.affine("alice")
                fake = a if home.url == a.url else b
                other = b if fake is a else a
                for _ in range(3):  # sequential: the home upstream even when the other has more free
                    async with session.post(base + "/v1/chat/completions",
                                            json=ten_blocks(user="alice")) as resp:
                        assert resp.status == 200
                assert (len(fake.engine_calls), len(other.engine_calls)) == (3, 0)
                users = [f"user-{i}" for i in range(40)]
                homes = {gateway.pool.affine(u).url for u in users}
                assert homes == {a.url, b.url}  # keys spread over both
                # a user whose home is a, the small one: 3 held fill it (30 blocks), the 4th goes by free budget
                small = gateway.pool.replicas[0]
                user = next(u for u in users if gateway.pool.affine(u) is small)
                held = [asyncio.create_task(session.post(base + "/v1/chat/completions",
                                                         json=ten_blocks(user=user, x_mode="hold"))) for _ in range(4)]
                await wait_for(lambda: a.active + b.active == 4)
                assert (a.active, b.active) == (3, 1)
                a.release()
                b.release()
                for resp in await asyncio.gather(*held):
                    resp.release()

    asyncio.run(run())


def test_sticky_by_header_and_its_config_errors():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100], sticky={"by": "header", "header": "X-Session"}) \
                    as (session, base, gateway):
                home = gateway.pool.affine("s-1")
                for _ in range(4):
                    async with session.post(base + "/v1/chat/completions", json=ten_blocks(),
                                            headers={"X-Session": "s-1"}) as resp:
                        assert resp.status == 200
                fake = a if home.url == a.url else b
                assert len(fake.engine_calls) == 4

    asyncio.run(run())
    one = [{"url": "http://a:8000", "block_budget": 1}]
    assert _error(doc(one, sticky={"by": "header"})) == \
        "sticky.header: missing: the request header whose value keeps requests together"
    assert _error(doc(one, sticky={"by": "cookie"})) == "sticky.by: 'cookie' is not one of user, header"
    assert _error(doc(one, sticky={"by": "user", "header": "X"})) == "sticky.header: only for sticky.by: header"
    assert _error(doc(one, sticky={"by": "header", "header": "X Y"})) == "sticky.header: 'X Y' is not a header name"


# ---------------------------------------------------------------- health

def test_a_killed_upstream_is_taken_out_within_2s_and_its_share_moves_to_the_other():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100]) as (session, base, gateway):  # probe every 1 s
                await b._stop()  # the port now refuses
                took = await wait_for(lambda: not gateway.pool.replicas[1].healthy, timeout=2.5)
                assert took < 2.0
                got = await ledger(session, base)
                assert [u["healthy"] for u in got["upstreams"]] == [True, False]
                assert got["budget"] == 100  # its budget went out with it
                for _ in range(5):
                    async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                        assert resp.status == 200
                assert len(a.engine_calls) == 5

    asyncio.run(run())


def test_an_unhealthy_upstream_comes_back_when_health_answers_200():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 200], health={"interval_s": 0.1}) as (session, base, gateway):
                b.health_status = 503
                await wait_for(lambda: not gateway.pool.replicas[1].healthy)
                async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                    assert resp.status == 200
                assert (len(a.engine_calls), len(b.engine_calls)) == (1, 0)  # b has more free, but is out
                b.health_status = 200
                await wait_for(lambda: gateway.pool.replicas[1].healthy)
                async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                    assert resp.status == 200
                assert len(b.engine_calls) == 1
                assert b.health_calls >= 2

    asyncio.run(run())


def test_an_upstream_that_does_not_answer_health_in_time_is_taken_out():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100], health={"interval_s": 0.1, "timeout_s": 0.1}) \
                    as (session, base, gateway):
                b.delay_s = 1.0  # accepts, answers nothing in time
                await wait_for(lambda: not gateway.pool.replicas[1].healthy)
                assert "no answer within 0.1 s" in gateway.pool.replicas[1].why
                b.delay_s = 0.0
                await wait_for(lambda: gateway.pool.replicas[1].healthy, timeout=3)

    asyncio.run(run())


def test_a_refused_connection_goes_to_another_upstream_and_is_released_once_on_each():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            # a long probe interval: only the request itself finds b gone
            async with gateway_over([a, b], [100, 200], health={"interval_s": 60}, admin={"refusal_detail": "ledger"},
                                    make_ledger=counting_ledgers) as (session, base, gateway):
                await b._stop()
                async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                    assert resp.status == 200  # b had the most free budget; nothing reached it, a answered
                    assert resp.headers["X-Kvtune-Reserved-Blocks"] == "10"
                ra, rb = gateway.pool.replicas
                assert not rb.healthy and len(a.engine_calls) == 1
                assert (rb.ledger.granted, rb.ledger.given_back) == (1, 1)
                assert (ra.ledger.granted, ra.ledger.given_back) == (1, 1)
                async with session.get(base + "/metrics") as resp:
                    text = await resp.text()
                assert f'kvtune_gateway_upstream_retried_total{{upstream="{b.url}"}} 1.0' in text

    asyncio.run(run())


def test_a_count_moves_to_another_upstream_when_the_connection_is_refused():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100], health={"interval_s": 60}) as (session, base, gateway):
                await a._stop()  # a's /tokenize is asked first (its turn) and refuses: b counts
                async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                    assert resp.status == 200
                assert len(b.count_calls) == 1 and len(b.engine_calls) == 1
                assert [r.healthy for r in gateway.pool.replicas] == [False, True]

    asyncio.run(run())


def test_a_pass_through_request_moves_to_another_upstream_when_the_connection_is_refused():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100], health={"interval_s": 60}) as (session, base, gateway):
                await a._stop()  # a's turn first: it refuses, b answers
                async with session.get(base + "/v1/models") as resp:
                    assert resp.status == 200
                assert [c.path for c in b.other if c.path != "/health"] == ["/v1/models"]
                assert [r.healthy for r in gateway.pool.replicas] == [False, True]

    asyncio.run(run())


def test_with_every_upstream_down_a_request_fails_as_with_one_not_as_a_full_budget():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            estimate = {"method": "estimate", "chars_per_token": 2, "margin_tokens": 50}
            async with gateway_over([a, b], [100, 100], health={"interval_s": 60}) as (session, base, gateway), \
                    gateway_over([a, b], [100, 100], health={"interval_s": 60}, prompt_tokens=estimate) \
                    as (_, estimating, _):
                await a._stop()
                await b._stop()
                for _ in range(3):  # counted by the upstreams' /tokenize: nobody can count it
                    async with session.post(base + "/v1/chat/completions", json=ten_blocks()) as resp:
                        assert resp.status == 503 and "Retry-After" in resp.headers
                        assert (await resp.json())["error"]["code"] == "prompt_count_unavailable"
                    async with session.post(estimating + "/v1/chat/completions", json=ten_blocks()) as resp:
                        assert resp.status == 502
                        assert (await resp.json())["error"]["code"] == "upstream_unavailable"
                assert gateway.ledger.reserved_blocks == 0

    asyncio.run(run())


def test_with_every_upstream_down_the_ledger_reports_a_usable_budget_of_0_and_why():
    """/kvtune/ledger said budget: 200 with both upstreams down: every replica's budget, since the
    routing then tries them all. No budget is usable: 0, and budget_note says why."""
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100], health={"interval_s": 0.1}) as (session, base, gateway):
                got = await ledger(session, base)
                assert (got["budget"], got["limit"], got["budget_note"]) == (200, 200, None)
                await a._stop()
                await b._stop()
                await wait_for(lambda: not any(r.healthy for r in gateway.pool.replicas), timeout=5)
                got = await ledger(session, base)
                assert [u["healthy"] for u in got["upstreams"]] == [False, False]
                assert [u["budget"] for u in got["upstreams"]] == [100, 100]  # each one's own, as configured
                assert (got["budget"], got["limit"]) == (0, 0)
                assert got["budget_note"].startswith("every upstream is down")
                async with session.get(base + "/metrics") as resp:
                    assert "kvtune_gateway_budget_blocks 0.0" in (await resp.text()).splitlines()

    asyncio.run(run())


# ---------------------------------------------------------------- release exactly once

def test_every_ending_releases_once_on_the_upstream_it_was_held_on():
    modes = ["500", "die", "error_mid_stream", "ok", "429"]

    async def endings(session, base) -> None:
        for mode in modes:
            async with session.post(base + "/v1/chat/completions", json=ten_blocks(stream=True, x_mode=mode)) as resp:
                with contextlib.suppress(aiohttp.ClientError):
                    await resp.read()
        # an abort: the client goes away while the stream is held
        resp = await session.post(base + "/v1/chat/completions", json=ten_blocks(stream=True, x_mode="hold_stream"))
        await resp.content.readany()
        resp.close()

    def hold(session, base):
        return asyncio.create_task(session.post(base + "/v1/chat/completions", json=ten_blocks(x_mode="hold")))

    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 100], make_ledger=counting_ledgers) as (session, base, gateway):
                ra, rb = gateway.pool.replicas
                first = hold(session, base)  # a tie: a; then b has the most free for every ending
                await wait_for(lambda: a.active == 1)
                await endings(session, base)
                await wait_for(lambda: rb.ledger.inflight_requests == 0)
                assert (ra.ledger.granted, rb.ledger.granted) == (1, len(modes) + 1)
                a.release()
                (await first).release()
                a.hold()
                held = [hold(session, base)]  # a (a tie), then b (a has less free)
                await wait_for(lambda: a.active == 1)
                held.append(hold(session, base))
                await wait_for(lambda: b.active == 1)
                await endings(session, base)  # a tie again: every ending on a
                await wait_for(lambda: gateway.ledger.inflight_requests == 2)
                assert (ra.ledger.granted, rb.ledger.granted) == (len(modes) + 3, len(modes) + 2)
                a.release()
                b.release()
                for resp in await asyncio.gather(*held):
                    resp.release()
                await wait_for(lambda: gateway.ledger.inflight_requests == 0)
                for r in (ra, rb):
                    assert r.ledger.given_back == r.ledger.granted and r.ledger.reserved_blocks == 0

    asyncio.run(run())


# ---------------------------------------------------------------- ledger JSON and metrics

def test_the_ledger_json_and_metrics_show_each_upstream():
    async def run():
        async with FakeVllm() as a, FakeVllm() as b:
            async with gateway_over([a, b], [100, 50]) as (session, base, gateway):
                held = asyncio.create_task(session.post(base + "/v1/chat/completions",
                                                        json=ten_blocks(x_mode="hold")))
                await wait_for(lambda: a.active == 1)
                got = await ledger(session, base)
                assert got["upstreams"] == [
                    {"url": a.url, "budget": 100, "reserved": 10, "inflight": 1, "healthy": True,
                     "ejected": False, "passive_ejections": 0, "ejection_s": 0.0},
                    {"url": b.url, "budget": 50, "reserved": 0, "inflight": 0, "healthy": True,
                     "ejected": False, "passive_ejections": 0, "ejection_s": 0.0}]
                assert (got["budget"], got["reserved"], got["inflight"]) == (150, 10, 1)
                async with session.get(base + "/metrics") as resp:
                    text = await resp.text()
                for line in (f'kvtune_gateway_upstream_budget_blocks{{upstream="{a.url}"}} 100.0',
                             f'kvtune_gateway_upstream_budget_blocks{{upstream="{b.url}"}} 50.0',
                             f'kvtune_gateway_upstream_reserved_blocks{{upstream="{a.url}"}} 10.0',
                             f'kvtune_gateway_upstream_inflight_requests{{upstream="{a.url}"}} 1.0',
                             f'kvtune_gateway_upstream_healthy{{upstream="{b.url}"}} 1.0',
                             f'kvtune_gateway_upstream_requests_total{{upstream="{a.url}"}} 1.0',
                             "kvtune_gateway_budget_blocks 150.0", "kvtune_gateway_reserved_blocks 10.0"):
                    assert line in text, line
                a.release()
                (await held).release()

    asyncio.run(run())


def test_a_single_upstream_is_one_entry_and_never_probed():
    async def run():
        async with FakeVllm() as a:
            config = parse_gateway_config(doc([{"url": a.url, "block_budget": 100}], health={"interval_s": 0.05}))
            app = make_app(config)
            stop = asyncio.Event()
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            server = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result, app=app))
            base = (await ready).split(",")[0]
            async with aiohttp.ClientSession() as session:
                await asyncio.sleep(0.3)
                got = await ledger(session, base)
                assert got["upstreams"] == [{"url": a.url, "budget": 100, "reserved": 0, "inflight": 0,
                                             "healthy": True, "ejected": False, "passive_ejections": 0,
                                             "ejection_s": 0.0}]
            stop.set()
            await server
            assert a.health_calls == 0

    asyncio.run(run())


# ---------------------------------------------------------------- the pool alone

def test_retry_after_comes_from_the_fastest_releasing_upstream():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    config = parse_gateway_config(doc([{"url": "http://10.0.0.1:8000", "block_budget": 100},
                                       {"url": "http://10.0.0.2:8000", "block_budget": 100}]))
    pool = UpstreamPool(config, lambda cfg, u: BlockLedger(u.block_budget, clock=clock))
    a, b = pool.replicas
    held_a = [a.ledger.try_reserve(10) for _ in range(10)]
    held_b = [b.ledger.try_reserve(10) for _ in range(10)]
    for r in held_a[:9]:  # a has released 90 blocks just now, b only 10
        r.release()
        a.ledger.try_reserve(10)
    held_b[0].release()
    b.ledger.try_reserve(10)
    assert pool.try_reserve(10) is None
    from_a = a.ledger.retry_after_s(10, min_s=1, max_s=60)
    assert from_a < b.ledger.retry_after_s(10, min_s=1, max_s=60)
    assert pool.retry_after_s(10, min_s=1, max_s=60) == from_a
    pool.mark_down(a, "test")
    assert pool.retry_after_s(10, min_s=1, max_s=60) == b.ledger.retry_after_s(10, min_s=1, max_s=60)


def test_the_pool_routes_by_free_budget_then_fewest_in_flight():
    config = parse_gateway_config(doc([{"url": "http://10.0.0.1:8000", "block_budget": 30},
                                       {"url": "http://10.0.0.2:8000", "block_budget": 30}]))
    pool = UpstreamPool(config)
    a, b = pool.replicas
    first = pool.try_reserve(10)
    assert pool.replica_of(first) is a  # a tie: the first
    assert pool.replica_of(pool.try_reserve(10)) is b
    assert pool.replica_of(pool.try_reserve(5)) is a  # free 20 each, in flight 1 each: the first
    assert pool.replica_of(pool.try_reserve(5)) is b
    first.release()  # a: free 25 > b's 15
    assert pool.replica_of(pool.try_reserve(1)) is a
    assert pool.try_reserve(30) is None and not pool.never_fits(30) and pool.never_fits(31)


# ---------------------------------------------------------------- gateway.yaml

def _error(data: dict) -> str:
    with pytest.raises(InputError) as caught:
        parse_gateway_config(data)
    return f"{caught.value.field}: {caught.value.message}"


def test_upstreams_parse_with_weights_and_the_single_form_is_one_upstream():
    config = parse_gateway_config(doc([{"url": "http://a:8000", "block_budget": 100},
                                       {"url": "http://b:8000", "block_budget": 50, "weight": 2}],
                                      health={"interval_s": 0.5, "timeout_s": 0.25, "path": "/ping"}))
    assert config.upstreams == (GatewayUpstream("http://a:8000", 100), GatewayUpstream("http://b:8000", 50, 2.0))
    assert (config.upstream, config.block_budget, config.admit_limit_blocks) == ("http://a:8000", 150, 100)
    assert (config.health.interval_s, config.health.timeout_s, config.health.path) == (0.5, 0.25, "/ping")
    single = {k: v for k, v in doc([]).items() if k != "upstreams"}
    one = parse_gateway_config({**single, "upstream": "http://a:8000", "block_budget": 100})
    assert one.upstreams == (GatewayUpstream("http://a:8000", 100),)


@pytest.mark.parametrize(("upstreams", "extra", "expected"), [
    ([{"url": "http://a:8000", "block_budget": 1}, {"url": "http://b:8000"}], {},
     "upstreams[1].block_budget: missing"),
    ([{"url": "http://a:8000", "block_budget": 1}, {"url": "HTTP://A:8000/", "block_budget": 2}], {},
     "upstreams[1].url: HTTP://A:8000/ is upstreams[0] again: each engine replica is listed once"),
    ([{"url": "ftp://a", "block_budget": 1}], {}, "upstreams[0].url: must look like http://host:port, got 'ftp://a'"),
    ([{"url": "http://a:8000", "block_budget": 0}], {}, "upstreams[0].block_budget: must be at least 1, got 0"),
    ([{"url": "http://a:8000", "block_budget": 1, "weight": 0}], {},
     "upstreams[0].weight: must be at least 0.001, got 0"),
    ([{"url": "http://a:8000", "block_budget": 1, "wieght": 2}], {},
     "upstreams[0].wieght: unknown key (allowed: block_budget, engine_id, url, weight)"),
    ([], {}, "upstreams: expected a non-empty list of {url, block_budget, weight}"),
    ([{"url": "http://a:8000", "block_budget": 1}], {"block_budget": 5},
     "block_budget: give upstreams: (each with its own block_budget) or upstream: and block_budget:, not both"),
    ([{"url": "http://a:8000", "block_budget": 1}], {"health": {"interval_s": 0}},
     "health.interval_s: must be at least 0.05, got 0"),
    ([{"url": "http://a:8000", "block_budget": 1}, {"url": "http://b:8000", "block_budget": 1}],
     {"routes": [{"name": "r", "max_new_tokens": 8, "upstream": "http://a:8000"}]},
     "routes[0].upstream: with several upstreams every route is spread over them: a route names its own "
     "upstream only in front of a single one"),
])
def test_upstreams_errors_name_the_field(upstreams, extra, expected):
    assert _error(doc(upstreams, **extra)) == expected


def test_neither_upstream_nor_upstreams_names_the_missing_field():
    single = {k: v for k, v in doc([]).items() if k != "upstreams"}
    assert _error(single) == "upstream: missing (or give upstreams: a list of {url, block_budget})"
    assert _error({**single, "upstream": "http://a:8000"}) == \
        "block_budget: missing (or give upstreams: a list of {url, block_budget})"


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                     st.sampled_from(["http://a:8000", "http://a:8000/", "https://b", "ftp://c", "http://a:99999"]))
_ITEM = st.one_of(_SCALARS, st.dictionaries(st.sampled_from(["url", "block_budget", "weight", "x"]), _SCALARS,
                                            max_size=4))


@given(st.one_of(_SCALARS, st.lists(_ITEM, max_size=4)),
       st.dictionaries(st.sampled_from(["interval_s", "timeout_s", "path", "x"]), _SCALARS, max_size=3))
def test_fuzzed_upstreams_are_upstreams_or_an_error_naming_the_field(upstreams, health):
    try:
        config = parse_gateway_config(doc(upstreams, health=health))
    except InputError as exc:
        assert exc.field is not None and exc.field.startswith(("upstreams", "health"))
        return
    assert len({u.url for u in config.upstreams}) == len(config.upstreams) >= 1
    assert all(u.block_budget >= 1 and u.weight > 0 for u in config.upstreams)
