"""The two enforcers of one policy, for the tests that hold them to one behaviour in front of the
one fake vLLM (tests/support/fake_vllm.py): test_enforcer_parity.py, test_gateway_fuzz.py, test_nginx.py,
test_gateway_proxy.py and test_gateway_load.py.

    Nginx(prefix, conf_text, port)   the rendered nginx.conf on a real nginx with Lua.
    PyGateway(gateway_yaml_text)     `kvtune gateway` on its own event loop in a thread; with
                                     listen port 0 it binds an ephemeral port and reports it.
    start_enforcer(kind, rec, prefix, **render_options)   either one rendered from `rec` and started.
    running(fake, **config)          async: the Python gateway (run by `serve`, as the CLI runs it)
                                     on the test's own loop in front of the fake, both on port 0.
Both threaded enforcers have request(path, body, method, headers) -> (status, headers, body),
ledger() and wait_ledger(reserved); raw(bytes) sends bytes on a fresh socket and returns what
came back.

small_rec(upstream_port) is the recommendation both are rendered from: a budget of 100 blocks of
16 tokens, context 2048, chat cap 64, completions cap 96, a hostile-model chat route capped at
32, a custom path /v1/summarize capped at 48, and a catch-all capped at 128; team_rec(port) the
same with X-Team header routes in front. small_fake() is the
fake vLLM it fronts: one token per word, context 2048, and /v1/summarize an engine path.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from typing import Any

import pytest
from fake_vllm import ENGINE_PATHS, FakeVllm

from kvtune.deploy.render import lua_modules
from kvtune.domain.recommendation import Recommendation
from kvtune.policy.recommendation import read_recommendation

DATA = Path(__file__).parents[1] / "data"
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


def nginx_port() -> int:
    """A loopback port that was free a moment ago, for nginx only: nginx refuses `listen …:0`
    ("invalid port") and has no way to report a port it picked, so this is the one place a port is
    bound, released and handed on. Another process may take it in between: start_enforcer then
    tries a fresh one. Every other server in the suite binds port 0 and reports it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_rec() -> dict:
    """tests/data/recommendation.json as a dict, to edit before `read_recommendation`."""
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


def small_rec(upstream_port: int, *, chat_lengths: tuple[list[int], list[int]] | None = None) -> Recommendation:
    """`chat_lengths` (values, counts): the chat route's measured output lengths, which its
    output_histogram (the statistical policy's law) is binned from."""
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
    if chat_lengths is not None:
        chat["output_lengths"] = {"uncensored": {"values": list(chat_lengths[0]), "counts": list(chat_lengths[1])},
                                  "censored": {"values": [], "counts": []}}
    completions["max_new_tokens"]["value"] = COMPLETIONS_CAP
    rec["routes"] = [hostile, chat, completions, custom]
    return read_recommendation(rec, path="small_rec")


TEAM_HEADER, TEAM_A, TEAM_B = "X-Team", "rag-search", "support-chat"
TEAM_A_CAP, TEAM_B_CAP, TEAM_B_CUSTOM_CAP = 40, 24, 20


def team_rec(upstream_port: int) -> Recommendation:
    """small_rec with routes on the X-Team header in front (as `recommend --route-header X-Team`
    renders them, plus a header and a path together): rag-search capped at 40 on every path,
    support-chat at 24 on chat only and at 20 on the custom /v1/summarize."""
    rec = small_rec(upstream_port).to_dict()
    chat_route = rec["routes"][1]
    team_a, team_b, team_b_custom = (copy.deepcopy(chat_route) for _ in range(3))
    team_a["route"], team_a["match"] = TEAM_A, {"path": None, "model": None, "header": "x-team", "value": TEAM_A}
    team_a["max_new_tokens"]["value"] = TEAM_A_CAP
    team_b["route"] = TEAM_B
    team_b["match"] = {"path": "/v1/chat/completions", "model": None, "header": "x-team", "value": TEAM_B}
    team_b["max_new_tokens"]["value"] = TEAM_B_CAP
    team_b_custom["route"] = TEAM_B + " summarize"
    team_b_custom["match"] = {"path": "/v1/summarize", "model": None, "header": "x-team", "value": TEAM_B}
    team_b_custom["max_new_tokens"]["value"] = TEAM_B_CUSTOM_CAP
    rec["routes"] = [team_a, team_b, team_b_custom, *rec["routes"]]
    return read_recommendation(rec, path="team_rec")


def words(n: int) -> str:
    return " ".join(["w"] * n)


def chat(prompt_words: int, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": words(prompt_words)}], **extra}


def blocks(prompt: int, cap: int, sequences: int = 1) -> int:
    return sequences * -(-(prompt + cap) // BLOCK)


def small_fake() -> FakeVllm:
    """The fake vLLM small_rec fronts: one token per word, context 2048, /v1/summarize served."""
    return FakeVllm(max_model_len=CONTEXT, engine_paths=ENGINE_PATHS | {"/v1/summarize"})


class _Client:
    """What both enforcers answer to: one HTTP request, or raw bytes on a new connection."""

    port: int

    def request(self, path: str, body: dict | bytes | None = None, method: str = "POST",
                timeout: float = 10, headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            try:
                conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            except (BrokenPipeError, ConnectionResetError):
                pass  # an enforcer may answer (a refusal) and close before reading the whole request: read its answer
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

    def wait_drained(self, timeout: float = 10) -> dict:
        """The ledger once nothing is held or in flight, on the totals and on every upstream (or
        the last one read). One snapshot reads its counters one at a time while another nginx
        worker may be releasing, so it can be torn (an upstream's count read before a release,
        the totals after): wait for a snapshot that is whole, not for the first zero."""
        deadline = time.monotonic() + timeout
        while True:
            ledger = self.ledger()
            counts = [ledger["reserved"], ledger["inflight"]]
            counts += [n for u in ledger.get("upstreams") or [] for n in (u["reserved"], u["inflight"])]
            if not any(counts) or time.monotonic() > deadline:
                return ledger
            time.sleep(0.05)


class Nginx(_Client):
    def __init__(self, prefix: Path, conf_text: str, port: int) -> None:
        self.prefix, self.port = prefix, port
        (prefix / "logs").mkdir(parents=True, exist_ok=True)
        self.conf = prefix / "nginx.conf"
        self.conf.write_text(conf_text, encoding="utf-8")
        for name, text in lua_modules().items():  # as recommend --out writes them beside nginx.conf
            (prefix / name).parent.mkdir(parents=True, exist_ok=True)
            (prefix / name).write_text(text, encoding="utf-8")
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
            try:  # /healthz: anyone may read it, whatever admin.ledger says
                status, _, body = self.request("/healthz", method="GET", timeout=2)
                assert status == 200, body
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
        self.port = self.config.port  # 0 until on_ready reports the port bound
        self.app = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kvtune.gateway.proxy import make_app, serve

        asyncio.set_event_loop(self._loop)

        def ready(addresses: str) -> None:
            self.port = int(addresses.split(",")[0].rsplit(":", 1)[1])
            self._ready.set()

        async def main() -> None:
            self._stop = asyncio.Event()
            self.app = make_app(self.config)
            await serve(self.config, stop=self._stop, on_ready=ready, app=self.app)

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


def start_enforcer(kind: str, rec: dict, prefix: Path, **options) -> Nginx | PyGateway:
    """The "python" or "nginx" enforcer rendered from `rec` with RenderOptions(**options), started.
    The Python gateway listens on port 0; nginx on nginx_port(), retried if that port was taken."""
    from kvtune.deploy.render import RenderOptions, render_files

    if kind == "python":
        import yaml

        text = render_files(rec, targets=["gateway.yaml"], options=RenderOptions(listen_port=0, **options))
        doc = yaml.safe_load(text["gateway.yaml"])
        doc.pop("queue", None)  # nginx.conf has no wait queue: the two answer a full budget alike only without it
        return PyGateway(yaml.safe_dump(doc)).start()
    for attempt in range(3):
        port = nginx_port()
        conf = render_files(rec, targets=["nginx.conf"], options=RenderOptions(listen_port=port, **options))
        server = Nginx(prefix, conf["nginx.conf"], port)
        try:
            return server.start()
        except AssertionError as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def config_for(upstream_url: str, **overrides: Any):
    """A gateway config of 100 blocks of 16, context 2048: chat capped at 64, the rest at 32."""
    from kvtune.gateway.config import parse_gateway_config

    doc = {
        "version": 1, "upstream": upstream_url, "block_size": 16, "block_budget": 100,
        "max_model_len": 2048,
        "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": 64},
                   {"name": "default", "max_new_tokens": 32}],
    }
    doc.update(overrides)
    return parse_gateway_config(doc)


@contextlib.asynccontextmanager
async def running(fake: FakeVllm | None = None, *, upstream_host: str = "127.0.0.1", **overrides: Any):
    """The fake and the gateway (run by `serve`, as the CLI runs it) on 127.0.0.1:0 on this loop;
    yields (session, gateway base URL, Gateway, fake). The gateway reaches the fake as upstream_host."""
    import aiohttp

    from kvtune.gateway.proxy import GATEWAY, make_app, serve

    fake = fake or FakeVllm()
    async with fake:
        overrides.setdefault("listen", {"port": 0})
        config = config_for(f"http://{upstream_host}:{fake.port}", **overrides)
        app = make_app(config)
        stop = asyncio.Event()
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        server = asyncio.create_task(serve(config, stop=stop, on_ready=ready.set_result, app=app))
        try:
            base = (await asyncio.wait_for(ready, 10)).split(",")[0]
            async with aiohttp.ClientSession() as session:
                yield session, base, app[GATEWAY], fake
        finally:
            stop.set()
            await asyncio.wait_for(server, 40)


def in_thread(fn, *args):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("result", fn(*args)), daemon=True)
    t.start()
    return t, box
