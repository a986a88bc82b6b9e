"""The Python gateway in process, in front of the fake vLLM on loopback (tests/support/fake_vllm.py) that the
request body steers (stream slowly, fail, hold, die mid-stream): pass-through, counting failures, the wait queue,
upstream errors and timeouts, disconnects, metrics and graceful shutdown. The policy itself
(clamping, 429/400/413) is held to the nginx enforcer's behaviour in test_enforcer_parity.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import aiohttp
import pytest
from enforcers import chat, config_for, running
from fake_vllm import DONE_EVENT, ROLE_EVENT, FakeVllm

from kvtune.gateway.proxy import GATEWAY, make_app, serve


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- pass-through

def test_allow_listed_requests_pass_through_untouched():
    async def run():
        async with running(passthrough=["/v1/models", "/v1/files", "/v1/login"]) as (session, base, gateway, fake):
            headers = {"X-Custom": "1", "Authorization": "Bearer t", "TE": "trailers",
                       "Connection": "keep-alive, X-Drop-Me", "X-Drop-Me": "gone"}
            payload = bytes(range(256)) * 1000
            async with session.put(f"{base}/v1/files?x=1&x=2&y=%20", data=payload, headers=headers) as resp:
                assert resp.status == 207 and await resp.read() == b"echo"
                assert resp.headers["X-Upstream"] == "yes" and "Keep-Alive" not in resp.headers
            async with session.get(f"{base}/v1/models") as resp:
                assert resp.status == 200 and (await resp.json())["data"][0]["id"] == fake.model
            put, get = fake.other
            assert put.method == "PUT" and put.path == "/v1/files?x=1&x=2&y=%20"
            assert put.headers["X-Custom"] == "1" and put.headers["Authorization"] == "Bearer t"
            assert "TE" not in put.headers and "X-Drop-Me" not in put.headers
            assert put.body == payload
            assert get.method == "GET" and get.path == "/v1/models" and get.body == b""
            # what is not on the list never reaches the upstream
            async with session.get(f"{base}/v1/files/other") as resp:
                assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
            assert len(fake.other) == 2
            assert gateway.ledger.reserved_blocks == 0 and gateway.ledger.inflight_requests == 0

    asyncio.run(run())


def test_upstream_cookies_reach_the_client_and_are_never_replayed_for_others():
    async def run():
        # by name: aiohttp's default jar never stores cookies for a bare IP address
        async with running(upstream_host="localhost", passthrough=["/v1/login", "/v1/files"]) \
                as (_, base, gateway, fake):
            for path in ("/v1/login", "/v1/files"):  # two clients, neither keeps cookies
                async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client:
                    async with client.get(base + path) as resp:
                        assert resp.status == 207
                        if path == "/v1/login":
                            assert resp.headers["Set-Cookie"] == "sid=secret; Path=/"
            assert "Cookie" not in fake.other[1].headers

    asyncio.run(run())


def test_streams_go_chunk_by_chunk_and_whole_answers_in_one_piece():
    async def run():
        async with running() as (session, base, gateway, fake):
            async with session.post(base + "/v1/chat/completions", json=chat(3)) as resp:
                body = await resp.read()
                assert resp.status == 200 and resp.headers["Content-Length"] == str(len(body))
                assert json.loads(body)["usage"]["completion_tokens"] == 64  # the route's cap, generated
            async with session.post(base + "/v1/chat/completions",
                                    json=chat(3, stream=True, x_chunks=2, x_delay=0.3)) as resp:
                assert resp.headers["Content-Type"] == "text/event-stream"
                first = await resp.content.readany()
                got_first_at = time.monotonic()
                rest = await resp.read()
            assert first.startswith(ROLE_EVENT)
            assert fake.last_chunk_sent_at["None"] - got_first_at > 0.2  # before the upstream finished
            assert rest.endswith(DONE_EVENT)
            assert gateway.ledger.reserved_blocks == 0

    asyncio.run(run())


# ---------------------------------------------------------------- counting at the edge

def test_tokenize_failure_without_an_estimate_is_503_not_a_guess():
    async def run():
        async with running() as (session, base, gateway, fake):
            fake.tokenize_status = 500
            async with session.post(f"{base}/v1/chat/completions", json=chat(10)) as resp:
                assert resp.status == 503 and int(resp.headers["Retry-After"]) >= 1
                assert (await resp.json())["error"]["code"] == "prompt_count_unavailable"
            assert fake.seen == [] and gateway.ledger.reserved_blocks == 0

    asyncio.run(run())


def test_tokenize_failure_with_a_configured_estimate_falls_back():
    async def run():
        counting = {"method": "upstream-tokenize", "chars_per_token": 2, "margin_tokens": 50}
        async with running(prompt_tokens=counting, admin={"refusal_detail": "ledger"}) as (session, base, gateway, fake):
            fake.tokenize_status = 500
            body = chat(10)
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                messages = json.dumps(body["messages"], separators=(",", ":"))
                expected = -(-(-(-len(messages) // 2) + 50 + 64) // 16)
                assert resp.headers["X-Kvtune-Reserved-Blocks"] == str(expected)

    asyncio.run(run())


def test_local_tokenizer_counts_with_the_chat_template(model_dir):
    async def run():
        counting = {"method": "tokenizer", "tokenizer": str(model_dir)}
        async with running(prompt_tokens=counting, admin={"refusal_detail": "ledger"}) as (session, base, gateway, fake):
            fake.tokenize_status = 500  # never asked
            body = {"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 10}
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                # <s> <|user|> hello world <|end|> <|assistant|> = 6 tokens + 10 → 1 block
                assert resp.headers["X-Kvtune-Reserved-Blocks"] == "1"
            body["messages"][0]["content"] = "hello " * 30
            async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                assert resp.headers["X-Kvtune-Reserved-Blocks"] == str(-(-(34 + 10) // 16))

    asyncio.run(run())


def test_responses_endpoint_gets_max_output_tokens():
    async def run():
        async with running() as (session, base, gateway, fake):
            async with session.post(f"{base}/v1/responses", json={"model": "m", "input": "a b c"}) as resp:
                assert resp.status == 200
            assert fake.seen[-1]["max_output_tokens"] == 32 and "max_tokens" not in fake.seen[-1]

    asyncio.run(run())


# ---------------------------------------------------------------- the wait queue

def test_queue_is_fifo_bounded_and_times_out():
    async def run():
        async with running(queue={"max_waiting": 2, "timeout_s": 5}) as (session, base, gateway, fake):
            post = lambda body: session.post(f"{base}/v1/chat/completions", json=body)  # noqa: E731

            async def call(body):
                async with post(body) as resp:
                    await resp.read()
                    return resp.status, time.monotonic()

            # A: 736 + 64 = 800 tokens = 50 blocks, held at the upstream
            a = asyncio.create_task(call(chat(736, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 50)
            # B needs 60 (does not fit) and waits; C needs 30 (would fit) but must not overtake B
            b = asyncio.create_task(call(chat(896, x_mode="hold")))
            await wait_for(lambda: gateway.admission.waiting == 1)
            c = asyncio.create_task(call(chat(416)))
            await wait_for(lambda: gateway.admission.waiting == 2)
            assert gateway.ledger.reserved_blocks == 50
            # a third waiter has no room: 429 at once
            async with post(chat(1)) as resp:
                assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
                assert int(resp.headers["Retry-After"]) >= 1
            fake.release()
            results = await asyncio.gather(a, b, c)
            assert [s for s, _ in results] == [200, 200, 200]
            assert gateway.ledger.reserved_blocks == 0 and gateway.admission.waiting == 0
            assert [len(m["messages"][0]["content"].split()) for m in fake.seen] == [736, 896, 416]

    asyncio.run(run())


def test_queue_timeout_answers_429_and_leaves_nothing_behind():
    async def run():
        async with running(queue={"max_waiting": 4, "timeout_s": 0.2}) as (session, base, gateway, fake):
            hold = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=chat(1536, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 100)
            started = time.monotonic()
            async with session.post(f"{base}/v1/chat/completions", json=chat(5)) as resp:
                assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_timeout"
                assert "Retry-After" in resp.headers
            assert time.monotonic() - started >= 0.2
            assert gateway.admission.waiting == 0
            fake.release()
            (await hold).release()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)

    asyncio.run(run())


def test_waiter_cancelled_by_its_client_leaves_the_queue():
    async def run():
        async with running(queue={"max_waiting": 4, "timeout_s": 30}) as (session, base, gateway, fake):
            hold = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=chat(1536, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 100)
            waiter = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=chat(5)))
            await wait_for(lambda: gateway.admission.waiting == 1)
            waiter.cancel()  # the client goes away while queued
            await wait_for(lambda: gateway.admission.waiting == 0)
            fake.release()
            (await hold).release()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0 and gateway.ledger.inflight_requests == 0)
            assert len(fake.seen) == 1

    asyncio.run(run())


# ---------------------------------------------------------------- upstream failures and disconnects

def test_upstream_error_status_is_passed_on_and_released():
    async def run():
        async with running() as (session, base, gateway, fake):
            async with session.post(f"{base}/v1/chat/completions", json=chat(5, x_mode="500")) as resp:
                assert resp.status == 500 and (await resp.json())["error"]["message"] == "status 500"
            assert gateway.ledger.reserved_blocks == 0

    asyncio.run(run())


def test_upstream_timeout_is_504_and_released():
    async def run():
        async with running(timeouts={"read_s": 0.3}) as (session, base, gateway, fake):
            # held and never released: a hang
            async with session.post(f"{base}/v1/chat/completions", json=chat(5, x_mode="hold")) as resp:
                assert resp.status == 504 and (await resp.json())["error"]["code"] == "upstream_timeout"
            assert gateway.ledger.reserved_blocks == 0 and gateway.ledger.inflight_requests == 0

    asyncio.run(run())


def test_upstream_unreachable_is_502():
    async def run():
        async with running(routes=[{"name": "dead", "upstream": "http://127.0.0.1:9", "max_new_tokens": 8}],
                           prompt_tokens={"method": "estimate", "chars_per_token": 3, "margin_tokens": 8}) \
                as (session, base, gateway, fake):
            async with session.post(f"{base}/v1/chat/completions", json=chat(5)) as resp:
                assert resp.status == 502 and (await resp.json())["error"]["code"] == "upstream_unavailable"
            assert gateway.ledger.reserved_blocks == 0

    asyncio.run(run())


def test_upstream_dying_mid_stream_cuts_the_client_and_releases():
    async def run():
        async with running() as (session, base, gateway, fake):
            async with session.post(f"{base}/v1/chat/completions",
                                    json=chat(5, stream=True, x_mode="die", x_chunks=5)) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)

    asyncio.run(run())


def test_client_disconnect_mid_stream_cancels_upstream_and_releases():
    async def run():
        async with running() as (session, base, gateway, fake):
            resp = await session.post(f"{base}/v1/chat/completions",
                                      json=chat(100, stream=True, x_chunks=200, x_delay=0.02))
            assert await resp.content.readuntil(b"\n\n") == ROLE_EVENT
            assert gateway.ledger.reserved_blocks == -(-(100 + 64) // 16)
            resp.close()  # drop the connection mid-stream
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)
            await wait_for(lambda: fake.cancelled == 1)  # the upstream call was cut, not left running
            assert gateway.ledger.inflight_requests == 0

    asyncio.run(run())


def test_client_leaving_before_the_upstream_answers_releases_at_once():
    """Nothing is being written, so only handler cancellation notices the client is gone."""
    async def run():
        async with running() as (session, base, gateway, fake):
            task = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=chat(5, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 5 and fake.active == 1)
            task.cancel()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0, timeout=2)
            await wait_for(lambda: fake.cancelled == 1)
            assert not fake.released

    asyncio.run(run())


# ---------------------------------------------------------------- /metrics, /healthz

def _sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name:
            found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if found == labels:
                return float(m.group(3))
    raise AssertionError(f"{name}{labels} not in metrics")


def test_metrics_and_healthz():
    async def run():
        async with running() as (session, base, gateway, fake):
            async with session.get(f"{base}/healthz") as resp:
                assert resp.status == 200 and (await resp.json()) == {"status": "ok"}
            hold = asyncio.create_task(session.post(f"{base}/v1/chat/completions", json=chat(1536, x_mode="hold")))
            await wait_for(lambda: gateway.ledger.reserved_blocks == 100)
            for body in (chat(5), chat(5), chat(3000)):
                async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
                    await resp.read()
            async with session.get(f"{base}/metrics") as resp:
                text = await resp.text()
            assert _sample(text, "kvtune_gateway_budget_blocks") == 100
            assert _sample(text, "kvtune_gateway_reserved_blocks") == 100
            assert _sample(text, "kvtune_gateway_inflight_requests") == 1
            assert _sample(text, "kvtune_gateway_admitted_total", route="chat") == 1
            assert _sample(text, "kvtune_gateway_rejected_total", route="chat", reason="kv_budget_exhausted") == 2
            assert _sample(text, "kvtune_gateway_rejected_total", route="chat", reason="context_length_exceeded") == 1
            assert _sample(text, "kvtune_gateway_retry_after_seconds_count") == 2
            fake.release()
            (await hold).release()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)
            async with session.get(f"{base}/metrics") as resp:
                assert _sample(await resp.text(), "kvtune_gateway_reserved_blocks") == 0

    asyncio.run(run())


# ---------------------------------------------------------------- graceful shutdown

def test_shutdown_drains_short_streams_and_cuts_long_ones():
    async def run():
        async with FakeVllm() as fake:
            config = config_for(fake.url, listen={"port": 0}, timeouts={"drain_s": 1.0})
            stop = asyncio.Event()
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            server = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result))
            base = (await ready).split(",")[0]
            try:
                async with aiohttp.ClientSession() as session:
                    async def stream(chunks: int) -> bytes:
                        async with session.post(f"{base}/v1/chat/completions",
                                                json=chat(5, stream=True, x_chunks=chunks, x_delay=0.05)) as resp:
                            return await resp.read()

                    short = asyncio.create_task(stream(6))     # ~0.3 s: finishes inside the drain
                    long = asyncio.create_task(stream(400))    # ~20 s: cut at the drain deadline
                    await wait_for(lambda: fake.active == 2)
                    stop.set()
                    gateway = await asyncio.wait_for(server, 10)
                    assert (await short).endswith(DONE_EVENT)
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await long
                    assert gateway.ledger.reserved_blocks == 0 and gateway.ledger.inflight_requests == 0
            finally:
                stop.set()

    asyncio.run(run())


# ---------------------------------------------------------------- who may read /metrics and /kvtune/ledger

def _outside_address() -> str:
    """An address of this machine that is not loopback, to connect from as a remote client would."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent; this picks the outgoing interface
        address = s.getsockname()[0]
    assert not address.startswith("127."), "this machine has no non-loopback IPv4 address"
    return address


@pytest.mark.parametrize("admin, loopback, outside, token", [
    ({}, 200, 403, None),                                          # the default: loopback only
    ({"metrics": "public"}, 200, 200, None),
    ({"metrics": "token", "ledger": "token", "token_env": "KVTUNE_TEST_TOKEN"}, 403, 403, 200),
])
def test_admin_endpoints_are_limited_as_configured(monkeypatch, admin, loopback, outside, token):
    monkeypatch.setenv("KVTUNE_TEST_TOKEN", "s3cret")

    async def run():
        async with running(admin=admin, listen={"host": "0.0.0.0", "port": 0}) as (session, base, gateway, fake):
            port = base.rsplit(":", 1)[1]
            for host, expected in (("127.0.0.1", loopback), (_outside_address(), outside)):
                async with session.get(f"http://{host}:{port}/metrics") as resp:
                    assert resp.status == expected, (host, admin)
            if token is not None:
                for given, expected in (("Bearer s3cret", token), ("Bearer wrong", 403), ("s3cret", 403)):
                    for path in ("/metrics", "/kvtune/ledger"):
                        async with session.get(f"http://127.0.0.1:{port}{path}",
                                               headers={"Authorization": given}) as resp:
                            assert resp.status == expected, (path, given)
            else:
                async with session.get(f"http://{_outside_address()}:{port}/kvtune/ledger") as resp:
                    assert resp.status == 403

    asyncio.run(run())


def test_an_ipv4_mapped_loopback_client_is_loopback():
    """On a dual-stack listener a local IPv4 client arrives as ::ffff:127.0.0.1."""
    async def run():
        async with running(listen={"host": "::", "port": 0}) as (session, base, gateway, fake):
            port = base.rsplit(":", 1)[1]
            async with session.get(f"http://127.0.0.1:{port}/kvtune/ledger") as resp:
                assert resp.status == 200

    asyncio.run(run())


def test_a_token_access_without_the_token_in_the_environment_fails_at_start(monkeypatch):
    from kvtune.errors import InputError

    monkeypatch.delenv("KVTUNE_NO_SUCH_TOKEN", raising=False)
    config = config_for("http://127.0.0.1:9", admin={"metrics": "token", "token_env": "KVTUNE_NO_SUCH_TOKEN"})
    with pytest.raises(InputError, match="admin.token_env: the environment variable KVTUNE_NO_SUCH_TOKEN"):
        make_app(config)


# ---------------------------------------------------------------- an upstream that lies

async def _lying_upstream(answer: bytes) -> tuple[asyncio.AbstractServer, int]:
    """A raw TCP upstream that answers every request with `answer` and hangs up."""
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"short\": 1}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nabcde",
    b"NOT HTTP\r\n\r\n",
])
def test_an_upstream_answer_that_breaks_is_502_never_500(answer):
    async def run():
        server, port = await _lying_upstream(answer)
        try:
            counting = {"method": "estimate", "chars_per_token": 2, "margin_tokens": 8}
            config = config_for(f"http://127.0.0.1:{port}", listen={"port": 0}, prompt_tokens=counting)
            app = make_app(config)
            stop = asyncio.Event()
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result, app=app))
            base = (await ready).split(",")[0]
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.post(f"{base}/v1/chat/completions", json=chat(3)) as resp:
                        status = resp.status
                        try:
                            await resp.read()
                        except aiohttp.ClientPayloadError:
                            pass  # a stream cut mid-body is the other honest answer
                assert status == 502 or (status == 200 and b"chunked" in answer)
                await wait_for(lambda: app[GATEWAY].ledger.reserved_blocks == 0)
            finally:
                stop.set()
                await asyncio.wait_for(task, 20)
        finally:
            server.close()

    asyncio.run(run())


# ---------------------------------------------------------------- a malformed request is one log line

def test_malformed_requests_log_one_line_each_never_a_traceback(caplog):
    import logging

    bodies = [b"{not json", b'{"messages": "x"}', b'{"max_tokens": NaN, "messages": []}',
              b"[" * 3000, b'{"model": "\\ud800", "messages": []}', b'{"messages": [], "max_tokens": 1e400}']

    async def run():
        async with running() as (session, base, gateway, fake):
            for body in bodies:
                async with session.post(f"{base}/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 400
            async with session.post(f"{base}/v1/chat/completions", data=b"x",
                                    headers={"Content-Length": "1", "Transfer-Encoding": "chunked"}) as resp:
                assert resp.status == 400

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    for record in caplog.records:
        assert record.exc_info is None and "Traceback" not in record.getMessage(), record.getMessage()


def test_a_connection_over_max_connections_is_closed_at_once_and_a_freed_slot_serves_again():
    """nginx has no exact per-listener cap (worker_connections counts upstream connections too),
    so this is the Python gateway's own: connection N+1 is closed before a byte is read."""
    async def run():
        limits = {"max_connections": 8, "keepalive_timeout_s": 30}
        async with running(limits=limits) as (session, base, gateway, fake):
            host, port = base.removeprefix("http://").rsplit(":", 1)
            held = [await asyncio.open_connection(host, int(port)) for _ in range(8)]
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:  # EOF or a reset, never an answer
                answer = await asyncio.wait_for(reader.read(), 5)
            except ConnectionResetError:
                answer = b""
            assert answer == b""
            writer.close()
            for _, w in held[:2]:
                w.close()
            await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as fresh:  # a new connection, in a freed slot
                async with fresh.post(f"{base}/v1/chat/completions", json=chat(5)) as resp:
                    assert resp.status == 200
            for _, w in held[2:]:
                w.close()

    asyncio.run(run())


# ---------------------------------------------------------------- the statistical policy

_SHORT_MOSTLY = {"lengths": [4, 64], "counts": [19, 1]}  # chat answers: 4 tokens, 1 in 20 reaches the cap


def _held_streams(policy: dict, n: int) -> tuple[int, int, list[dict]]:
    """Open n slow streams at once on the chat route; (admitted, refused with Retry-After, ledger
    snapshots taken while they were held), then check everything was given back."""
    async def run():
        routes = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64,
                   "output_histogram": _SHORT_MOSTLY}, {"name": "default", "max_new_tokens": 32}]
        async with running(admission=policy, routes=routes) as (session, base, gateway, fake):
            opened = []
            for _ in range(n):
                resp = await session.post(base + "/v1/chat/completions",
                                          json=chat(3, stream=True, x_chunks=40, x_delay=0.05))
                opened.append(resp)
            admitted = [r for r in opened if r.status == 200]
            refused = [r for r in opened if r.status == 429 and int(r.headers["Retry-After"]) >= 1]
            async with session.get(base + "/kvtune/ledger") as resp:
                during = [await resp.json()]
            for r in admitted:
                await r.read()  # 40 tokens streamed: the ledger conditions each at 16 and 32
            for r in opened:
                r.release()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0 and gateway.ledger.inflight_requests == 0)
            async with session.get(base + "/kvtune/ledger") as resp:
                during.append(await resp.json())
            return len(admitted), len(refused), during

    return asyncio.run(run())


def test_statistical_admits_more_streams_than_guaranteed_and_gives_every_block_back():
    guaranteed, g_refused, _ = _held_streams({"policy": "guaranteed"}, 40)
    statistical, s_refused, ledger = _held_streams({"policy": "statistical", "epsilon": 0.05}, 40)
    assert guaranteed + g_refused == 40 and statistical + s_refused == 40
    assert guaranteed == 100 // blocks_of_chat3()
    assert statistical > guaranteed
    held, after = ledger
    assert held["policy"] == "statistical" and held["epsilon"] == 0.05 and held["limit"] is None
    assert 0.0 < held["overflow_probability"] <= 0.05
    assert held["reserved"] > 100  # worst cases past the budget: the bet the policy makes
    assert after["reserved"] == 0 and after["overflow_probability"] == 0.0


def test_statistical_at_epsilon_zero_admits_what_guaranteed_admits():
    guaranteed, _, _ = _held_streams({"policy": "guaranteed"}, 30)
    zero, _, _ = _held_streams({"policy": "statistical", "epsilon": 0.0}, 30)
    assert zero == guaranteed


def blocks_of_chat3() -> int:
    from enforcers import blocks
    from fake_vllm import FakeVllm

    return blocks(FakeVllm().prompt_tokens(chat(3)), 64)


def test_statistical_metrics_show_the_overflow_probability():
    async def run():
        async with running(admission={"policy": "statistical", "epsilon": 0.05}) as (session, base, gateway, fake):
            async with session.get(base + "/metrics") as resp:
                text = await resp.text()
            assert _sample(text, "kvtune_gateway_overflow_probability") == 0.0
        async with running() as (session, base, gateway, fake):
            async with session.get(base + "/metrics") as resp:
                assert "kvtune_gateway_overflow_probability" not in await resp.text()

    asyncio.run(run())


def test_streamed_tokens_condition_what_the_statistical_ledger_expects():
    """A chat answer is 4 tokens long 19 times in 20; once one has streamed past 16 tokens it is the
    long kind, and the ledger's overflow probability for it goes from 1 in 20 to certain."""
    async def run():
        routes = [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64,
                   "output_histogram": _SHORT_MOSTLY}]
        async with running(admission={"policy": "statistical", "epsilon": 0.1}, routes=routes,
                           block_budget=4) as (session, base, gateway, fake):
            async with session.post(base + "/v1/chat/completions",
                                    json=chat(3, stream=True, x_chunks=40, x_delay=0.05)) as resp:
                assert resp.status == 200
                assert gateway.ledger.overflow_probability() == pytest.approx(0.05)
                seen = b""
                while seen.count(b"\n\n") < 16 + 3:
                    seen += await resp.content.readany()
                await wait_for(lambda: gateway.ledger.overflow_probability() == 1.0)
                await resp.read()
            await wait_for(lambda: gateway.ledger.reserved_blocks == 0)
            assert gateway.ledger.overflow_probability() == 0.0

    asyncio.run(run())


# ---------------------------------------------------------------- framing surprises from the upstream

async def _one_answer_server(answer: bytes) -> tuple[asyncio.Server, list[int]]:
    """A raw HTTP/1.1 upstream that answers every request with `answer` (keeping the connection
    open); returns the server and a list that counts its connections."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), connections


def test_an_upstream_answer_with_chunked_and_content_length_reaches_the_client_whole():
    """Transfer-Encoding: chunked and Content-Length: 100 on a 2-byte body: the gateway forwarded
    the Content-Length and its client waited for 98 bytes that never came. RFC 9112 §6.3: the
    coding wins and the length is removed; the connection, which may hide a smuggled answer, is
    not reused."""
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
              b"Content-Length: 100\r\n\r\n2\r\n{}\r\n0\r\n\r\n")

    async def run():
        server, connections = await _one_answer_server(answer)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with running(routes=[{"name": "odd", "upstream": url, "max_new_tokens": 8}],
                               prompt_tokens={"method": "estimate", "chars_per_token": 3, "margin_tokens": 8}) \
                    as (session, base, gateway, fake):
                for _ in range(2):
                    async with asyncio.timeout(5):
                        async with session.post(f"{base}/v1/chat/completions", json=chat(5)) as resp:
                            assert resp.status == 200 and "Content-Length" not in resp.headers
                            assert await resp.read() == b"{}"
                assert len(connections) == 2  # not reused
                assert gateway.ledger.reserved_blocks == 0
        finally:
            server.close()

    asyncio.run(run())


def test_a_body_trickling_in_is_cut_at_the_body_deadline():
    """A byte every 0.4 s never trips body_timeout_s: 1 (between reads), so a long body held the
    connection for as long as it was long (40 s in the issue under body_timeout_s: 3, a byte every
    2 s). limits.body_deadline_s bounds the whole body: 408 and the connection closed at 2 s."""
    async def run():
        async with running(limits={"body_timeout_s": 1, "body_deadline_s": 2}) as (session, base, gateway, fake):
            port = int(base.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n")
            started = time.monotonic()

            async def trickle():
                with contextlib.suppress(ConnectionError):
                    for _ in range(100):
                        writer.write(b" ")
                        await writer.drain()
                        await asyncio.sleep(0.4)

            sender = asyncio.create_task(trickle())
            try:
                answer = await asyncio.wait_for(reader.read(), 10)  # to the close
            finally:
                sender.cancel()
                writer.close()
            took = time.monotonic() - started
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            assert b"the request body did not arrive within 2 s" in answer
            assert 1.9 < took < 4, took
            assert fake.engine_calls == [] and gateway.ledger.reserved_blocks == 0

    asyncio.run(run())
