"""One engine, one budget in the shared ledger (issue #26, item 3): gateway replicas in real
processes, one real redis-server, the fake vLLM on loopback. Spellings of the same URL that
differ only in form (trailing slash, case, default port) are one engine; another spelling that
reaches a registered engine (localhost for 127.0.0.1) is refused at start, one error line and
exit 2; an explicit `engine_id` that every replica shares makes any spelling one budget."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import redis
from fake_vllm import FakeVllm
from ledger_race import PREFIX, gateway_log, post, start_gateway_process, stop_processes, wait_for

REPO = Path(__file__).resolve().parents[2]
ROUTES = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64}]
BUDGET = 100


def write_config(tmp_path: Path, name: str, url: str, redis_url: str, **upstream: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps({
        "version": 1, "upstreams": [{"url": url, "block_budget": BUDGET, **upstream}], "block_size": 16,
        "max_model_len": 2048, "routes": ROUTES, "listen": {"host": "127.0.0.1", "port": 0},
        "ledger": {"backend": "redis", "url": redis_url, "key_prefix": PREFIX}}))
    return path


def ten_blocks() -> dict:
    """A chat request reserving 10 blocks (96 prompt tokens + the cap 64), held by the fake engine."""
    return {"model": "m", "messages": [{"role": "user", "content": " ".join(["w"] * 96)}], "x_mode": "hold"}


def budgets(client: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(f"{PREFIX}:budget").items()}


def hold_twenty(fake: FakeVllm, bases: list[str]) -> int:
    """Send 20 ten-block requests spread over `bases`; how many the engine runs at once."""
    async def run() -> int:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [asyncio.create_task(post(session, bases[i % len(bases)] + "/v1/chat/completions", ten_blocks()))
                     for i in range(20)]
            await wait_for(lambda: sum(t.done() for t in tasks) + fake.active == 20, timeout=10)
            await asyncio.sleep(0.2)  # a late admission would show now
            running = fake.active
            fake.release()
            await asyncio.gather(*tasks)
            return running
    return asyncio.run(run())


def test_two_forms_of_one_url_are_one_budget_and_another_spelling_is_refused_at_start(redis_server, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    with FakeVllm() as fake:
        port = fake.port
        canonical = f"http://127.0.0.1:{port}"
        first = write_config(tmp_path, "a", canonical, redis_server.url)
        slash = write_config(tmp_path, "b", f"HTTP://127.0.0.1:{port}/", redis_server.url)
        other = write_config(tmp_path, "c", f"http://localhost:{port}", redis_server.url)
        procs = [start_gateway_process(first), start_gateway_process(slash)]
        try:
            assert budgets(client) == {canonical: BUDGET}  # one engine, one budget
            refused = subprocess.run([sys.executable, "-m", "kvtune", "gateway", "--config", str(other)],
                                     cwd=REPO, capture_output=True, text=True, timeout=60)
            assert refused.returncode == 2, refused.stderr
            lines = refused.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("Error: "), refused.stderr
            assert f"http://localhost:{port}" in lines[0] and canonical in lines[0] and "engine_id" in lines[0]
            assert "Traceback" not in refused.stderr
            assert budgets(client) == {canonical: BUDGET}  # nothing half-written
            # the two replicas together run at most the one budget: 10 requests of 10 blocks
            assert hold_twenty(fake, [base for _, base in procs]) == BUDGET // 10
        finally:
            stop_processes(procs)


def test_an_engine_id_every_replica_shares_is_one_budget_whatever_the_url(redis_server, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    with FakeVllm() as fake:
        port = fake.port
        spellings = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/", f"http://localhost:{port}"]
        procs = [start_gateway_process(write_config(tmp_path, f"g{i}", url, redis_server.url, engine_id="engine-a"))
                 for i, url in enumerate(spellings[:2])]
        try:
            assert budgets(client) == {"engine-a": BUDGET}
            assert hold_twenty(fake, [base for _, base in procs]) == BUDGET // 10
            # the same engine under its URL alone is a second name for it: refused
            bare = write_config(tmp_path, "bare", spellings[2], redis_server.url)
            refused = subprocess.run([sys.executable, "-m", "kvtune", "gateway", "--config", str(bare)],
                                     cwd=REPO, capture_output=True, text=True, timeout=60)
            assert refused.returncode == 2 and "engine-a" in refused.stderr, refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1
        finally:
            stop_processes(procs)
        assert budgets(client) == {"engine-a": BUDGET}


def test_an_engine_id_is_checked_in_gateway_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({
        "version": 1, "block_size": 16, "max_model_len": 2048, "routes": ROUTES,
        "upstreams": [{"url": "http://127.0.0.1:9", "block_budget": 10, "engine_id": "a"},
                      {"url": "http://127.0.0.1:10", "block_budget": 10, "engine_id": "a"}]}))
    out = subprocess.run([sys.executable, "-m", "kvtune", "gateway", "--config", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "upstreams[1].engine_id" in out.stderr, out.stderr


def test_a_replica_started_while_redis_was_down_registers_before_it_admits(make_redis, tmp_path):
    """Redis down when the second spelling's replica starts: it cannot be refused at start, so it
    registers before its first admission, finds the clash, logs it and refuses 503 (nothing is
    admitted against a second budget)."""
    server = make_redis(appendonly=True)
    client = redis.Redis.from_url(server.url)
    with FakeVllm() as fake:
        port = fake.port
        canonical = f"http://127.0.0.1:{port}"
        procs = [start_gateway_process(write_config(tmp_path, "a", canonical, server.url))]
        try:
            server.stop()
            procs.append(start_gateway_process(write_config(tmp_path, "c", f"http://localhost:{port}", server.url)))
            server.start()

            async def run() -> tuple[int, str]:
                async with aiohttp.ClientSession() as session:
                    await asyncio.sleep(1.5)  # the heartbeats find Redis back
                    body = ten_blocks() | {"x_mode": "ok"}
                    async with session.post(procs[1][1] + "/v1/chat/completions", json=body) as resp:
                        return resp.status, await resp.text()

            status, text = asyncio.run(run())
            assert status == 503 and "engine_id" in text and canonical in text, (status, text)
            assert budgets(client) == {canonical: BUDGET}
            assert fake.engine_calls == []
            log = gateway_log(procs[1][0])
            assert "nothing is admitted" in log and f"http://localhost:{port}" in log
        finally:
            stop_processes(procs)


def test_engine_id_and_reclaim_grace_are_refused_where_they_mean_nothing(tmp_path):
    base = {"version": 1, "block_size": 16, "max_model_len": 2048, "routes": ROUTES}
    cases = [
        ({"upstreams": [{"url": "http://127.0.0.1:9", "block_budget": 10}], "engine_id": "a"},
         "engine_id: with upstreams:, give each its own upstreams[i].engine_id"),
        ({"upstream": "http://127.0.0.1:9", "block_budget": 10, "engine_id": "a b"}, "engine_id: expected a name"),
        ({"upstream": "http://127.0.0.1:9", "block_budget": 10, "ledger": {"reclaim_grace_s": 5}},
         "ledger.reclaim_grace_s: only for ledger.backend: redis"),
        ({"upstream": "http://127.0.0.1:9", "block_budget": 10,
          "ledger": {"backend": "redis", "url": "redis://127.0.0.1:9/0", "reclaim_grace_s": -1}},
         "ledger.reclaim_grace_s"),
    ]
    for i, (doc, expected) in enumerate(cases):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(json.dumps(base | doc))
        out = subprocess.run([sys.executable, "-m", "kvtune", "gateway", "--config", str(path)],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and expected in out.stderr, (doc, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_engines_behind_one_address_under_different_prefixes_are_two_engines(redis_server, tmp_path):
    """One router, two path prefixes: two engines, each its own budget, neither refused; the same
    prefix under another hostname is refused."""
    client = redis.Redis.from_url(redis_server.url)
    with FakeVllm() as fake:
        port = fake.port
        procs = [start_gateway_process(write_config(tmp_path, name, f"http://127.0.0.1:{port}/{name}", redis_server.url))
                 for name in ("a", "b")]
        try:
            assert budgets(client) == {f"http://127.0.0.1:{port}/a": BUDGET, f"http://127.0.0.1:{port}/b": BUDGET}
            other = write_config(tmp_path, "c", f"http://localhost:{port}/a/", redis_server.url)
            refused = subprocess.run([sys.executable, "-m", "kvtune", "gateway", "--config", str(other)],
                                     cwd=REPO, capture_output=True, text=True, timeout=60)
            assert refused.returncode == 2 and f"127.0.0.1:{port}/a," in refused.stderr, refused.stderr
        finally:
            stop_processes(procs)
