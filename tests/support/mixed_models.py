"""A seeded LiteLLM SpendLogs JSONL (`litellm-spend`) of one proxy serving two models, as the
issue's trial had: Llama chat traffic on /v1/chat/completions and Qwen on /v1/completions, the
model in `model_group` (LiteLLM's public name, which the proxy's clients send), plus a few rows
whose model LiteLLM did not record. Lengths are lognormal, as sample_logs' are.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen3-8B"
START_S = 1_735_000_000  # 2024-12-24

# model -> (route, rows, output ln-mean, ln-sd, prompt ln-mean, ln-sd)
TRAFFIC = {
    LLAMA: ("/v1/chat/completions", 300, 5.0, 0.8, 6.6, 1.0),
    QWEN: ("/v1/completions", 200, 6.5, 0.9, 6.0, 0.9),
}
UNNAMED_ROWS = 7  # on the chat route, model_group and model both empty


def rows(seed: int = 25, models: dict[str, str] | None = None) -> list[dict]:
    """The log's records in time order; `models` renames the logged ids (LLAMA → another id)."""
    rng = np.random.default_rng(seed)
    drawn = []
    for model, (route, n, omu, osd, pmu, psd) in TRAFFIC.items():
        outputs = np.clip(np.round(rng.lognormal(omu, osd, n)), 1, 8000).astype(int)
        prompts = np.clip(np.round(rng.lognormal(pmu, psd, n)), 1, 30000).astype(int)
        named = [(models or {}).get(model, model)] * n
        drawn += list(zip([route] * n, named, prompts.tolist(), outputs.tolist(), strict=True))
    drawn += [("/v1/chat/completions", None, 500, 100)] * UNNAMED_ROWS
    order = rng.permutation(len(drawn))
    records = []
    for i, k in enumerate(order.tolist()):
        route, model, prompt, output = drawn[k]
        t = START_S + 0.25 * i
        records.append({
            "request_id": f"req-{i:06d}", "call_type": "acompletion", "spend": 1e-5,
            "startTime": _iso(t), "endTime": _iso(t + 2.0), "completionStartTime": _iso(t + 0.2),
            "model": f"hosted_vllm/{model}" if model else "", "model_group": model or "",
            "prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
            "metadata": {"user_api_key_request_route": route}, "status": "success",
        })
    return records


def _iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="milliseconds")


def write(path: Path, records: list[dict] | None = None) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows() if records is None else records)))
    return path


def write_parts(directory: Path, parts: int = 3) -> list[Path]:
    """The same records cut into `parts` files (for --workers and --ray)."""
    records = rows()
    directory.mkdir(parents=True, exist_ok=True)
    return [write(directory / f"part-{i}.jsonl", records[i::parts]) for i in range(parts)]
