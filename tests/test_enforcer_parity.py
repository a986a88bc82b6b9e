"""One behaviour, two enforcers: the same policy tests against `kvtune gateway` (Python, from the
rendered gateway.yaml) and the rendered nginx.conf on a real nginx with Lua, both rendered from
one recommendation and both in front of the same fake-vLLM upstream from test_nginx.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import pytest
import yaml

from kvtune.gateway_config import parse_gateway_config
from kvtune.render import RenderOptions, render_files
from test_nginx import HOSTILE, HOSTILE_MODEL, Nginx, Upstream, _free_port, _in_thread, chat, small_rec, words

pytestmark = pytest.mark.slow


class PyGateway:
    """`kvtune gateway` on its own event loop in a thread, with the Nginx helper's interface."""

    def __init__(self, config_text: str) -> None:
        self.config = parse_gateway_config(yaml.safe_load(config_text), path="gateway.yaml")
        self.port = self.config.port
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kvtune.gateway.proxy import serve

        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            await serve(self.config, stop=self._stop, on_ready=lambda _: self._ready.set())

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    def start(self) -> "PyGateway":
        self._thread.start()
        assert self._ready.wait(15) and self._error is None, self._error
        return self

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "gateway did not stop"

    request = Nginx.request
    ledger = Nginx.ledger
    wait_ledger = Nginx.wait_ledger


@pytest.fixture
def upstream():
    up = Upstream().start()
    try:
        yield up
    finally:
        up.release()
        up.stop()


@pytest.fixture(params=["python", "nginx"])
def enforcer(request, tmp_path, upstream):
    rec = small_rec(upstream.port)
    port = _free_port()
    options = RenderOptions(listen_port=port, nginx_worker_processes="2",
                            nginx_user="root" if os.geteuid() == 0 else None)
    if request.param == "python":
        server = PyGateway(render_files(rec, targets=["gateway.yaml"], options=options)["gateway.yaml"])
    else:
        conf = render_files(rec, targets=["nginx.conf"], options=options)["nginx.conf"]
        server = Nginx(tmp_path / "nginx", conf, port)
    try:
        yield server.start()
    finally:
        server.stop()


def blocks(prompt: int, cap: int, sequences: int = 1) -> int:
    return sequences * -(-(prompt + cap) // 16)


def test_route_table_and_budget(enforcer):
    ledger = enforcer.ledger()
    assert ledger["routes"] == [HOSTILE, "/v1/chat/completions", "/v1/completions", "default"]
    assert ledger["budget"] == 100 and ledger["reserved"] == 0


@pytest.mark.parametrize("extra, field, expected", [
    ({}, "max_tokens", 64),                                   # absent: the route's cap is set
    ({"max_tokens": 5000}, "max_tokens", 64),                 # larger: clamped
    ({"max_tokens": 10}, "max_tokens", 10),                   # smaller: kept
    ({"max_completion_tokens": 9000}, "max_completion_tokens", 64),
    ({"max_output_tokens": 70}, "max_output_tokens", 64),
])
def test_each_alias_is_clamped(enforcer, upstream, extra, field, expected):
    status, headers, _ = enforcer.request("/v1/chat/completions", chat(10, **extra))
    assert status == 200
    assert upstream.seen[-1][field] == expected
    assert headers["X-Kvtune-Max-Tokens"] == str(expected)
    assert headers["X-Kvtune-Reserved-Blocks"] == str(blocks(10, expected))
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_every_present_alias_gets_the_cap_and_the_rest_is_untouched(enforcer, upstream):
    body = chat(10, max_completion_tokens=9000, max_tokens=None, stop=[], n=1, temperature=0.5)
    assert enforcer.request("/v1/chat/completions", body)[0] == 200
    seen = upstream.seen[-1]
    assert seen["max_completion_tokens"] == 64 and seen["max_tokens"] == 64
    assert seen["stop"] == [] and seen["n"] == 1 and seen["temperature"] == 0.5
    assert seen["messages"] == body["messages"]


@pytest.mark.parametrize("extra, max_tokens, min_tokens", [
    ({"max_tokens": 5000, "min_tokens": 100}, 64, 64),   # above the clamped cap: comes down to it
    ({"min_tokens": 5000}, 64, 64),                       # no max_tokens: the route's cap is set
    ({"max_tokens": 10, "min_tokens": 20}, 10, 10),       # the client's own cap is the limit too
    ({"max_tokens": 5000, "min_tokens": 64}, 64, 64),     # equal is allowed
    ({"max_tokens": 5000, "min_tokens": 70.5}, 64, 64),
    ({"max_tokens": 5000, "min_tokens": 5}, 64, 5),       # below: untouched
    ({"max_tokens": 5000, "min_tokens": "lots"}, 64, "lots"),  # not a number: vLLM's to judge
])
def test_min_tokens_above_the_cap_comes_down_to_it(enforcer, upstream, extra, max_tokens, min_tokens):
    """vLLM answers 400 to min_tokens > max_tokens: clamping the cap must not create one."""
    status, headers, _ = enforcer.request("/v1/chat/completions", chat(10, **extra))
    assert status == 200
    seen = upstream.seen[-1]
    assert (seen["max_tokens"], seen["min_tokens"]) == (max_tokens, min_tokens)
    assert headers["X-Kvtune-Max-Tokens"] == str(max_tokens)
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_model_route_and_path_route(enforcer, upstream):
    body = chat(10, max_tokens=999)
    body["model"] = HOSTILE_MODEL
    status, headers, _ = enforcer.request("/v1/chat/completions", body)
    assert status == 200 and upstream.seen[-1]["max_tokens"] == 32
    assert headers["X-Kvtune-Reserved-Blocks"] == str(blocks(10, 32))
    status, headers, _ = enforcer.request("/v1/completions", {"model": "m", "prompt": words(5), "max_tokens": 4000})
    assert status == 200 and upstream.seen[-1]["max_tokens"] == 96
    assert headers["X-Kvtune-Reserved-Blocks"] == str(blocks(5, 96))


@pytest.mark.parametrize("extra, sequences", [({"n": 3}, 3), ({"best_of": 4, "n": 2}, 4), ({"n": 1}, 1)])
def test_n_and_best_of_multiply_the_reservation(enforcer, extra, sequences):
    status, headers, _ = enforcer.request("/v1/chat/completions", chat(40, **extra))
    assert status == 200
    assert headers["X-Kvtune-Reserved-Blocks"] == str(blocks(40, 64, sequences))


def test_full_budget_answers_429_with_retry_after_then_releases(enforcer, upstream):
    upstream.hold()
    # 1536 prompt + 64 cap = 1600 tokens = 100 blocks: the whole budget
    t, box = _in_thread(enforcer.request, "/v1/chat/completions", chat(1536, hold=True))
    assert enforcer.wait_ledger(100)["reserved"] == 100
    status, headers, body = enforcer.request("/v1/chat/completions", chat(1))
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    error = json.loads(body)["error"]
    assert error["code"] == "kv_budget_exhausted" and error["type"] == "rate_limit_error"
    assert error["message"]
    assert enforcer.ledger()["reserved"] == 100
    upstream.release()
    t.join(10)
    assert box["result"][0] == 200
    assert enforcer.wait_ledger(0)["reserved"] == 0
    assert enforcer.request("/v1/chat/completions", chat(1))[0] == 200

    # Retry-After follows the release rate (100 blocks just released, averaged over 30 s): a
    # request that needs more blocks is told to wait longer.
    upstream.hold()
    t, box = _in_thread(enforcer.request, "/v1/chat/completions", chat(1536, hold=True))
    enforcer.wait_ledger(100)
    small = enforcer.request("/v1/chat/completions", chat(1))
    large = enforcer.request("/v1/chat/completions", chat(1000))
    upstream.release()
    t.join(10)
    assert small[0] == large[0] == 429
    assert 1 <= int(small[1]["Retry-After"]) < int(large[1]["Retry-After"]) <= 60
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_streams_pass_through_and_client_abort_releases(enforcer, upstream):
    upstream.hold()
    sock = socket.create_connection(("127.0.0.1", enforcer.port), timeout=10)
    payload = json.dumps(chat(100, stream=True, hold_stream=True)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while b'"chunk": 0' not in received:  # the first chunk arrives while the upstream still holds
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200")
    assert enforcer.ledger()["reserved"] == blocks(100, 64)
    sock.close()  # the client goes away mid-stream
    assert enforcer.wait_ledger(0)["reserved"] == 0
    upstream.release()

    status, _, body = enforcer.request("/v1/chat/completions", chat(5, stream=True))
    assert status == 200 and body.count(b"data:") == 4
    assert enforcer.wait_ledger(0)["reserved"] == 0


def test_requests_that_can_never_fit_are_rejected_at_once(enforcer, upstream):
    status, headers, body = enforcer.request("/v1/chat/completions", chat(3000))
    assert status == 400 and "Retry-After" not in headers
    assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    # 5 × ceil((500 + 64) / 16) = 180 blocks > the 100-block budget
    status, headers, body = enforcer.request("/v1/chat/completions", chat(500, n=5))
    assert status == 413 and "Retry-After" not in headers
    assert json.loads(body)["error"]["code"] == "kv_reservation_exceeds_budget"
    assert upstream.seen == []
    assert enforcer.ledger()["reserved"] == 0


@pytest.mark.parametrize("body, code", [
    (chat(5, max_tokens="lots"), "invalid_max_tokens"),
    (chat(5, max_tokens=0), "invalid_max_tokens"),
    (chat(5, max_completion_tokens=2.5), "invalid_max_tokens"),
    (chat(5, n=-1), "invalid_n"),
    (chat(5, best_of=True), "invalid_best_of"),
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
])
def test_malformed_requests_are_400(enforcer, upstream, body, code):
    status, headers, raw = enforcer.request("/v1/chat/completions", body)
    assert status == 400 and "Retry-After" not in headers
    assert json.loads(raw)["error"]["code"] == code
    assert upstream.seen == [] and enforcer.ledger()["reserved"] == 0


def test_other_requests_pass_through_untouched(enforcer, upstream):
    status, _, _ = enforcer.request("/v1/models", method="GET")
    assert status == 404  # the fake upstream has no /v1/models: the answer is the upstream's
    # a GET on a generation path is not governed either
    assert enforcer.request("/v1/chat/completions", method="GET")[0] == 405
    assert enforcer.ledger()["reserved"] == 0 and upstream.seen == []


def test_concurrent_requests_never_exceed_the_budget(enforcer, upstream):
    """12 requests of 17 blocks against 100: some admitted, the rest 429, ledger back to zero."""
    upstream.hold()
    peak = {"reserved": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["reserved"] = max(peak["reserved"], enforcer.ledger()["reserved"])
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [_in_thread(enforcer.request, "/v1/chat/completions", chat(200, hold=True)) for _ in range(12)]
    deadline = time.monotonic() + 10
    while sum("result" in box for _, box in threads) < 7 and time.monotonic() < deadline:
        time.sleep(0.02)  # 5 × 17 = 85 blocks fit; the other 7 answer 429 at once
    upstream.release()
    for t, _ in threads:
        t.join(15)
    done.set()
    sampler.join(5)
    statuses = sorted(box["result"][0] for _, box in threads)
    assert statuses == [200] * 5 + [429] * 7
    assert peak["reserved"] <= 100
    assert enforcer.wait_ledger(0)["reserved"] == 0
