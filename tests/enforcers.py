"""The two enforcers of one policy and the fake vLLM they stand in front of, for the tests that
hold them to one behaviour (test_enforcer_parity.py, test_nginx.py).

    Upstream()        aiohttp in a thread playing vLLM 0.32's endpoints: /tokenize and
                      /v1/messages/count_tokens count whitespace words; every other POST is
                      recorded (parsed in `seen`, raw bytes in `raw`, path in `paths`) and can be
                      held open with {"hold": true} until release(). GETs are recorded in `other`.
    Nginx(prefix, conf_text, port)   the rendered nginx.conf on a real nginx with Lua.
    PyGateway(gateway_yaml_text)     `kvtune gateway` on its own event loop in a thread.
Both enforcers have request(path, body, method, headers) -> (status, headers, body), ledger()
and wait_ledger(reserved); raw(bytes) sends bytes on a fresh socket and returns what came back.

small_rec(upstream_port) is the recommendation both are rendered from: a budget of 100 blocks of
16 tokens, context 2048, chat cap 64, completions cap 96, a hostile-model chat route capped at
32, a custom path /v1/summarize capped at 48, and a catch-all capped at 128.
"""

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

from kvtune.policy.recommendation import Recommendation

DATA = Path(__file__).parent / "data"
INSTALL_HINT = "apt-get install -y nginx libnginx-mod-http-lua lua-cjson"
HOSTILE = "ro\"ute' $(touch /tmp/kvtune-pwned) `id` \n]] [[ {{ x }} {% y %} % é 😀 \u2028;#"
HOSTILE_MODEL = "m\"o\\d]]el\n$(x)"
BUDGET, BLOCK, CONTEXT = 100, 16, 2048
CHAT_CAP, COMPLETIONS_CAP, HOSTILE_CAP, CUSTOM_CAP, DEFAULT_CAP = 64, 96, 32, 48, 128


def nginx_binary() -> str:
    path = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if path is None or not Path("/usr/lib/nginx/modules/ngx_http_lua_module.so").exists():
        pytest.fail(f"nginx with the Lua module is required for this test: {INSTALL_HINT}")
    return path


def free_port() -> int:
    """A port nginx can listen on (nginx cannot report a port it picked itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_rec() -> dict:
    """tests/data/recommendation.json as a dict, to edit before `Recommendation.from_dict`."""
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


def small_rec(upstream_port: int) -> Recommendation:
    rec = base_rec()
    rec["upstream"] = f"http://127.0.0.1:{upstream_port}"
    rec["capacity"]["num_blocks"] = 112
    rec["block_budget"]["value"] = BUDGET
    rec["settings"]["max_model_len"]["value"] = CONTEXT
    rec["settings"]["max_new_tokens_backstop"]["value"] = DEFAULT_CAP
    chat, completions = rec["routes"]
    hostile = copy.deepcopy(chat)
    hostile["route"] = HOSTILE
    hostile["match"] = {"path": "/v1/chat/completions", "model": HOSTILE_MODEL}
    hostile["max_new_tokens"]["value"] = HOSTILE_CAP
    custom = copy.deepcopy(chat)
    custom["route"] = "/v1/summarize"
    custom["match"] = {"path": "/v1/summarize", "model": None}
    custom["max_new_tokens"]["value"] = CUSTOM_CAP
    chat["max_new_tokens"]["value"] = CHAT_CAP
    completions["max_new_tokens"]["value"] = COMPLETIONS_CAP
    rec["routes"] = [hostile, chat, completions, custom]
    return Recommendation.from_dict(rec, path="small_rec")


def words(n: int) -> str:
    return " ".join(["w"] * n)


def chat(prompt_words: int, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": words(prompt_words)}], **extra}


def blocks(prompt: int, cap: int, sequences: int = 1) -> int:
    return sequences * -(-(prompt + cap) // BLOCK)


def _text_words(value) -> int:
    """Words in message content: a string, or text parts."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(len(p.get("text", "").split()) for p in value if isinstance(p, dict))
    return 0


class Upstream:
    """aiohttp in a thread playing vLLM (see the module docstring)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.raw: list[bytes] = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        self.other: list[tuple[str, str]] = []
        self.tokenize_calls: list[dict] = []
        self.tokenize_fails = False
        self.tokenize_answer: dict | None = None
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._release: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner = None

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)

        def as_vllm(handler):
            """A body the real server cannot validate is its 400, never its 500."""
            async def wrapped(request):
                try:
                    return await handler(request)
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                    return web.json_response({"error": {"message": "invalid request"}}, status=400)
            return wrapped

        @as_vllm
        async def tokenize(request):
            if self.tokenize_fails:
                return web.json_response({"error": "down"}, status=500)
            body = await request.json()
            self.tokenize_calls.append(body)
            if self.tokenize_answer is not None:
                return web.json_response(self.tokenize_answer)
            if "messages" in body:
                n = sum(_text_words(m.get("content")) for m in body["messages"])
                docs = (body.get("chat_template_kwargs") or {}).get("documents") or []
                n += sum(len(d.get("text", "").split()) for d in docs)
            else:
                n = len(body["prompt"].split())
            return web.json_response({"count": n, "max_model_len": CONTEXT, "tokens": []})

        @as_vllm
        async def count_tokens(request):
            body = await request.json()
            self.tokenize_calls.append(body)
            n = _text_words(body.get("system")) + sum(_text_words(m.get("content")) for m in body["messages"])
            return web.json_response({"input_tokens": n})

        @as_vllm
        async def generate(request):
            raw = await request.read()
            body = json.loads(raw)
            self.seen.append(body)
            self.raw.append(raw)
            self.paths.append(request.path_qs)
            self.headers.append(dict(request.headers))
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

        async def anything(request):
            self.other.append((request.method, request.path_qs))
            await request.read()
            return web.Response(text="upstream", headers={"X-Upstream": "yes"})

        async def start():
            self._release = asyncio.Event()
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_post("/tokenize", tokenize)
            app.router.add_post("/v1/messages/count_tokens", count_tokens)
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                         "/invocations", "/inference/v1/generate", "/v1/chat/completions/batch",
                         "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                         "/v1/rerank", "/v2/rerank", "/v2/embed", "/v1/summarize"):
                app.router.add_post(path, generate)
            app.router.add_route("*", "/{tail:.*}", anything)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def start(self) -> Upstream:
        self._thread.start()
        assert self._ready.wait(10), "upstream did not start"
        return self

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._release.clear)

    def reached(self) -> list[str]:
        """Every path that reached the upstream, governed or not (tokenize calls aside)."""
        return [*self.paths, *(p for _, p in self.other)]

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class _Client:
    """What both enforcers answer to: one HTTP request, or raw bytes on a new connection."""

    port: int

    def request(self, path: str, body: dict | bytes | None = None, method: str = "POST",
                timeout: float = 10, headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def raw(self, data: bytes, *, timeout: float = 10, pause_s: float = 0.0) -> bytes:
        """Send `data` (all at once, or byte by byte `pause_s` apart) and read until closed."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            if pause_s:
                for b in data:
                    sock.sendall(bytes([b]))
                    time.sleep(pause_s)
            else:
                sock.sendall(data)
            out = b""
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return out
                    out += chunk
            except (TimeoutError, ConnectionResetError):
                return out

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


class Nginx(_Client):
    def __init__(self, prefix: Path, conf_text: str, port: int) -> None:
        self.prefix, self.port = prefix, port
        (prefix / "logs").mkdir(parents=True, exist_ok=True)
        self.conf = prefix / "nginx.conf"
        self.conf.write_text(conf_text, encoding="utf-8")
        self.proc: subprocess.Popen | None = None

    def args(self, *extra: str) -> list[str]:
        return [nginx_binary(), "-p", str(self.prefix), "-c", str(self.conf),
                "-e", str(self.prefix / "logs" / "error.log"), *extra]

    def start(self) -> Nginx:
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


class PyGateway(_Client):
    """`kvtune gateway` on its own event loop in a thread, listening where the config says."""

    def __init__(self, config_text: str) -> None:
        import yaml

        from kvtune.gateway.config import parse_gateway_config

        self.config = parse_gateway_config(yaml.safe_load(config_text), path="gateway.yaml")
        self.port = self.config.port
        self.app = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kvtune.gateway.proxy import make_app, serve

        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            self.app = make_app(self.config)
            await serve(self.config, stop=self._stop, on_ready=lambda _: self._ready.set(), app=self.app)

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by start()
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    def start(self) -> PyGateway:
        self._thread.start()
        assert self._ready.wait(15) and self._error is None, self._error
        return self

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "gateway did not stop"


def in_thread(fn, *args):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("result", fn(*args)), daemon=True)
    t.start()
    return t, box
