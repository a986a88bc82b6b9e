"""Issue #15's race with a real engine as one upstream: 3 `kvtune gateway` processes, one real
redis-server, two upstreams: the CPU vLLM (its own KV pool, read from its log) and the fake vLLM
(which fails on purpose and is killed and restarted mid-run). 5,000 requests of mixed sizes, with
clients going away and slow readers. Each upstream's reserved sum, read from Redis every 10 ms,
never passes its budget and is 0 at the end; vLLM, held to its pool by the shared ledger, never
preempts (its own counter), and every request it answered stayed within its route's cap."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import re
import time

import aiohttp
import pytest
import redis
from fake_vllm import FakeVllm
from ledger_race import (
    PREFIX,
    Progress,
    Sampler,
    gateway_log,
    kill_and_restart,
    owner_hashes,
    read_slowly,
    reserved,
    settle,
    start_gateway_process,
    stop_processes,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUESTS, CONCURRENCY = 5000, 40
CAP = 16  # the route's max_new_tokens: short answers keep the CPU engine's 5,000 requests quick


def preemptions(metrics_text: str) -> float:
    match = re.search(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", metrics_text, re.MULTILINE)
    assert match, "vLLM exports vllm:num_preemptions_total"
    return float(match.group(1))


# The failing fake runs in this process: connections the gateways drop mid-answer can be collected
# unclosed under load (a ResourceWarning of the fake's own sockets, CI 2026-12-07), which says
# nothing about the gateways; every claim below is asserted as before.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_three_gateways_one_real_vllm_and_a_failing_fake_5000_requests(redis_server, vllm_server,
                                                                       vllm_model_dir, tmp_path):
    engine = vllm_server
    client = redis.Redis.from_url(redis_server.url)
    before = preemptions(engine.metrics_text())
    with FakeVllm() as fake:
        # vLLM's pool less its null block; the fake gets a smaller budget of the same block size
        budgets = {engine.url: engine.num_blocks - 1, fake.url: 12}
        config = {"version": 1, "block_size": engine.block_size, "max_model_len": engine.max_model_len,
                  "upstreams": [{"url": url, "block_budget": b} for url, b in budgets.items()],
                  "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": CAP}],
                  "prompt_tokens": {"method": "tokenizer", "tokenizer": str(vllm_model_dir)},
                  "listen": {"host": "127.0.0.1", "port": 0}, "queue": {"max_waiting": 20, "timeout_s": 5},
                  "health": {"interval_s": 0.2, "timeout_s": 1},
                  "ledger": {"backend": "redis", "url": redis_server.url, "key_prefix": PREFIX}}
        path = tmp_path / "gateway.yaml"
        path.write_text(json.dumps(config))
        procs = [start_gateway_process(path) for _ in range(3)]
        rng = random.Random(1515)
        answered: collections.Counter[str] = collections.Counter()  # 200s by the engine that answered
        over_cap: list[int] = []
        down: list[int] = []

        async def ask(session: aiohttp.ClientSession, url: str, body: dict, slow: bool) -> tuple[int, dict[str, str]]:
            if slow:
                return await read_slowly(session, url, body)
            async with session.post(url, json=body) as resp:
                raw = await resp.read()
                if resp.status == 200 and not body["stream"]:
                    answer = json.loads(raw)
                    answered[answer.get("model", "fake")] += 1  # the fake names no model
                    if answer["usage"]["completion_tokens"] > CAP:
                        over_cap.append(answer["usage"]["completion_tokens"])
                return resp.status, dict(resp.headers)

        async def run() -> list[int]:
            statuses: list[int] = []
            progress = Progress()
            slots = asyncio.Semaphore(CONCURRENCY)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=60)) as session:
                async def one_request(i: int) -> None:
                    async with slots:
                        stream = rng.random() < 0.5
                        words = rng.choice([8, 40, 100, 200, 300])  # 1 to 3 blocks of 128 with the cap
                        body = {"model": engine.model, "stream": stream, "max_tokens": 400,
                                "messages": [{"role": "user", "content": " ".join(["the"] * words)}],
                                "x_mode": rng.choices(["ok", "500", "die"], [90, 5, 5])[0],  # the fake obeys
                                "x_delay": 0.002}
                        url = procs[i % 3][1] + "/v1/chat/completions"
                        status = await settle(ask(session, url, body, stream and rng.random() < 0.1), rng,
                                              leave=0.2, after=(0.005, 0.2))  # the client goes away
                        if status is not None:
                            statuses.append(status)
                        progress.done += 1

                async def the_fake_goes_down() -> None:
                    killed, restarted, _ = await kill_and_restart(fake, progress, REQUESTS, sampler.samples[fake.url])
                    down.extend((killed, restarted))

                await asyncio.gather(the_fake_goes_down(), *(one_request(i) for i in range(REQUESTS)))
                await wait_for(lambda: reserved(client, engine.url) == reserved(client, fake.url) == 0, timeout=30)
            return statuses

        try:
            with Sampler(client, *budgets) as sampler:
                started = time.monotonic()
                statuses = asyncio.run(run())
                took = time.monotonic() - started
        finally:
            stop_processes(procs)
        print(f"race with vLLM: {REQUESTS} requests in {took:.1f} s, peak reserved {sampler.peak} of {budgets}, "
              f"{len(sampler.samples[engine.url])} samples, statuses {sorted(collections.Counter(statuses).items())}, "
              f"answered by {dict(answered)}")
        logged = collections.Counter(re.sub(r"\d+", "N", line)[:160] for proc, _ in procs
                                     for line in gateway_log(proc).splitlines()[1:])
        print("gateway log lines:", logged.most_common(8))
        for url, budget in budgets.items():
            assert budget // 2 <= sampler.peak[url] <= budget, (url, sampler.peak, budgets)
        assert 0 in sampler.samples[fake.url][down[0]:down[1]]  # the killed fake's budget came back
        assert preemptions(engine.metrics_text()) == before  # the engine never ran out of KV blocks
        assert not over_cap, over_cap[:5]
        assert answered[engine.model] > 500 and answered["fake"] > 50, answered
        assert -1 not in statuses, "a request hung for 60 s"
        assert set(statuses) <= {0, 200, 429, 500, 502, 503}, sorted(set(statuses))
        assert reserved(client, engine.url) == reserved(client, fake.url) == 0
        assert owner_hashes(client) == {}
        with contextlib.suppress(redis.RedisError):
            client.close()
