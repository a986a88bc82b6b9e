"""A real redis-server (Debian's package) on loopback, for the shared ledger's tests: no mocks.

Interface (`from redis_server import ...`, or the conftest fixtures `redis_server`, `make_redis`):

    start_redis(directory, *, port=None, appendonly=False) -> RedisServer
        redis-server on 127.0.0.1 and a free ephemeral port (Redis reads --port 0 as "no TCP", so
        the port is bound, released and passed on), its files in `directory`, waits until it
        answers PING with PONG (not LOADING). No persistence unless appendonly=True (AOF,
        appendfsync always: every write is on disk before the reply). pytest.fail (never skip)
        with "run scripts/install-test-deps.sh" when redis-server is missing.

    RedisServer(port, directory, appendonly, process)
        url ("redis://127.0.0.1:PORT/0"); stop() SIGTERM -> wait -> SIGKILL (Redis saves the AOF
        on SIGTERM), idempotent; kill() SIGKILL, nothing saved; start() again on the same port and
        directory (restart = stop() + start()); ping() -> bool.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from vllm_server import free_port

STARTUP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    path = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    if path is None:
        pytest.fail("redis-server is required for the shared ledger's tests; run scripts/install-test-deps.sh "
                    "(apt-get install -y redis-server)", pytrace=False)
    return path


@dataclass
class RedisServer:
    port: int
    directory: Path
    appendonly: bool = False
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--save", "", *persistence, "--daemonize", "no", "--logfile", str(self.log_path),
                "--protected-mode", "yes"]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.ping():
            if self.process.poll() is not None:
                pytest.fail(f"redis-server exited with {self.process.returncode}:\n{self._tail()}", pytrace=False)
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"redis-server did not answer PING within {STARTUP_TIMEOUT_S} s:\n{self._tail()}",
                            pytrace=False)
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM (Redis writes its AOF and exits), wait, then SIGKILL. Idempotent."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)
        self.process = None

    def kill(self) -> None:
        """SIGKILL: nothing saved beyond what is already on disk."""
        process = self.process
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def start_redis(directory: Path, *, port: int | None = None, appendonly: bool = False) -> RedisServer:
    directory.mkdir(parents=True, exist_ok=True)
    server = RedisServer(port or free_port(), directory, appendonly)
    server.start()
    return server


__all__ = ["RedisServer", "start_redis", "redis_server_binary"]
