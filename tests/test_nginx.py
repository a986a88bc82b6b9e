"""The rendered nginx.conf on a real nginx with the Lua module, in front of a small aiohttp upstream
that plays vLLM (/tokenize and /v1/chat/completions): `nginx -t`, and what only nginx does (an
estimate when /tokenize fails). The policy itself (clamp, reserve, 429, release, never-fits) is
held to one behaviour with the Python gateway in test_enforcer_parity.py, which uses these fixtures."""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvtune.render import RenderOptions, render_files

DATA = Path(__file__).parent / "data"
INSTALL_HINT = "apt-get install -y nginx libnginx-mod-http-lua lua-cjson"
HOSTILE = "ro\"ute' $(touch /tmp/kvtune-pwned) `id` \n]] [[ {{ x }} {% y %} % é 😀 \u2028;#"
HOSTILE_MODEL = "m\"o\\d]]el\n$(x)"


def _nginx() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path is None or not Path("/usr/lib/nginx/modules/ngx_http_lua_module.so").exists():
        pytest.fail(f"nginx with the Lua module is required for this test: {INSTALL_HINT}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_rec() -> dict:
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


def small_rec(upstream_port: int) -> dict:
    """A budget of 100 blocks of 16 tokens, context 2048, chat cap 64, hostile-model route cap 32."""
    rec = base_rec()
    rec["upstream"] = f"http://127.0.0.1:{upstream_port}"
    rec["capacity"]["num_blocks"] = 112
    rec["block_budget"]["value"] = 100
    rec["settings"]["max_model_len"]["value"] = 2048
    rec["settings"]["max_new_tokens_backstop"]["value"] = 128
    chat, completions = rec["routes"]
    hostile = copy.deepcopy(chat)
    hostile["route"] = HOSTILE
    hostile["match"] = {"path": "/v1/chat/completions", "model": HOSTILE_MODEL}
    hostile["max_new_tokens"]["value"] = 32
    chat["max_new_tokens"]["value"] = 64
    completions["max_new_tokens"]["value"] = 96
    rec["routes"] = [hostile, chat, completions]
    return rec


# ---------------------------------------------------------------- a fake vLLM upstream

class Upstream:
    """aiohttp in a thread: /tokenize counts words, chat completions stream chunks and can be held
    open until the test releases them."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.tokenize_fails = False
        self.port = _free_port()
        self._loop = asyncio.new_event_loop()
        self._release: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner = None

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)

        async def tokenize(request):
            if self.tokenize_fails:
                return web.json_response({"error": "down"}, status=500)
            body = await request.json()
            if "messages" in body:
                text = " ".join(str(m.get("content", "")) for m in body["messages"])
            else:
                text = body["prompt"]
            return web.json_response({"count": len(text.split()), "max_model_len": 2048, "tokens": []})

        async def chat(request):
            body = await request.json()
            self.seen.append(body)
            if body.get("hold"):
                await self._release.wait()
            if not body.get("stream"):
                return web.json_response({"choices": [{"message": {"content": "ok"}}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"chunk": 0}\n\n')
            if body.get("hold_stream"):
                await self._release.wait()
            for i in range(1, 3):
                await asyncio.sleep(0.05)
                await resp.write(f'data: {{"chunk": {i}}}\n\n'.encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        async def start():
            self._release = asyncio.Event()
            app = web.Application()
            app.router.add_post("/tokenize", tokenize)
            app.router.add_post("/v1/chat/completions", chat)
            app.router.add_post("/v1/completions", chat)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def start(self) -> "Upstream":
        self._thread.start()
        assert self._ready.wait(10), "upstream did not start"
        return self

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._release.clear)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class Nginx:
    def __init__(self, prefix: Path, conf_text: str, port: int) -> None:
        self.prefix, self.port = prefix, port
        (prefix / "logs").mkdir(parents=True, exist_ok=True)
        self.conf = prefix / "nginx.conf"
        self.conf.write_text(conf_text, encoding="utf-8")
        self.proc: subprocess.Popen | None = None

    def args(self, *extra: str) -> list[str]:
        return [_nginx(), "-p", str(self.prefix), "-c", str(self.conf),
                "-e", str(self.prefix / "logs" / "error.log"), *extra]

    def start(self) -> "Nginx":
        self.proc = subprocess.Popen(self.args("-g", "daemon off;"), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"nginx exited: {self.proc.stdout.read().decode()} {self.error_log()}")
            try:
                self.ledger()
                return self
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nginx did not answer: {self.error_log()}")

    def error_log(self) -> str:
        path = self.prefix / "logs" / "error.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        finally:
            self.proc.stdout.close()

    def request(self, path: str, body: dict | bytes | None = None, method: str = "POST",
                timeout: float = 10) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def ledger(self) -> dict:
        status, _, body = self.request("/kvtune/ledger", method="GET", timeout=2)
        assert status == 200, body
        return json.loads(body)

    def wait_ledger(self, reserved: int, timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            ledger = self.ledger()
            if ledger["reserved"] == reserved or time.monotonic() > deadline:
                return ledger
            time.sleep(0.05)


@pytest.fixture
def upstream():
    up = Upstream().start()
    try:
        yield up
    finally:
        up.release()
        up.stop()


@pytest.fixture
def gateway(tmp_path, upstream):
    rec = small_rec(upstream.port)
    port = _free_port()
    options = RenderOptions(listen_port=port, nginx_worker_processes="2",
                            nginx_user="root" if os.geteuid() == 0 else None)
    conf = render_files(rec, targets=["nginx.conf"], options=options)["nginx.conf"]
    server = Nginx(tmp_path / "nginx", conf, port)
    try:
        yield server.start()
    finally:
        server.stop()


def words(n: int) -> str:
    return " ".join(["w"] * n)


def chat(prompt_words: int, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": words(prompt_words)}], **extra}


# ---------------------------------------------------------------- nginx -t

def test_rendered_nginx_conf_passes_nginx_t(tmp_path):
    rec = base_rec()
    rec["routes"][0]["route"] = HOSTILE
    rec["routes"][0]["match"]["model"] = HOSTILE_MODEL
    conf = render_files(rec, targets=["nginx.conf"], options=RenderOptions(listen_port=_free_port()))
    server = Nginx(tmp_path, conf["nginx.conf"], 0)
    result = subprocess.run(server.args("-t"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_t_catches_a_broken_config(tmp_path):
    """The check above can fail: a misspelled directive is refused."""
    conf = render_files(base_rec(), targets=["nginx.conf"])["nginx.conf"]
    server = Nginx(tmp_path, conf.replace("proxy_buffering off;", "proxy_bufering off;"), 0)
    result = subprocess.run(server.args("-t"), capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "proxy_bufering" in result.stderr


def _in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("result", fn(*args)), daemon=True)
    t.start()
    return t, box


@pytest.mark.slow
def test_tokenize_failure_falls_back_to_an_estimate(gateway, upstream):
    upstream.tokenize_fails = True
    status, headers, _ = gateway.request("/v1/chat/completions", chat(30))
    assert status == 200
    # the estimate: bytes of the messages JSON / 3 + a 64-token margin, never below the true count
    messages = json.dumps(chat(30)["messages"], separators=(",", ":"))
    assert int(headers["X-Kvtune-Reserved-Blocks"]) >= -(-(30 + 64) // 16)
    assert int(headers["X-Kvtune-Reserved-Blocks"]) <= -(-(len(messages) // 3 + 64 + 64 + 16) // 16)
    assert gateway.wait_ledger(0)["reserved"] == 0
