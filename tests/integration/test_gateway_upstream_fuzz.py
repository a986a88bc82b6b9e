"""Hostile upstream answers against both enforcers, as hypothesis writes them (issue 26 item
10's framing class): chunked and Content-Length together (in either order, the length right,
short or long), Content-Length given twice, negative or not a number, a Transfer-Encoding other
than chunked, chunk sizes that lie or are not hex, bodies cut short, late bytes after a complete
answer, a status line that is not HTTP. Health probes and /tokenize are answered honestly, so
every fuzzed answer is the engine's answer to an admitted generation. Whatever the engine says,
the client is answered in time (never left waiting on a length that will not come), never with
a 500 of the gateway's own, never the engine's raw bytes as an answer (nginx relayed an answer
without a status line as HTTP/0.9: a client read "NOT HTTP ... Content-Length: 100" and waited),
a 200 that states a Content-Length carries exactly that many bytes, the ledger drains to 0 and
nginx logs no Lua error. nginx may close the connection without an answer where a chunked
answer breaks in its first bytes (it has committed to relaying the 200: proxy_buffering off);
the Python gateway answers 502 there. A few seconds per enforcer."""

from __future__ import annotations

import http.client
import json
import os
import socket
import socketserver
import threading

import pytest
from enforcers import small_rec, start_enforcer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.gateway.config import ClientLimits

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("KVTUNE_FUZZ_EXAMPLES", "120"))
BODY = b'{"id":"x","object":"chat.completion","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'


def _chunked(body: bytes, size: int) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size))
    return out + b"0\r\n\r\n"


@st.composite
def answers(draw) -> bytes:
    """One raw upstream answer to a generation."""
    status = draw(st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 400 Bad",
                                   b"HTTP/1.1 500 Oops", b"HTTP/1.1 200", b"NOT HTTP", b"HTTP/1.1 2OO OK", b""]))
    body = draw(st.sampled_from([BODY, b"{}", b"", b"x" * 5000]))
    chunked = draw(st.booleans())
    payload = _chunked(body, draw(st.sampled_from([1, 7, 4096]))) if chunked else body
    if chunked and draw(st.integers(0, 4)) == 0:  # a chunk size that lies or is not hex
        payload = draw(st.sampled_from([b"ZZ\r\n", b"ffff\r\n{}\r\n0\r\n\r\n", b"-1\r\n", b"2;ext=1\r\n{}\r\n0\r\n\r\n",
                                        b"2\r\n{}0\r\n\r\n"])) + payload[:draw(st.integers(0, 10))]
    headers = [b"Content-Type: application/json"]
    if chunked:
        headers.append(draw(st.sampled_from([b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked",
                                             b"Transfer-Encoding: chunked, chunked", b"transfer-encoding: Chunked"])))
    elif draw(st.integers(0, 5)) == 0:
        headers.append(draw(st.sampled_from([b"Transfer-Encoding: gzip", b"Transfer-Encoding: identity"])))
    length = draw(st.sampled_from(["right", "right", "none", "short", "long", "twice", "negative", "text"]))
    lengths = {"right": [len(payload)], "none": [], "short": [max(len(payload) - 3, 0)], "long": [len(payload) + 100],
               "twice": [len(payload), len(payload) + 1], "negative": [-1], "text": ["ten"]}[length]
    headers += [b"Content-Length: %s" % str(n).encode() for n in lengths]
    if draw(st.booleans()):
        headers.reverse()  # the length before the coding or after it
    raw = status + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + payload
    cut = draw(st.sampled_from(["whole", "whole", "whole", "cut", "late"]))
    if cut == "cut":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif cut == "late":
        raw += b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    return raw


class _Upstream(socketserver.ThreadingTCPServer):
    """Answers health checks and /tokenize honestly and every generation with `self.answer`,
    then hangs up (the only way such an answer can end)."""

    daemon_threads = True
    allow_reuse_address = True
    answer = BODY

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                rest += chunk
            method, path = head.split(b" ", 2)[:2]
            if method == b"POST" and path.startswith(b"/tokenize"):
                body = json.dumps({"count": 3, "max_model_len": 2048, "tokens": [1, 2, 3]}).encode()
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(body), body))
            elif method == b"POST":
                sock.sendall(self.server.answer)  # type: ignore[attr-defined]
            else:  # /health, /v1/models, /metrics
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")
        except (OSError, ValueError):
            pass
        finally:
            sock.close()


@pytest.fixture(scope="module")
def enforcers(tmp_path_factory):
    upstream = _Upstream()
    limits = ClientLimits(max_body_bytes=256 * 1024, header_timeout_s=5, body_timeout_s=5)
    options = {"nginx_worker_processes": "1", "limits": limits, "nginx_user": "root" if os.geteuid() == 0 else None}
    servers = {}
    try:
        rec = small_rec(upstream.port)
        for kind in ("python", "nginx"):
            servers[kind] = start_enforcer(kind, rec, tmp_path_factory.mktemp("nginx"), **options)
        yield servers, upstream
    finally:
        for server in servers.values():
            server.stop()
        upstream.shutdown()
        upstream.server_close()


@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_hostile_upstream_answers_never_hang_a_client_or_leak_blocks(enforcers, kind):
    servers, upstream = enforcers
    server = servers[kind]
    body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "w w w"}]}).encode()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize="KVTUNE_FUZZ_RANDOM" not in os.environ,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(answer=answers())
    def one(answer):
        upstream.answer = answer
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=15)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            try:
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError):
                # nginx, a chunked answer broken in its first bytes: it has committed to relaying
                # the engine's 200 (proxy_buffering off) and can only close; closed, not held
                assert kind == "nginx", answer[:200]
                return
            status = resp.status
            stated = resp.getheader("Content-Length")
            try:
                data = resp.read()
                complete = True
            except http.client.IncompleteRead as exc:  # an answer cut mid-body: passed on cut
                data, complete = exc.partial, False
        finally:
            conn.close()
        if status >= 500:
            assert status in (500, 502, 503, 504), (status, data[:300])
            # a 500 only where the engine itself said 500 and the gateway passed it on whole
            assert status != 500 or answer.startswith(b"HTTP/1.1 500"), (status, data[:300], answer[:200])
        if status == 200 and stated is not None and complete:
            assert len(data) == int(stated), (stated, len(data), answer[:200])

    one()
    assert server.wait_ledger(0)["reserved"] == 0
    assert server.ledger()["inflight"] == 0
    if kind == "nginx":
        log = server.error_log()
        assert "runtime error" not in log and "lua entry thread aborted" not in log, log[-2000:]
