"""The gateway says what it refuses (issue #25, item 12): a real `kvtune gateway` process on
loopback in front of tests/support/fake_vllm.py, its budget held full by one stream, answers N requests
429; its log holds one line per reason and route per second with counts that sum to N (the blocks
needed and free named), flushed by its timer while it runs and at shutdown, never a line each."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time

import yaml
from fake_vllm import FakeVllm

CONFIG = {
    "version": 1, "upstream": "http://127.0.0.1:9", "block_size": 16, "block_budget": 6,
    "max_model_len": 2048, "listen": {"port": 0},
    "prompt_tokens": {"method": "estimate", "chars_per_token": 2, "margin_tokens": 8},
    "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64}],
}
BODY = {"model": "m", "messages": [{"role": "user", "content": "a b c"}]}
LINE = re.compile(r"^refused (\d+) in (\d+\.\d) s: kv_budget_exhausted route=chat status=429 "
                  r"needed 6 blocks, 0 free \(last\)$")


def _post(port: int, body: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _refused(lines: list[str]) -> list[int]:
    counts = []
    for line in lines:
        if line.startswith("refused "):
            m = LINE.match(line)
            assert m, line
            counts.append(int(m.group(1)))
    return counts


def test_refusals_are_logged_as_counts_per_reason_per_second(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    with FakeVllm() as up:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtune", "gateway", "--config", str(path), "--upstream",
             f"http://127.0.0.1:{up.port}", "--host", "127.0.0.1", "--port", "0"],
            stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(ln.rstrip("\n") for ln in proc.stderr), daemon=True)
        try:
            first = proc.stderr.readline()
            match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", first)
            assert match, first
            port = int(match.group(1))
            reader.start()
            up.hold()
            holder = threading.Thread(target=_post, args=(port, {**BODY, "stream": True, "x_mode": "hold_stream"}))
            holder.start()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            for _ in range(250):  # the held stream fills the budget
                conn.request("GET", "/kvtune/ledger")
                if json.loads(conn.getresponse().read())["reserved"] == 6:
                    break
                time.sleep(0.02)
            conn.close()
            n = 77
            started = time.monotonic()
            statuses = []
            for _ in range(n):  # over about 2.5 s: more than one window
                statuses.append(_post(port, BODY))
                time.sleep(0.03)
            spent = time.monotonic() - started
            assert statuses == [429] * n
            deadline = time.monotonic() + 5
            while sum(_refused(lines)) < n and time.monotonic() < deadline:  # the timer flushes the last window
                time.sleep(0.05)
            counts = _refused(lines)
            assert sum(counts) == n, lines
            assert 2 <= len(counts) <= spent + 2, lines  # one line a second, never one per request
            more = [_post(port, BODY) for _ in range(5)]
            assert more == [429] * 5
            proc.send_signal(signal.SIGTERM)
            up.release()
            holder.join(20)
            assert proc.wait(20) == 0
            reader.join(10)
            counts = _refused(lines)
            print("\n".join(lines))
            assert sum(counts) == n + 5, lines  # the last window flushed at shutdown
            assert len(counts) <= spent + 4
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            if reader.is_alive():
                reader.join(10)
            proc.stderr.close()


NGINX_LINE = re.compile(r"kvtune: refused (\d+) in (\d+\.\d) s: kv_budget_exhausted route=(\S+) status=429 "
                        r"needed (\d+) blocks, 0 free \(last\)")


def test_nginx_logs_its_refusals_as_counts_per_reason_per_second_in_each_worker(tmp_path):
    """The rendered nginx.conf's Lua does the same: one warn line per reason and route per second
    in the worker, flushed by its timer and when the worker exits (SIGQUIT)."""
    import os

    from enforcers import chat, in_thread, small_fake, small_rec, start_enforcer

    with small_fake() as fake:
        server = start_enforcer("nginx", small_rec(fake.port), tmp_path / "nginx", nginx_worker_processes="1",
                                nginx_user="root" if os.geteuid() == 0 else None)
        try:
            fake.hold()
            held, box = in_thread(server.request, "/v1/chat/completions", chat(1536, x_mode="hold"))
            assert server.wait_ledger(100)["reserved"] == 100
            n = 40
            started = time.monotonic()
            for _ in range(n):  # over about 1.6 s: more than one window
                assert server.request("/v1/chat/completions", chat(1))[0] == 429
                time.sleep(0.03)
            spent = time.monotonic() - started
            deadline = time.monotonic() + 5
            while sum(int(m[0]) for m in NGINX_LINE.findall(server.error_log())) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            found = NGINX_LINE.findall(server.error_log())
            assert sum(int(m[0]) for m in found) == n, server.error_log()
            assert 2 <= len(found) <= spent + 2
            assert {m[2] for m in found} == {"/v1/chat/completions"}
            for _ in range(3):
                assert server.request("/v1/chat/completions", chat(1))[0] == 429
            fake.release()
            held.join(10)
            assert box["result"][0] == 200
        finally:
            server.stop()
        found = NGINX_LINE.findall(server.error_log())
        assert sum(int(m[0]) for m in found) == n + 3, server.error_log()  # the last window at the worker's exit
