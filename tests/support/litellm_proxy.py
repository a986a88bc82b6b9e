"""A real LiteLLM proxy process on 127.0.0.1 (port 0, read back from uvicorn's line) with kvtune's
hook (kvtune.integrations.litellm) enforcing a gateway.yaml, in front of an engine URL.

    with LitellmProxy(tmp, gateway_doc, engine_url) as proxy:
        proxy.url                      the proxy's base URL (a master key: proxy.headers)
        proxy.admin                    the hook's /metrics and /kvtune/ledger (gateway.yaml's listen)
        proxy.request(path, body)      -> (status, headers, body)
        proxy.ledger()                 the hook's /kvtune/ledger JSON

Offline: LITELLM_LOCAL_MODEL_COST_MAP (no model-cost-map download at start), --telemetry False,
no database. Starting one costs ~20-40 s of CPU on a loaded 2-core host, so a module starts one.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

MASTER_KEY = "sk-kvtune-test-0123456789abcdef0123456789abcdef"
START_S = 120.0


def litellm_config(engine_url: str, model: str, **litellm_params: Any) -> dict:
    """LiteLLM's config.yaml: `model` served by the engine (hosted_vllm), kvtune's hook."""
    return {
        "model_list": [{"model_name": model, "litellm_params": {"model": f"hosted_vllm/{model}",
                                                                 "api_base": f"{engine_url}/v1", **litellm_params}}],
        "litellm_settings": {"callbacks": "kvtune.integrations.litellm.proxy_handler"},
    }


class LitellmProxy:
    def __init__(self, workdir: Path, gateway_doc: dict, engine_url: str, *, model: str = "m",
                 config: dict | None = None, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        gateway_doc = {**gateway_doc, "listen": {"host": "127.0.0.1", "port": 0}}
        (workdir / "gateway.yaml").write_text(yaml.safe_dump(gateway_doc), encoding="utf-8")
        (workdir / "config.yaml").write_text(yaml.safe_dump(config or litellm_config(engine_url, model)),
                                             encoding="utf-8")
        self.env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": MASTER_KEY,
                    "KVTUNE_GATEWAY_CONFIG": str(workdir / "gateway.yaml"), "PYTHONUNBUFFERED": "1",
                    "HF_HUB_OFFLINE": "1", **(env or {})}
        self.headers = {"Authorization": f"Bearer {MASTER_KEY}", "Content-Type": "application/json"}
        self.proc: subprocess.Popen | None = None
        self.port = self.admin_port = 0
        self.log_path = workdir / "proxy.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> LitellmProxy:
        return self.launch().wait_ready()

    def launch(self) -> LitellmProxy:
        """Start the process without waiting (several proxies start side by side: wait_ready each)."""
        with self.log_path.open("wb") as log:  # the child holds its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "litellm.proxy.proxy_cli", "--config", str(self.workdir / "config.yaml"),
                 "--host", "127.0.0.1", "--port", "0", "--telemetry", "False", "--num_workers", "1"],
                cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> LitellmProxy:
        """Until uvicorn and the hook's admin endpoints both say where they listen."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
            served = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", text)
            admin = re.search(r"gateway\.yaml's ledger and metrics on http://127\.0\.0\.1:(\d+)", text)
            if served and admin:
                self.port, self.admin_port = int(served.group(1)), int(admin.group(1))
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the LiteLLM proxy exited ({self.proc.returncode}):\n{text[-4000:]}")
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"the LiteLLM proxy did not start in {START_S:g} s:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> LitellmProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request(self, path: str, body: Any, headers: dict[str, str] | None = None,
                timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", path, payload, {**self.headers, **(headers or {})})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def ledger(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=10)
        try:
            conn.request("GET", "/kvtune/ledger")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def metrics(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def wait_drained(self, timeout_s: float = 10.0) -> dict:
        """The ledger once nothing is reserved or in flight (or as it is at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            ledger = self.ledger()
            if (ledger["reserved"] == 0 and ledger["inflight"] == 0) or time.monotonic() > deadline:
                return ledger
            time.sleep(0.05)
