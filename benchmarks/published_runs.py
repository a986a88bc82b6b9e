"""`kvtune simulate` against 17 published vLLM runs on real GPUs: predicted ÷ published, run by run.

The runs, their setups and printed results are in ../shared/validation/published-vllm-runs.csv
(its README says where each comes from). Each is replayed offline, with no GPU and no server:

- workload: ShareGPT runs draw lengths from `mk_sharegpt.py` (lognormal, filtered as vLLM's
  ShareGPT sampler filters, matched to the published input/output totals; the dataset itself is not
  here); `random` runs use the published per-request means (input total ÷ prompts, output total ÷
  prompts: a few outputs stopped early); the vLLM blog's ±15 % runs draw uniformly in ±15 %; the
  LLMServingSim runs replay their own trace (`llmss_4090_replay.jsonl`, arrival times included).
- load: `--concurrency C --requests N` for closed loops (`--max-concurrency`), every request at
  t = 0 (`--replay` of a log whose timestamps are all 0) for `request_rate inf` without a
  concurrency, `--replay` of the trace for LLMServingSim.
- capacity: no capacity file: `simulate --model M --gpu G` runs on kvtune's own pool estimate
  (with the run's --kv-cache-dtype, --max-model-len and --gpu-memory-utilization where the source
  gives them), or `--num-gpu-blocks N` where the source printed the pool (LLMServingSim's RTX 4090:
  2,588 blocks × 16).
- release: `--engine-version` the run's vLLM (its defaults, e.g. gpu_memory_utilization 0.9 before
  0.20, whether its scheduler overlaps the forward pass: kvtune.sim.host, and whether it admits a
  request on its whole prompt or, before 0.19, on its first chunk: kvtune.engines.vllm).
- step time: whatever `simulate` picks with --model and --gpu and no calibration: aiconfigurator's
  silicon data where it covers the GPU (H100, A100, RTX PRO 6000 …), else the roofline (RTX 4090),
  as each row's `source` column says.

Printed per run: predicted ÷ published for output tok/s (total tok/s for the GSREF rows, which
publish only that), mean TTFT, mean TPOT (medians where only medians are published: the vLLM blog),
and the medians of |ratio − 1| over the runs, against the issue's targets (≤ 15 % for tok/s and
TPOT, ≤ 25 % for TTFT, none off by more than 2×), plus each simulate's wall time (target ≤ 3 s).

    python benchmarks/published_runs.py                  # the table
    python benchmarks/published_runs.py --json           # one JSON object
    python benchmarks/published_runs.py --cases GS-Q8    # runs whose id starts with it
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VALIDATION = Path(os.environ.get("KVTUNE_VALIDATION_DIR", REPO.parent / "shared" / "validation"))
if not VALIDATION.is_dir():
    VALIDATION = Path("/work/shared/validation")

MODELS = {  # the CSV's model -> what kvtune simulate --model takes (presets, or the validation configs)
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-14B": str(VALIDATION / "configs" / "Qwen3-14B.json"),
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B (exact HF id not stated)": "llama-3.1-8b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
}
GPUS = {"H100": "H100-80GB", "A100": "A100-80GB", "RTX 4090": "RTX-4090", "RTX PRO 6000": "RTX-PRO-6000"}
TARGETS = {"tok/s": 0.15, "ttft": 0.25, "tpot": 0.15}


@dataclass
class Case:
    row: dict[str, str]

    @property
    def id(self) -> str:
        return self.row["case_id"]

    @property
    def model(self) -> str:
        return MODELS[self.row["model"]]

    @property
    def gpu(self) -> str:
        for key, name in GPUS.items():
            if self.row["gpu"].startswith(key):
                return name
        raise KeyError(self.row["gpu"])

    @property
    def vllm_version(self) -> str | None:
        """The release the run served with (its defaults and scheduling are that release's)."""
        m = re.match(r"\d+(?:\.\d+)+", self.row["vllm_version"].strip())
        return m.group(0) if m else None

    @property
    def kv_fp8(self) -> bool:
        return self.row["kv_cache_dtype"].startswith("fp8")

    def number(self, field: str) -> float | None:
        value = self.row.get(field, "").strip()
        try:
            return float(value)
        except ValueError:
            return None


def _derived(notes: str, what: str) -> float | None:
    """A figure the CSV's notes give as DERIVED from the source's per-request data."""
    m = re.search(r"([\d,.]+) " + re.escape(what), notes)
    return float(m.group(1).replace(",", "")) if m else None


def published(case: Case) -> dict[str, tuple[str, float] | None]:
    """(what, value) per metric: output tok/s (else total), mean TTFT/TPOT (else medians)."""
    out: dict[str, tuple[str, float] | None] = {}
    tput = case.number("output_token_throughput")
    if tput is not None:
        out["tok/s"] = ("output tok/s", tput)
    elif (derived := _derived(case.row["notes"], "output tok/s")) is not None:
        out["tok/s"] = ("output tok/s (derived)", derived)
    elif (total := case.number("total_token_throughput")) is not None:
        out["tok/s"] = ("total tok/s", total)
    else:
        out["tok/s"] = None
    for metric, fields in (("ttft", ("ttft_mean_ms", "ttft_median_ms")), ("tpot", ("tpot_mean_ms", "itl_median_ms"))):
        out[metric] = None
        for field in fields:
            if (value := case.number(field)) is not None:
                out[metric] = (field, value)
                break
    return out


def _sharegpt(mean_in: float, mean_out: float, seed: int = 1) -> np.ndarray:
    sys.path.insert(0, str(VALIDATION))
    try:
        import mk_sharegpt  # the validation directory's own generator
    finally:
        sys.path.pop(0)
    return mk_sharegpt.fit(mean_in, mean_out, seed=seed)


SHAREGPT_MEANS = (217.393, 201.648)  # GS-Q14 sharegpt's published totals ÷ 1000: the GSREF rows' workload


def workload(case: Case, work: Path) -> tuple[Path, list[str]]:
    """The log to simulate and the load options."""
    r = case.row
    n = int(float(r["num_prompts"]))
    rows: list[dict[str, object]] = []
    concurrency = r["max_concurrency"].strip()
    load: list[str]
    if case.id.startswith("LSS-"):
        return VALIDATION / "llmss_4090_replay.jsonl", ["--replay"]
    dataset = r["dataset"]
    if dataset == "sharegpt":
        totals = (case.number("total_input_tokens"), case.number("total_output_tokens"))
        means = (totals[0] / n, totals[1] / n) if totals[0] and totals[1] else SHAREGPT_MEANS
        lengths = _sharegpt(*means)
        if concurrency:  # closed loop: simulate draws from the whole distribution
            lengths_used = lengths
        else:
            lengths_used = lengths[:n]
        rows = [{"prompt_tokens": int(p), "output_tokens": int(o)} for p, o in lengths_used]
    elif dataset == "random":
        mean_in = (case.number("total_input_tokens") or 0) / n
        mean_out = (case.number("total_output_tokens") or 0) / n
        rows = [{"prompt_tokens": round(mean_in), "output_tokens": max(1, round(mean_out))}] * n
    else:  # the vLLM blog: ~20,000 in / ~2,000 out, ±15 %
        rng = np.random.default_rng(0)
        rows = [{"prompt_tokens": int(20000 * rng.uniform(0.85, 1.15)),
                 "output_tokens": int(2000 * rng.uniform(0.85, 1.15))} for _ in range(n)]
    path = work / f"{case.id}.jsonl"
    with path.open("w") as f:
        for row in rows:
            record = {"route": "/v1/chat/completions", **row, "finish_reason": "stop"}
            if not concurrency:
                record["timestamp_s"] = 0.0
            f.write(json.dumps(record) + "\n")
    if concurrency:
        load = ["--concurrency", concurrency, "--requests", str(n)]
    else:
        load = ["--replay"]
    return path, load


def capacity_options(case: Case) -> tuple[list[str], str]:
    """simulate's pool options: the published pool where the source printed one, else kvtune's
    estimate for the run's settings."""
    r = case.row
    mml_field = r["max_model_len"].strip()
    options = ["--max-model-len", mml_field] if mml_field.isdigit() else []
    if case.kv_fp8:
        options += ["--kv-cache-dtype", "fp8"]
    if (m := re.match(r"(\d+) blocks x (\d+)", r["kv_cache_size"])) is not None:
        return options + ["--num-gpu-blocks", m.group(1)], f"published ({m.group(1)} × {m.group(2)})"
    if (util := case.number("gpu_memory_utilization")) is not None:
        options += ["--gpu-memory-utilization", str(util)]
    return options, "kvtune estimate"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def simulate(case: Case, work: Path) -> dict[str, object]:
    log, load = workload(case, work)
    pool, cap_source = capacity_options(case)
    cmd = [sys.executable, "-m", "kvtune", "simulate", str(log), "--model", case.model, "--gpu", case.gpu, *pool,
           "--json", *load]
    for field, option in (("max_num_seqs", "--max-num-seqs"), ("max_num_batched_tokens", "--max-num-batched-tokens")):
        if r := case.row[field].strip():
            cmd += [option, r]
    if version := case.vllm_version:
        cmd += ["--engine-version", version]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall, "capacity": cap_source}
    data = json.loads(out.stdout)
    lat, tput = data["latency_ms"], data["throughput"]
    duration = data["duration_s"] or math.nan
    total = (data["prompt_tokens_requested_total"] + data["output_tokens_total"]) / duration
    timing = data["simulation"]["timing"]
    blocks = data["simulation"]["engine"]["num_blocks"]["value"]
    if cap_source == "kvtune estimate":
        cap_source = f"kvtune estimate ({blocks} blocks)"
    return {"tok/s": tput["output_tokens_per_s"], "total tok/s": total,
            "ttft_mean_ms": lat["ttft"]["mean"], "ttft_median_ms": lat["ttft"]["p50"],
            "tpot_mean_ms": lat["tpot"]["mean"], "itl_median_ms": lat["tpot"]["p50"],
            "source": timing["source"], "label": timing.get("label", timing["source"]),
            "preemptions": data["server"]["preemptions"],
            "admission": "whole prompt" if data["simulation"]["engine"]["reserve_full_sequence"]["value"]
            else "first chunk",
            "wall_s": wall, "capacity": cap_source}


def ratios(case: Case, predicted: dict[str, object]) -> dict[str, float | None]:
    pub = published(case)
    out: dict[str, float | None] = {}
    for metric, p in pub.items():
        if p is None or "error" in predicted:
            out[metric] = None
            continue
        what, value = p
        if metric == "tok/s":
            key = "total tok/s" if what.startswith("total") else "tok/s"
        else:
            key = what
        guess = predicted.get(key)
        out[metric] = float(guess) / value if isinstance(guess, (int, float)) and value else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="only runs whose case_id starts with one of these (comma-separated)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with (VALIDATION / "published-vllm-runs.csv").open() as f:
        cases = [Case(row) for row in csv.DictReader(f)]
    prefixes = [p for p in args.cases.split(",") if p]
    if prefixes:
        cases = [c for c in cases if any(c.id.startswith(p) for p in prefixes)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            predicted = simulate(case, Path(tmp))
            print(f"{case.id}: {predicted}", file=sys.stderr)
            results.append({"case": case.id, "predicted": predicted, "published": published(case),
                            "ratio": ratios(case, predicted)})
    summary: dict[str, object] = {}
    for metric, target in TARGETS.items():
        values = [r["ratio"][metric] for r in results if r["ratio"].get(metric)]
        errors = [abs(v - 1) for v in values]
        summary[metric] = {"runs": len(values), "median_abs_error": statistics.median(errors) if errors else None,
                           "target": target, "off_by_more_than_2x": sum(1 for v in values if v > 2 or v < 0.5)}
    walls = [r["predicted"]["wall_s"] for r in results]
    summary["wall_s_max"] = max(walls) if walls else None
    if args.json:
        print(json.dumps({"runs": results, "summary": summary}, indent=2))
        return 0
    print(f"{'case':34} {'tok/s':>7} {'TTFT':>7} {'TPOT':>7} {'wall':>6}  step time; capacity; admission, "
          "preemptions")
    for r in results:
        p = r["predicted"]
        if "error" in p:
            print(f"{r['case']:34} error: {p['error']}")
            continue
        cells = " ".join(f"{r['ratio'][m]:7.2f}" if r["ratio"].get(m) else f"{'—':>7}" for m in TARGETS)
        print(f"{r['case']:34} {cells} {p['wall_s']:5.1f}s  {p['source']}; {p['capacity']}; {p['admission']}, "
              f"{p['preemptions']:,}")
    for metric in TARGETS:
        s = summary[metric]
        assert isinstance(s, dict)
        med = s["median_abs_error"]
        print(f"median |ratio − 1| {metric}: {'—' if med is None else f'{med:.1%}'} over {s['runs']} runs "
              f"(target ≤ {s['target']:.0%}); off by > 2×: {s['off_by_more_than_2x']}")
    print(f"slowest simulate: {summary['wall_s_max']:.1f} s wall (target ≤ 3 s; the machine's cores are shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
