"""vLLM's host-side costs per step and per streamed token, measured on the CPU vLLM.

Why: aiconfigurator's silicon data times the GPU forward pass only; a step on a GPU host also runs
vLLM's Python around it (the engine core's scheduler.schedule and update_from_output) and the API
server streams every token (output processor, detokenizer, one SSE chunk). That Python is the same
code on the CPU build as on a GPU host, so it is measured here as CPU time per process (robust to
the machine's other load, unlike wall time; /proc's resolution is 10 ms, so bursts are long):

  B streaming /v1/chat/completions at once (8-word prompt, `max_tokens` T = 4 and 64, ignore_eos,
  temperature 0.6, top_p 0.95, top_k 20: Qwen3's generation_config sampling, which `vllm serve`
  applies), on a 1-layer and a 4-layer hidden-64 model; the engine's steps from /metrics
  (vllm:iteration_tokens_total_count) and each process's CPU time (/proc/PID/stat) before and after.
  Fitted (non-negative least squares over every burst): the engine core's CPU s per step and per
  running sequence per step; the API server's per request, per SSE chunk and per token; this
  client's per request and per chunk. kvtune.sim.host and kvtune.sim.frontend say which figures
  they use and why.

    flock /tmp/kvtune-vllm.lock python benchmarks/host_overheads.py [--batches 16,128,512] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from scipy.optimize import nnls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from vllm_server import start_vllm, stop_vllm, synth_prompt, write_tiny_model

_STEPS = re.compile(r"^vllm:iteration_tokens_total_count\{[^}]*\} ([\d.e+]+)", re.MULTILINE)
_HZ = 100  # clock ticks per second of /proc/PID/stat (os.sysconf("SC_CLK_TCK") on Linux)


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def _processes(root: int) -> dict[str, int]:
    """The server's processes by role: api (the root), engine (VLLM::EngineCore), worker (VLLM::Worker…)."""
    roles = {"api": root}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        pgid = int(stat.rsplit(")", 1)[1].split()[2])
        if pgid != root and ppid != root:
            continue
        if "EngineCore" in cmd:
            roles["engine"] = int(proc.name)
        elif "Worker" in cmd:
            roles["worker"] = int(proc.name)
    return roles


def _steps(metrics: str) -> float:
    return sum(float(m) for m in _STEPS.findall(metrics))


async def _burst(url: str, batch: int, tokens: int) -> tuple[float, int, float]:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": synth_prompt(8)}], "max_tokens": tokens,
               "ignore_eos": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "stream": True}
    chunks = 0
    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=0)

    async def one(session: aiohttp.ClientSession) -> int:
        n = 0
        async with session.post(f"{url}/v1/chat/completions", json=payload) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    n += 1
        return n

    t0, p0 = time.perf_counter(), time.process_time()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        counts = await asyncio.gather(*(one(session) for _ in range(batch)))
    chunks = sum(counts)
    return time.perf_counter() - t0, chunks, time.process_time() - p0


def measure(layers: int, batches: list[int], short: int, long: int, repeats: int, work: Path) -> list[dict[str, float]]:
    model = write_tiny_model(work / f"tiny-{layers}", num_layers=layers)
    blocks = max(batches) + 64  # one 128-token block per request (8 + T < 128)
    kv_bytes = blocks * 128 * layers * 2 * 32 * 2 * 2
    server = start_vllm(model, max_model_len=256, kv_cache_memory_bytes=kv_bytes,
                        extra_args=["--max-num-seqs", str(max(batches)), "--max-num-batched-tokens", "8192"])
    rows = []
    try:
        roles = _processes(server.pid)
        asyncio.run(_burst(server.url, 4, 4))  # warm up
        for batch in batches:
            for _, tokens in ((r, t) for r in range(repeats) for t in (short, long)):
                s0 = _steps(server.metrics_text())
                c0 = {role: process_cpu_s(pid) for role, pid in roles.items()}
                wall, chunks, client_cpu = asyncio.run(_burst(server.url, batch, tokens))
                c1 = {role: process_cpu_s(pid) for role, pid in roles.items()}
                steps = _steps(server.metrics_text()) - s0
                cpu = {role: c1[role] - c0[role] for role in roles}
                rows.append({"layers": layers, "batch": batch, "tokens": tokens, "steps": steps, "chunks": chunks,
                             "wall_s": wall, "client_cpu_s": client_cpu,
                             **{f"{role}_cpu_s": v for role, v in cpu.items()}})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        stop_vllm(server)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="16,128,512")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", default="1,4")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (int(x) for x in args.layers.split(",")):
            rows += measure(layers, batches, 4, args.tokens, args.repeats, Path(tmp))
    # The engine core: CPU s = step_s·steps + sequence_s·steps·B. The worker is left out: on CPU its
    # time is the forward pass and OpenMP threads spinning (a 4-layer model can cost less than a
    # 1-layer one), so its host part cannot be read from it.
    a = np.array([[r["steps"], r["steps"] * r["batch"]] for r in rows])
    per_step, per_seq = nnls(a, np.array([r["engine_cpu_s"] for r in rows]))[0]
    print(f"engine core: {per_step * 1e3:.2f} ms per step + {per_seq * 1e6:.1f} µs per running sequence "
          "(the per-step part includes busy-polling for the worker's result)")
    # The API server: CPU s = a·requests + b·chunks + c·tokens (a lagging stream gets tokens merged)
    a = np.array([[r["batch"], r["chunks"], r["batch"] * r["tokens"]] for r in rows])
    per_request, per_chunk, per_token = nnls(a, np.array([r["api_cpu_s"] for r in rows]))[0]
    print(f"API server: {per_request * 1e3:.2f} ms per request + {per_chunk * 1e6:.1f} µs per SSE chunk + "
          f"{per_token * 1e6:.1f} µs per token")
    a = np.array([[r["batch"], r["chunks"]] for r in rows])
    client_request, client_chunk = nnls(a, np.array([r["client_cpu_s"] for r in rows]))[0]
    print(f"client (aiohttp, reading lines): {client_request * 1e3:.2f} ms per request + "
          f"{client_chunk * 1e6:.1f} µs per chunk")
    if args.json:
        print(json.dumps({"rows": rows, "engine_per_step_s": per_step, "engine_per_sequence_s": per_seq,
                          "api_per_request_s": per_request, "api_per_chunk_s": per_chunk,
                          "api_per_token_s": per_token}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
