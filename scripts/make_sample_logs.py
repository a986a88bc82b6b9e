"""Write sample_logs/: small, realistic request logs for the README commands (seeded, repeatable).

Lengths are drawn from lognormal fits (mean and standard deviation of ln tokens, every row) of the
real traces in ../shared/traces:
    chat route      output ln N(5.019, 0.859), prompt ln N(6.633, 0.985)  Azure 2023 conversation
    code route      output ln N(2.788, 0.847), prompt ln N(6.999, 1.360)  Azure 2023 code
    summarize route output ln N(5.187, 0.796), prompt ln N(7.717, 0.755)  vidur arXiv summarization
Every row names one model, meta-llama/Llama-3.1-8B-Instruct (one deployment's traffic).
Prompt and output are drawn independently (their log correlation is 0.09 in conv, 0.00 in code).
A response whose drawn length reaches its request's max_tokens is cut there, with finish reason
`length` (`stop` otherwise), so the logs carry real right-censoring. Arrivals are Poisson with a
burst; latency = 30 ms/output token + 0.2 ms/prompt token + noise, TTFT from the prompt share.

Files (field names from reference/gateways-and-log-schemas.md):
    openai_chat_pairs.jsonl   request+response pairs (§2.1: url, request.max_tokens, response
                              object chat.completion, usage.prompt_tokens/completion_tokens,
                              choices[].finish_reason, created), three routes
    litellm_spend_logs.csv    LiteLLM SpendLogs rows (§2.5: request_id, spend, startTime, endTime,
                              completionStartTime, model_group, prompt_tokens, completion_tokens,
                              metadata.user_api_key_request_route, proxy_server_request, response)
    azure_style_trace.csv     Azure trace columns (§2.11: TIMESTAMP, ContextTokens,
                              GeneratedTokens), no finish reasons, outputs capped at 1000

    python scripts/make_sample_logs.py [--out sample_logs]
"""

from __future__ import annotations

import argparse
import csv
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

SEED = 20231116
START_S = 1_735_000_000  # 2024-12-24, a fixed epoch second

#: The one model every route's rows name, by its hub id as vLLM serves it by default: the logs are
#: one deployment's traffic (logs naming several models need `--log-model`).
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
# route -> (model, output ln-mean, ln-sd, prompt ln-mean, ln-sd, max_tokens choices and weights)
ROUTES = {
    "/v1/chat/completions": (MODEL, 5.019, 0.859, 6.633, 0.985,
                             ((None, 512, 1024, 4096), (0.3, 0.3, 0.3, 0.1))),
    "/v1/code/completions": (MODEL, 2.788, 0.847, 6.999, 1.360, ((None, 256, 2048), (0.2, 0.5, 0.3))),
    "/v1/summarize": (MODEL, 5.187, 0.796, 7.717, 0.755, ((512, 1024), (0.5, 0.5))),
}
CONTEXT = 32768


def _lengths(rng, mu, sigma, n, low=1, high=CONTEXT):
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), low, high).astype(int)


def _arrivals(rng, n, rate_rps=2.0):
    """Poisson arrivals with a 2-minute burst at 5× the rate in the middle."""
    gaps = rng.exponential(1 / rate_rps, n)
    middle = slice(n // 2, n // 2 + int(120 * rate_rps * 5))
    gaps[middle] /= 5
    return START_S + np.cumsum(gaps)


def _requests(rng, n, route_weights):
    """n requests: route, model, prompt, output, max_tokens, finish_reason, times."""
    names = list(ROUTES)
    route_idx = rng.choice(len(names), n, p=route_weights)
    ts = _arrivals(rng, n)
    out = []
    for i in range(n):
        route = names[route_idx[i]]
        model, omu, osd, pmu, psd, (caps, weights) = ROUTES[route]
        prompt = int(_lengths(rng, pmu, psd, 1)[0])
        wanted = int(_lengths(rng, omu, osd, 1)[0])
        max_tokens = caps[rng.choice(len(caps), p=weights)]
        limit = max_tokens if max_tokens is not None else CONTEXT - prompt
        output = min(wanted, limit)
        finish = "length" if wanted >= limit else "stop"
        latency_ms = 30 * output + 0.2 * prompt + rng.gamma(2, 40)
        ttft_ms = 0.2 * prompt + rng.gamma(2, 20)
        out.append((route, model, prompt, output, max_tokens, finish, float(ts[i]), latency_ms, ttft_ms))
    return out


def write_openai_pairs(path: Path, rng) -> None:
    with path.open("w", encoding="utf-8") as f:
        for i, (route, model, prompt, output, max_tokens, finish, ts, lat, ttft) in enumerate(
            _requests(rng, 2400, (0.55, 0.3, 0.15))
        ):
            request = {"model": model, "messages": [{"role": "user", "content": "[redacted]"}]}
            if max_tokens is not None:
                request["max_tokens"] = max_tokens
            response = {
                "id": f"chatcmpl-{i:06d}",
                "object": "chat.completion",
                "created": int(ts),
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "[redacted]"},
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
            }
            record = {"timestamp": round(ts, 3), "url": route, "latency_ms": round(lat, 1),
                      "ttft_ms": round(ttft, 1), "request": request, "response": response}
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")


def write_litellm_spend(path: Path, rng) -> None:
    columns = ["request_id", "call_type", "api_key", "spend", "total_tokens", "prompt_tokens",
               "completion_tokens", "startTime", "endTime", "completionStartTime", "model",
               "model_group", "custom_llm_provider", "api_base", "user", "metadata", "cache_hit",
               "request_tags", "proxy_server_request", "response", "status"]
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for i, (route, model, prompt, output, max_tokens, finish, ts, lat, ttft) in enumerate(
            _requests(rng, 1200, (0.4, 0.5, 0.1))
        ):
            body = {"model": model, "messages": [{"role": "user", "content": "[redacted]"}]}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            response = {"object": "chat.completion", "model": model,
                        "choices": [{"index": 0, "finish_reason": finish,
                                     "message": {"role": "assistant", "content": "[redacted]"}}],
                        "usage": {"prompt_tokens": prompt, "completion_tokens": output}}
            start = datetime.fromtimestamp(ts, tz=UTC)
            writer.writerow([
                f"req-{i:06d}", "acompletion", "88dc28d0f030c55ed4ab77ed8faf098196cb1c05df778539800c9f1243fe6b4b",
                round((prompt * 0.05 + output * 0.2) / 1e6, 8), prompt + output, prompt, output,
                _iso(ts), (start + timedelta(milliseconds=lat)).isoformat(timespec="milliseconds"),
                (start + timedelta(milliseconds=ttft)).isoformat(timespec="milliseconds"),
                f"hosted_vllm/{model}", model, "hosted_vllm", "http://vllm:8000/v1", "",
                json.dumps({"user_api_key_request_route": route, "user_api_key_alias": "team-a"}),
                "False", "[]", json.dumps({"url": route, "body": body}), json.dumps(response), "success",
            ])


def write_azure_style(path: Path, rng) -> None:
    """Azure conv-like trace with outputs capped at 1000 (as in the real one: 11 rows at 1000)."""
    n = 2000
    ts = START_S + np.cumsum(rng.exponential(0.5, n))
    prompt = _lengths(rng, 6.633, 0.985, n)
    output = np.minimum(_lengths(rng, 5.019, 0.859, n), 1000)
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for t, p, o in zip(ts, prompt, output, strict=True):
            stamp = datetime.fromtimestamp(float(t), tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
            writer.writerow([stamp, int(p), int(o)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "sample_logs"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one generator per file, so editing one writer leaves the other files unchanged
    write_openai_pairs(out / "openai_chat_pairs.jsonl", np.random.default_rng([SEED, 1]))
    write_litellm_spend(out / "litellm_spend_logs.csv", np.random.default_rng([SEED, 2]))
    write_azure_style(out / "azure_style_trace.csv", np.random.default_rng([SEED, 3]))
    for p in sorted(out.iterdir()):
        print(f"{p} {p.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
