"""Logs sized for the CPU test bed's capacity file (tests/data/capacity-cpu-0.32-timing.json: 32
blocks of 128 tokens, max_model_len 512, a calibrated step time), for `recommend --objective`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).parents[1] / "data"
CPU_CAPACITY = str(DATA / "capacity-cpu-0.32-timing.json")
MODEL = "llama-3.1-8b"  # the plan's model; the capacity file's measured pool and timing are what count


def objective_log(path: Path, *, rows: int = 600, rate_rps: float = 20.0, seed: int = 0,
                  timestamps: bool = True) -> str:
    """Two routes: chat with heavy-tailed outputs (lognormal, median ~60 tokens) and completions
    with short ones, prompts 16–200 tokens, Poisson arrivals at `rate_rps`."""
    rng = np.random.default_rng(seed)
    t = 1_700_000_000.0
    lines = []
    for i in range(rows):
        chat = i % 3 != 0
        prompt = int(rng.integers(16, 200))
        output = int(min(300, max(1, rng.lognormal(4.1 if chat else 3.0, 0.9 if chat else 0.5))))
        t += float(rng.exponential(1 / rate_rps))
        row = {"route": "/v1/chat/completions" if chat else "/v1/completions", "prompt_tokens": prompt,
               "output_tokens": output, "finish_reason": "stop"}
        if timestamps:
            row["timestamp_s"] = round(t, 3)
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def reasoning_log(path: Path, *, rows: int = 600, rate_rps: float = 20.0, seed: int = 0) -> str:
    """Qwen3-8B's reasoning-length answers on the CPU test bed's context (512 tokens): one chat
    route with long heavy-tailed outputs (lognormal, median ~120 tokens, up to 440), prompts
    16–64 tokens, Poisson arrivals at `rate_rps`; every row names the logged model."""
    rng = np.random.default_rng(seed)
    t = 1_700_000_000.0
    lines = []
    for _ in range(rows):
        prompt = int(rng.integers(16, 64))
        output = int(min(440, max(1, rng.lognormal(4.8, 0.8))))
        t += float(rng.exponential(1 / rate_rps))
        lines.append(json.dumps({"route": "/v1/chat/completions", "model": "Qwen/Qwen3-8B", "prompt_tokens": prompt,
                                 "output_tokens": output, "finish_reason": "stop", "timestamp_s": round(t, 3)}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)
