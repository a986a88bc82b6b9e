"""What the shared-ledger races share (tests/test_gateway_shared_ledger*.py): `kvtune gateway`
processes that log to a file, a thread reading each upstream's reserved blocks from Redis every
10 ms, the clients of a race (slow readers, clients going away) and an upstream killed and
restarted part-way."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import redis
from fake_vllm import FakeVllm

REPO = Path(__file__).resolve().parents[2]
PREFIX = "t"  # the ledger's key_prefix in every race


def reserved(client: redis.Redis, url: str) -> int:
    return int(client.hget(f"{PREFIX}:reserved", url) or 0)


class Sampler:
    """Reads each upstream's reserved blocks from Redis (one HMGET: the same instant) every 10 ms in
    a thread of its own; `samples[url]` is the series, `peak[url]` its maximum. Leaving takes one
    last sample once the thread has stopped, so `samples[url][-1]` is the state at exit, however
    starved the thread was on a loaded host; an error of the thread's is raised there, not lost
    with a series that silently stopped short."""

    def __init__(self, client: redis.Redis, *urls: str) -> None:
        self.client, self.urls = client, urls
        self.samples: dict[str, list[int]] = {url: [] for url in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    def _sample(self) -> None:
        for url, value in zip(self.urls, self.client.hmget(f"{PREFIX}:reserved", self.urls), strict=True):
            self.samples[url].append(int(value or 0))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._sample()
                self._stop.wait(0.01)
        except BaseException as exc:  # re-raised in __exit__
            self._error = exc

    @property
    def peak(self) -> dict[str, int]:
        return {url: max(series, default=0) for url, series in self.samples.items()}

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if exc_type is not None:
            return  # the body's own failure is the one to read
        assert not self._thread.is_alive(), "the sampler's Redis call did not return within 5 s"
        if self._error is not None:
            raise self._error
        self._sample()


async def wait_for(predicate, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict[str, str]]:
    async with session.post(url, json=body) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def read_slowly(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict[str, str]]:
    """A slow reader: takes the stream a chunk at a time, 20 ms between reads."""
    async with session.post(url, json=body) as resp:
        async for _ in resp.content.iter_any():
            await asyncio.sleep(0.02)
        return resp.status, dict(resp.headers)


async def settle(request: Coroutine[Any, Any, tuple[int, dict[str, str]]], rng: random.Random, leave: float,
                 after: tuple[float, float]) -> int | None:
    """One race request's status; with probability `leave` its client goes away after a delay drawn
    from `after` (None: it went). A stream cut half-way is 0, a request that outlived the
    session's timeout -1: both are counted, never raised."""
    task = asyncio.ensure_future(request)
    if rng.random() < leave:
        await asyncio.sleep(rng.uniform(*after))
        task.cancel()
    try:
        return (await task)[0]
    except asyncio.CancelledError:
        return None
    except aiohttp.ClientError:
        return 0
    except TimeoutError:
        return -1


class Progress:
    """How many of a race's requests are done; `reached(n)` waits for the n-th."""

    def __init__(self) -> None:
        self.done = 0

    async def reached(self, count: int) -> None:
        while self.done < count:
            await asyncio.sleep(0.01)


async def kill_and_restart(fake: FakeVllm, progress: Progress, total: int, samples: list[int]) -> tuple[int, int, int]:
    """Kills the fake upstream (its streams are cut) a third of the way through a race and brings it
    back on the same port at two thirds; returns the sample indexes at both moments and the
    upstream's engine calls at the restart."""
    await progress.reached(total // 3)
    await asyncio.to_thread(fake.__exit__, None, None, None)
    killed = len(samples)
    await progress.reached(2 * total // 3)
    restarted, calls = len(samples), len(fake.engine_calls)
    await asyncio.to_thread(fake.__enter__)
    return killed, restarted, calls


def start_gateway_process(config_path: Path) -> tuple[subprocess.Popen, str]:
    """A `kvtune gateway` process; its stderr goes to a log file beside the config, not a pipe:
    a pipe nobody drains fills at 64 KiB of refusal log lines and then blocks the gateway's event
    loop on its next write (which is how a broken ledger's race used to hang instead of failing)."""
    log = tempfile.NamedTemporaryFile("w+", dir=config_path.parent, prefix="gateway-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "kvtune", "gateway", "--config", str(config_path)],
                            cwd=REPO, stderr=log, text=True)
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    log.close()
    deadline = time.monotonic() + 30
    while True:
        first = proc.log_path.read_text().partition("\n")  # type: ignore[attr-defined]
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", first[0])
        if match:
            return proc, match.group(1)
        if proc.poll() is not None or time.monotonic() > deadline or (first[1] and not match):
            proc.kill()
            raise AssertionError(f"the gateway did not start: {first[0]}")
        time.sleep(0.02)


def gateway_log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()  # type: ignore[attr-defined]


def owner_hashes(client: redis.Redis) -> dict[str, int]:
    return {key.decode(): client.hlen(key) for key in client.keys(f"{PREFIX}:res:*")}


def stop_processes(procs: list[tuple[subprocess.Popen, str]]) -> None:
    """SIGTERM each replica (SIGKILL after 10 s); then no replica may have logged a traceback:
    a client going away, an upstream dying or Redis stopping are all answered, never crashed on."""
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    for proc, _ in procs:
        log = gateway_log(proc)
        assert "Traceback" not in log, log[log.index("Traceback") - 200:][:3000]
