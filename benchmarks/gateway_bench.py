"""What the admission gateway costs: latency added (p50, p99) and the request rate it sustains, on
loopback, against an instant upstream in its own process, next to the same load sent directly.

Three measurements, each direct and through `kvtune gateway` (a separate process, as deployed):
  latency     one request at a time (concurrency 1): p50/p99; "added" = gateway - direct
  open 1000   an open loop at --rate requests/s for --seconds: achieved rate, p50/p99 from the
              scheduled send time (so queueing shows up, no coordinated omission)
  ceiling     a closed loop at --concurrency for --seconds: completed requests/s

The gateway runs once per prompt-counting method: `upstream-tokenize` (an extra round trip to the
upstream's /tokenize per request; what `kvtune recommend` renders when it knows no local
tokenizer; this upstream answers /tokenize in ~0.2 ms of CPU, a real vLLM takes longer),
`tokenizer` (tokenizers + the chat template in process, exact, no round trip; what recommend
renders when the model directory is local; the tiny test model's tokenizer from
tests/support/vllm_server.py) and `estimate` (characters / 3 + margin); beside them `bare-aiohttp`, a
15-line pass-through aiohttp proxy without any admission logic, on aiohttp's client (the
gateway sends governed requests through its own, kvtune.gateway.upstream). Each figure is the
median over --runs runs. `nginx` is the rendered nginx.conf (the other enforcer, which counts with
the upstream's /tokenize) on a real nginx with Lua, --nginx-workers worker processes (statistical
always runs one).

--policies runs every gateway under each admission policy: `guaranteed` (a budget of 10,000,000
blocks: admission is never refused and costs only the reservation), and `statistical`
(epsilon 0.01, a budget of 200 blocks, the chat route's output law STAT_LENGTHS). A statistical
ledger computes a probability only while the held requests' worst cases exceed the budget, so
before measuring, --held requests (default 40, each worth 5 blocks at worst: 200, the budget) are
sent through the gateway and held by the upstream until the run ends: every measured admission
then bounds the peak of about 41 held sequences (the exact convolution, 14 step intervals; on
the shared ledger the Chernoff bound, which reaches epsilon near 64 held) and every release
invalidates it, the costliest state the policy is in under load. Each measured request is
admitted (its probability stays far below epsilon). `redis` is guaranteed with every
reservation confirmed in the shared ledger (gateway.yaml `ledger.backend: redis`, one Lua script
per reserve, one per release), on a redis-server this bench starts on loopback (--pin redis=CPU);
`redis-statistical` is statistical on that shared ledger (every reserve also writes the
request's log-moment rows and the script bounds every replica's held sequences; every release
takes them out), with the same --held requests. nginx and the bare proxy have no such ledger and
are not run under either. `flow` is guaranteed with the flow-control queue on (gateway.yaml
`flow:`, two bands, flows by API key: each admission also keeps its flow's state and its entry in
the forecast's table) and `statistical-flow` statistical with it, the --held requests included;
nginx runs them with the same flow: rendered into nginx.conf (one worker, as flow control always
runs).

Client, gateway and upstream share this machine's CPUs: on 2 cores the sum of their work, not the
gateway alone, sets the ceiling. --pin client=0,upstream=0,gateway=1 pins each process (sched
affinity, as taskset does): client and upstream share one core in the direct and the gateway runs
alike and the gateway has the other to itself, so the ceiling compares like with like. The ceiling
phase also reports each process's CPU milliseconds per request; 1000 / the gateway's figure is the
rate it would sustain on one core of its own. --max-load waits before each run until the
1-minute load average is at or below it (other benchmarks on the machine skew every figure).
Prints a table and, with --json, one JSON object.

    python benchmarks/gateway_bench.py --runs 3 --max-load 1.5
    python benchmarks/gateway_bench.py --runs 3 --max-load 1.5 --pin client=0,upstream=0,gateway=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

UPSTREAM_SRC = textwrap.dedent("""
    import asyncio, json, sys
    from aiohttp import web
    ANSWER = json.dumps({"id": "x", "object": "chat.completion", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}).encode()
    async def chat(request):
        body = await request.read()
        if b'"hold_s"' in body:  # a background request the gateway holds while the bench measures
            await asyncio.sleep(json.loads(body)["hold_s"])
        return web.Response(body=ANSWER, content_type="application/json")
    async def tokenize(request):
        await request.read()
        return web.Response(body=b'{"count": 12, "max_model_len": 4096, "tokens": []}',
                            content_type="application/json")
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/tokenize", tokenize)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
""")

# The floor: a pass-through aiohttp proxy with no admission logic, on uvloop like the gateway.
BARE_PROXY_SRC = textwrap.dedent("""
    import sys, aiohttp, uvloop
    from aiohttp import web
    UPSTREAM = sys.argv[2]
    async def forward(request):
        body = await request.read()
        async with request.app["s"].post(UPSTREAM + request.path, data=body,
                                         headers={"Content-Type": "application/json"}) as up:
            return web.Response(status=up.status, body=await up.read(), content_type="application/json")
    async def session(app):
        app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["s"].close()
    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None,
                loop=uvloop.new_event_loop())
""")

# statistical: the budget, epsilon and the chat route's measured output lengths (values, counts)
POLICIES = ("guaranteed", "statistical", "redis", "redis-statistical", "flow", "statistical-flow")
# flow control (gateway.yaml `flow:`, docs/guides/flow-control.md): two bands, flows by API key
FLOW = {"token_time_s": 0.02, "bands": [{"name": "interactive", "deadline_s": 2}, {"name": "batch", "deadline_s": 60}]}
STAT_BUDGET, STAT_EPSILON = 200, 0.01
STAT_LENGTHS = ([1, 4, 16, 64], [80, 12, 6, 2])
HELD_BODY = {"model": "m", "messages": [{"role": "user", "content": "Hold this one."}], "max_tokens": 64}

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say ok, briefly please."}],
                   "max_tokens": 16}).encode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, deadline_s: float = 20) -> None:
    import urllib.error
    import urllib.request

    end = time.monotonic() + deadline_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.05)


class Proc:
    """A child process stopped with SIGTERM → wait → kill; pinned to `cpus` when given."""

    def __init__(self, args: list[str], cpus: set[int] | None = None, **kw) -> None:
        # pinned before exec, so every thread it ever starts inherits the mask
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.p = subprocess.Popen(args, preexec_fn=preexec, **kw)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)


def start_upstream(cpus: set[int] | None = None) -> tuple[Proc, str]:
    port = _free_port()
    proc = Proc([sys.executable, "-c", UPSTREAM_SRC, str(port)], cpus)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/")
    return proc, url


def tiny_tokenizer(workdir: Path) -> Path:
    """The test bed's tiny model directory (tokenizer.json + chat template in tokenizer_config.json)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from vllm_server import write_tiny_model

    return write_tiny_model(workdir / "tiny-model")


def bench_rec(upstream: str, policy: str):
    """The recommendation nginx.conf is rendered from, the same gateway as the YAML below: block
    size 16, context 4096, chat capped at 64 (with STAT_LENGTHS as its law), a catch-all at 64."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from enforcers import base_rec

    from kvtune.policy.recommendation import read_recommendation

    rec = base_rec()
    rec["upstream"] = upstream
    statistical = policy == "statistical"
    budget = STAT_BUDGET if statistical else 10_000_000
    rec["capacity"]["num_blocks"] = budget + 1
    rec["block_budget"]["value"] = budget
    rec["settings"]["max_model_len"]["value"] = 4096
    rec["settings"]["max_new_tokens_backstop"]["value"] = 64
    chat = rec["routes"][0]
    chat["max_new_tokens"]["value"] = 64
    chat["output_lengths"] = {"uncensored": {"values": STAT_LENGTHS[0], "counts": STAT_LENGTHS[1]},
                              "censored": {"values": [], "counts": []}}
    rec["routes"] = [chat]
    rec["admission"] = {"policy": "statistical", "epsilon": STAT_EPSILON} if statistical else {"policy": "guaranteed"}
    return read_recommendation(rec, path="bench_rec")


def start_nginx(upstream: str, policy: str, workdir: Path, workers: int,
                cpus: set[int] | None = None) -> tuple[Proc, str]:
    from kvtune.deploy.render import RenderOptions, lua_modules, render_files

    port = _free_port()
    prefix = workdir / f"nginx-{policy}"
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    from kvtune.domain.flow_control import Band, FlowControl

    flow = None
    if policy.endswith("flow"):  # the same flow: as the Python gateway's YAML below
        flow = FlowControl(token_time_s=FLOW["token_time_s"],
                           bands=tuple(Band(b["name"], b["deadline_s"]) for b in FLOW["bands"]))
    conf = render_files(bench_rec(upstream, policy.removesuffix("-flow") if flow else policy), targets=["nginx.conf"],
                        options=RenderOptions(listen_port=port, nginx_worker_processes=str(workers), flow=flow,
                                              nginx_user="root" if os.geteuid() == 0 else None))["nginx.conf"]
    (prefix / "nginx.conf").write_text(conf)
    for name, text in lua_modules().items():  # the Lua nginx.conf loads, beside it as recommend --out writes it
        (prefix / name).parent.mkdir(parents=True, exist_ok=True)
        (prefix / name).write_text(text)
    proc = Proc(["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs" / "error.log"),
                 "-g", "daemon off;"], cpus, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthz")
    return proc, url


def start_redis(cpus: set[int] | None = None) -> tuple[Proc, str]:
    """redis-server on loopback, no persistence (the ledger's cost, not the disk's)."""
    import shutil
    import socket

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--policies redis needs redis-server (scripts/install-test-deps.sh)")
    port = _free_port()
    proc = Proc([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], cpus,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            pass
        if time.monotonic() > end:
            proc.stop()
            raise RuntimeError("redis-server did not come up")
        time.sleep(0.05)


def start_gateway(upstream: str, method: str, workdir: Path, cpus: set[int] | None = None,
                  policy: str = "guaranteed", nginx_workers: int = 1, redis_url: str | None = None) -> tuple[Proc, str]:
    import yaml

    if method == "nginx":
        return start_nginx(upstream, policy, workdir, nginx_workers, cpus)
    if method == "bare-aiohttp":
        port = _free_port()
        proc = Proc([sys.executable, "-c", BARE_PROXY_SRC, str(port), upstream], cpus)
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/healthz")
        return proc, url

    counting: dict = {"method": method}
    if method == "estimate":
        counting.update(chars_per_token=3, margin_tokens=16)
    if method == "tokenizer":
        counting["tokenizer"] = str(tiny_tokenizer(workdir))
    config = {
        "version": 1, "upstream": upstream, "block_size": 16, "block_budget": 10_000_000,
        "max_model_len": 4096, "prompt_tokens": counting,
        "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64},
                   {"name": "default", "max_new_tokens": 64}],
    }
    if policy in ("statistical", "redis-statistical", "statistical-flow"):  # the law nginx.conf gets, binned alike
        from kvtune.deploy.render import gateway_routes

        law = gateway_routes(bench_rec(upstream, "statistical"))[0]["output_histogram"]
        config.update(block_budget=STAT_BUDGET, admission={"policy": "statistical", "epsilon": STAT_EPSILON})
        config["routes"][0]["output_histogram"] = law
    if policy.endswith("flow"):
        config["flow"] = FLOW
    if policy in ("redis", "redis-statistical"):
        config["ledger"] = {"backend": "redis", "url": redis_url, "key_prefix": f"bench-{_free_port()}"}
    path = workdir / f"gateway-{method}-{policy}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    proc = Proc([sys.executable, "-m", "kvtune", "gateway", "--config", str(path), "--port", str(port)],
                cpus, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthz")
    return proc, url


async def hold_background(base: str, n: int) -> tuple[aiohttp.ClientSession, list[asyncio.Task]]:
    """n requests the upstream holds for an hour, admitted before measuring (the statistical
    ledger's held state); cancelled after, which releases them."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = json.dumps({**HELD_BODY, "hold_s": 3600}).encode()

    async def one() -> None:
        async with session.post(base + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            await resp.read()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        async with session.get(base + "/kvtune/ledger") as resp:
            ledger = await resp.json()
        if ledger["inflight"] >= n:
            return session, tasks
        if any(t.done() for t in tasks):
            raise RuntimeError(f"a held request was answered at once: {[t.exception() for t in tasks if t.done()][:1]}")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"only {ledger['inflight']} of {n} held requests were admitted")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


class RefusedError(RuntimeError):
    """A 429: the gateway's admission said no (statistical, when more is in flight than it bets on)."""


async def _one(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url, data=BODY, headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        if resp.status == 429:
            raise RefusedError(f"{url} answered 429")
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")


async def latency(base: str, n: int) -> dict:
    url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(200):
            await _one(session, url)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await _one(session, url)
            times.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": _pct(times, 0.50), "p99_ms": _pct(times, 0.99)}


async def open_loop(base: str, rate: float, seconds: float) -> dict:
    url = base + "/v1/chat/completions"
    lat: list[float] = []
    errors = refused = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
        for _ in range(200):
            await _one(session, url)

        async def fire(scheduled: float) -> None:
            nonlocal errors, refused
            try:
                await _one(session, url)
                lat.append((time.perf_counter() - scheduled) * 1000)
            except RefusedError:
                refused += 1
            except Exception:
                errors += 1

        start = time.perf_counter()
        total = int(rate * seconds)
        tasks = []
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"offered_rps": rate, "achieved_rps": len(lat) / elapsed, "errors": errors, "refused": refused,
            "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99)}


async def ceiling(base: str, concurrency: int, seconds: float) -> dict:
    url = base + "/v1/chat/completions"
    done = refused = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        for _ in range(200):
            await _one(session, url)
        end = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done, refused
            while time.perf_counter() < end:
                try:
                    await _one(session, url)
                    done += 1
                except RefusedError:  # counted apart: a refusal is no completed request
                    refused += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"rps": done / elapsed, "requests": done, "refused": refused}


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process and its live children (nginx's workers) have used:
    this one when pid is None."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def measure(base: str, args: argparse.Namespace, pids: dict[str, int | None], held: int = 0) -> dict:
    """The three loads; during the ceiling, CPU milliseconds per request of each process
    (client, gateway, upstream): what the sustained rate costs, whoever's core it runs on.
    With `held`, that many background requests are admitted and held first."""
    if held:
        session, tasks = await hold_background(base, held)
        try:
            return await measure(base, args, pids)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
    lat = await latency(base, args.requests)
    opened = await open_loop(base, args.rate, args.seconds)
    before = {role: cpu_s(pid) for role, pid in pids.items()}
    ceil = await ceiling(base, args.concurrency, args.seconds)
    ceil["cpu_ms_per_request"] = {role: (cpu_s(pid) - before[role]) * 1000 / ceil["requests"]
                                  for role, pid in pids.items()}
    return {"latency": lat, "open": opened, "ceiling": ceil}


def _run(coro) -> dict:
    """The client on uvloop when installed, as the gateway is: less client CPU, less noise."""
    from kvtune.gateway.proxy import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)


def _median(runs: list[dict]) -> dict:
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _median([r[key] for r in runs])
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def parse_pin(text: str) -> dict[str, set[int]]:
    """"client=0,gateway=1,upstream=1" (a role may name several CPUs: gateway=1+2) -> {role: cpus}."""
    pins: dict[str, set[int]] = {}
    for item in filter(None, text.split(",")):
        role, _, cpus = item.partition("=")
        if role not in ("client", "gateway", "upstream") or not cpus:
            raise SystemExit(f"--pin: expected client=N,gateway=N,upstream=N, got {item!r}")
        pins[role] = {int(c) for c in cpus.split("+")}
    return pins


def wait_for_quiet(max_load: float | None, wait_s: float) -> float:
    """Block until the 1-minute load average is <= max_load (or wait_s passes); return the load."""
    end = time.monotonic() + wait_s
    while max_load is not None and os.getloadavg()[0] > max_load and time.monotonic() < end:
        time.sleep(5)
    return os.getloadavg()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests for latency")
    ap.add_argument("--rate", type=float, default=1000.0, help="open-loop requests/s")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--methods", default="upstream-tokenize,tokenizer,estimate,nginx,bare-aiohttp",
                    help="counting methods to run the gateway with; bare-aiohttp is no gateway but a "
                         "plain aiohttp pass-through proxy, the floor any aiohttp proxy pays")
    ap.add_argument("--policies", default="guaranteed",
                    help="admission policies to run every gateway under: guaranteed, statistical, redis "
                         "(guaranteed on the shared Redis ledger), redis-statistical (statistical on it), flow and "
                         "statistical-flow (either with gateway.yaml flow: on)")
    ap.add_argument("--held", type=int, default=40,
                    help="statistical: background requests held through the gateway while it is measured")
    ap.add_argument("--nginx-workers", type=int, default=1, help="nginx worker processes (guaranteed)")
    ap.add_argument("--pin", default="", help="client=CPU,gateway=CPU,upstream=CPU,redis=CPU (CPUs joined by +)")
    ap.add_argument("--max-load", type=float, default=None,
                    help="wait before each run until the 1-minute load average is at most this")
    ap.add_argument("--load-wait-s", type=float, default=600, help="give up waiting for quiet after this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    policies = [p for p in args.policies.split(",") if p]
    if any(p not in POLICIES for p in policies):
        raise SystemExit(f"--policies: {', '.join(POLICIES)}; got {args.policies!r}")
    plain = [m for m in args.methods.split(",") if m]
    # each gateway under each policy; the bare proxy has no policy, nginx no shared ledger
    methods = [m if p == "guaranteed" or m == "bare-aiohttp" else f"{m}@{p}" for p in policies for m in plain
               if not (m == "bare-aiohttp" and p != policies[0])
               and not (p.startswith("redis") and m in ("nginx", "bare-aiohttp"))
               and not (p.endswith("flow") and m == "bare-aiohttp")]
    pins = parse_pin(args.pin)
    if "client" in pins:
        os.sched_setaffinity(0, pins["client"])
    results: dict[str, list[dict]] = {"direct": [], **{m: [] for m in methods}}
    loads: list[float] = []
    upstream, up_url = start_upstream(pins.get("upstream"))
    on_redis = any(p.startswith("redis") for p in policies)
    store, redis_url = start_redis(pins.get("redis")) if on_redis else (None, None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(args.runs):
                loads.append(wait_for_quiet(args.max_load, args.load_wait_s))
                pids = {"client": None, "upstream": upstream.p.pid}
                results["direct"].append(_run(measure(up_url, args, pids)))
                for method in methods:
                    name, _, policy = method.partition("@")
                    policy = policy or "guaranteed"
                    gw, gw_url = start_gateway(up_url, name, Path(tmp), pins.get("gateway"), policy, args.nginx_workers,
                                               redis_url)
                    held = args.held if policy in ("statistical", "redis-statistical", "statistical-flow") else 0
                    try:
                        roles = {**pids, "gateway": gw.p.pid}
                        if policy.startswith("redis") and store is not None:
                            roles["redis"] = store.p.pid
                        results[method].append(_run(measure(gw_url, args, roles, held)))
                    finally:
                        gw.stop()
                print(f"run {run + 1}/{args.runs} done (load at start {loads[-1]:.2f})", file=sys.stderr)
    finally:
        upstream.stop()
        if store is not None:
            store.stop()

    med = {k: _median(v) for k, v in results.items()}
    d = med["direct"]
    pin_text = ",".join(f"{k}={'+'.join(map(str, sorted(v)))}" for k, v in pins.items()) or "none"
    summary = {"runs": args.runs, "cpus": os.cpu_count(), "pin": pin_text, "load_at_start": loads,
               "median": med, "gateway": {}}
    for m in methods:
        g = med[m]
        gw_cpu_ms = g["ceiling"]["cpu_ms_per_request"]["gateway"]
        summary["gateway"][m] = {
            "cpu_ms_per_request": gw_cpu_ms,
            "one_core_rps": 1000 / gw_cpu_ms if gw_cpu_ms else None,
            "added_p50_ms": g["latency"]["p50_ms"] - d["latency"]["p50_ms"],
            "added_p99_ms": g["latency"]["p99_ms"] - d["latency"]["p99_ms"],
            "open_achieved_ratio": g["open"]["achieved_rps"] / d["open"]["achieved_rps"],
            "ceiling_ratio": g["ceiling"]["rps"] / d["ceiling"]["rps"],
            "open_refused": g["open"]["refused"],
        }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"median of {args.runs} runs, {os.cpu_count()} CPUs, pin {pin_text}, load at start "
          f"{', '.join(f'{x:.2f}' for x in loads)}; loopback; upstream answers instantly")
    print(f"{'target':<27}{'p50 ms':>8}{'p99 ms':>8}{'open rps':>10}{'open p50':>10}{'open p99':>10}"
          f"{'ceiling rps':>13}   CPU ms/request at the ceiling")
    for name in ["direct", *methods]:
        r = med[name]
        label = {"direct": "direct", "bare-aiohttp": "proxy/bare-aiohttp"}.get(name, f"gateway/{name}")
        label = label if len(label) < 27 else label[:26]
        cpu = "  ".join(f"{k} {v:.3f}" for k, v in r["ceiling"]["cpu_ms_per_request"].items())
        print(f"{label:<27}{r['latency']['p50_ms']:>8.3f}{r['latency']['p99_ms']:>8.3f}"
              f"{r['open']['achieved_rps']:>10.0f}{r['open']['p50_ms']:>10.3f}{r['open']['p99_ms']:>10.3f}"
              f"{r['ceiling']['rps']:>13.0f}   {cpu}")
    for m, s in summary["gateway"].items():
        print(f"gateway/{m}: added p50 {s['added_p50_ms']:.3f} ms, p99 {s['added_p99_ms']:.3f} ms; "
              f"at {args.rate:.0f} rps offered {s['open_achieved_ratio']:.2f}x direct "
              f"({s['open_refused']:.0f} refused); "
              f"ceiling {s['ceiling_ratio']:.2f}x direct; gateway CPU {s['cpu_ms_per_request']:.3f} ms/request "
              f"= {s['one_core_rps'] or 0:.0f} rps on one core of its own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
