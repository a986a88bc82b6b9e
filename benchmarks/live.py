"""What the live benchmarks share: reading a Prometheus counter, starting and stopping `kvtune gateway`."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from vllm_server import free_port


def metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(m.group(1))
    return total


def start_gateway(config: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    path = workdir / f"{name}.yaml"
    port = free_port()
    config = {**config, "listen": {"host": "127.0.0.1", "port": port}}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "kvtune", "gateway", "--config", str(path)],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    if "listening" not in line:
        proc.kill()
        raise RuntimeError(f"gateway did not start: {line}{proc.stderr.read()}")
    return proc, f"http://127.0.0.1:{port}"


def stop_gateway(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    return proc.stderr.read()
