"""`kvtune simulate` against published vLLM runs on real GPUs: predicted ÷ published, run by run.

The runs, their setups and printed results are in ../shared/validation/published-vllm-runs.csv
(its README says where each comes from; $KVTUNE_VALIDATION_DIR names another directory holding a
CSV of the same columns and mk_sharegpt.py). Each is replayed offline, with no GPU and no server:

- workload: ShareGPT runs draw lengths from `mk_sharegpt.py` (lognormal, filtered as vLLM's
  ShareGPT sampler filters, matched to the published input/output totals; the dataset itself is not
  here); `random` runs use the published per-request means (input total ÷ prompts, output total ÷
  prompts: a few outputs stopped early), else the nominal lengths, drawn uniformly within a printed
  spread (±15 %, `--random-range-ratio`); the LLMServingSim runs replay their own trace
  (`llmss_4090_replay.jsonl`, arrival times included).
- load: `--concurrency C --requests N` for closed loops (`--max-concurrency`), `--rate R` (Poisson,
  or gamma with a printed burstiness) for a numeric `request_rate`, every request at t = 0
  (`--replay` of a log whose timestamps are all 0) for `request_rate inf` without a concurrency.
- setup: the catalog GPU the free-text `gpu` names (its stated memory picks the 40 or 80 GB part),
  `--tp`, the model's config (the checkpoint's own where aiconfigurator-core ships a copy, else
  kvtune's preset of its base name, else `configs/`; a quantized checkpoint's format from its name
  or `dtype_quant` where the config says none), the printed batch limits. A row this cannot read
  (a GPU or model with no data here) prints as an error naming why.
- capacity: no capacity file: `simulate --model M --gpu G` runs on kvtune's own pool estimate
  (with the run's --kv-cache-dtype, --max-model-len and --gpu-memory-utilization where the source
  gives them), or `--num-gpu-blocks N` / `--kv-tokens N` where the source printed the pool
  (LLMServingSim's RTX 4090: 2,588 blocks × 16).
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
A run that sends every request at once is also held to its floor (`ttft_floor_ms`: the least mean
TTFT its stated setup can give); one whose published mean TTFT is under it prints "beyond its
setup", and the medians are printed again without it.

    python benchmarks/published_runs.py                  # the table
    python benchmarks/published_runs.py --json           # one JSON object
    python benchmarks/published_runs.py --cases GS-Q8    # runs whose id starts with it
"""

from __future__ import annotations

import argparse
import csv
import functools
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

TARGETS = {"tok/s": 0.15, "ttft": 0.25, "tpot": 0.15}

# A checkpoint's name or the CSV's dtype_quant saying how its weights are stored, for a config that
# does not: the quantization_config vLLM would read from such a checkpoint (kvtune.model.quantization).
QUANTIZATION_CONFIGS = (
    (re.compile(r"\bfp8\b|-fp8", re.I), {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    (re.compile(r"\bawq\b|-awq", re.I), {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}),
    (re.compile(r"\bgptq\b|-gptq", re.I), {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}),
)
# Checkpoints whose config.json is another's, layer for layer (Meta's Llama 3.3 70B is Llama 3.1 70B's
# architecture, retrained): the name they are kept under here.
ARCHITECTURE_TWINS = {"llama-3.3-70b": "llama-3.1-70b"}
_CHECKPOINT_SUFFIXES = re.compile(r"(-(instruct|chat|it|hf|base|fp8|fp8-dynamic|awq|gptq|int4|int8|w8a8|w4a16))+$",
                                  re.I)


def _first_number(text: str) -> float | None:
    """The first figure in a free-text cell ("0.9 (default)", "model default (131072)", "1,024")."""
    m = re.search(r"\d[\d,]*(?:\.\d+)?|\.\d+", text)
    return float(m.group(0).replace(",", "")) if m else None


def _integer(text: str) -> int | None:
    value = _first_number(text)
    return None if value is None or value != int(value) else int(value)


def _base_names(name: str) -> list[str]:
    """The names a checkpoint's config may be kept under, most specific first: less its tuning and
    quantization suffixes (Llama-3.1-70B-Instruct-FP8 → llama-3.1-70b), "Meta-Llama" as "Llama",
    and less a trailing release (Mistral-7B-Instruct-v0.3 → mistral-7b-v0.3, mistral-7b)."""
    name = re.sub(r"^meta-(?=llama)", "", name.casefold())  # Meta-Llama-3.1-70B: Llama-3.1-70B's older name
    tuned = re.compile(r"-(instruct|chat|it|hf|base)(?=-|$)")
    names = [_CHECKPOINT_SUFFIXES.sub("", name), _CHECKPOINT_SUFFIXES.sub("", tuned.sub("", name))]
    names += [re.sub(r"-v\d+(\.\d+)*$", "", n) for n in names]
    names += [ARCHITECTURE_TWINS[n] for n in names if n in ARCHITECTURE_TWINS]
    return list(dict.fromkeys(n for n in names if n))


def model_source(row: dict[str, str], work: Path) -> tuple[str, str]:
    """(kvtune simulate's --model, how it was found) for the CSV's model and dtype_quant: the
    checkpoint's own config.json where aiconfigurator-core ships a copy, else kvtune's preset of its
    name (less -Instruct, -FP8 … suffixes), else a config the validation directory or
    ../shared/configs holds under that name, else what kvtune finds for a logged model id (a
    preset's hub id, the Hugging Face cache). A quantized checkpoint (FP8, AWQ, GPTQ by its name or
    dtype_quant) whose config says nothing of it gets vLLM's quantization_config for that format,
    so its weights are not priced at 16 bits."""
    from kvtune.errors import KvtuneError
    from kvtune.model.sources import PRESETS_DIR, bundled_hub_config, model_for_logged_id

    named = row["model"].strip()
    hub_id = re.split(r"\s*\(", named)[0].strip()
    names = _base_names(hub_id.split("/")[-1])
    source, how = None, ""
    if bundled_hub_config(hub_id) is not None:
        source, how = hub_id, f"{hub_id}'s config.json as aiconfigurator-core ships it"
    for base in names if source is None else ():
        if (PRESETS_DIR / f"{base}.json").is_file():
            source, how = base, f"preset {base}"
            break
    for folder in (VALIDATION / "configs", VALIDATION.parent / "configs") if source is None else ():
        found = [p for p in sorted(folder.glob("*.json")) if p.stem.casefold() in names]
        if found:
            source, how = str(found[0]), f"{found[0].parent.name}/{found[0].name}"
            break
    if source is None:
        try:
            source = model_for_logged_id(hub_id)
            how = f"kvtune's model for {hub_id!r}"
        except KvtuneError as exc:
            raise LookupError(f"no config for model {named!r}: {exc}") from None
    stated = f"{hub_id} {row.get('dtype_quant', '')}"
    for pattern, quantization in QUANTIZATION_CONFIGS:
        if not pattern.search(stated):
            continue
        bundled = bundled_hub_config(source)
        if bundled is not None and bundled[1] is not None:
            break  # a ModelOpt checkpoint: its hf_quant_config.json says how it is stored
        path = Path(source) if source.endswith(".json") else bundled[0] if bundled else PRESETS_DIR / f"{source}.json"
        if not path.is_file():
            break
        config = json.loads(path.read_text())
        if "quantization_config" in config:
            break
        config["quantization_config"] = quantization
        written = work / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', hub_id)}-{quantization['quant_method']}.json"
        written.write_text(json.dumps(config))
        source, how = str(written), f"{how} + {quantization['quant_method']} quantization_config"
        break
    return source, how


def gpu_name(text: str) -> str:
    """The catalog GPU for the CSV's free-text gpu ("H100 SXM 80GB", "A100 80GB (form factor …)",
    "RTX 4090 24GB (…)", "NVIDIA A100-SXM4-40GB"): the longest run of its words that names one, and
    where the text states a memory size, the entry of that family with that size."""
    from kvtune.errors import KvtuneError
    from kvtune.hardware import GPUS, find_gpu

    lead = re.split(r"\s*\(", text)[0].strip()  # nvidia-smi's "NVIDIA A100-SXM4-40GB" too
    words = re.split(r"[\s_-]+", re.sub(r"^(nvidia|amd|geforce)\s+", "", lead, flags=re.I))
    found = None
    for span in [words[i:i + k] for k in range(len(words), 0, -1) for i in range(len(words) - k + 1)]:
        try:
            found = find_gpu(" ".join(span))
            break
        except KvtuneError:
            continue
    if found is None:
        raise LookupError(f"no catalog GPU for {text!r}")
    stated = re.search(r"(\d+)\s*GB\b", text)
    if stated and abs(found.memory_gib - int(stated.group(1))) > 0.12 * int(stated.group(1)):
        family = found.name.split("-")[0]
        same = [g for g in GPUS.values() if g.name.split("-")[0] == family
                and abs(g.memory_gib - int(stated.group(1))) <= 0.12 * int(stated.group(1))]
        if not same:
            raise LookupError(f"no catalog {family} with {stated.group(1)} GB for {text!r}")
        found = same[0]
    return found.name


@dataclass
class Case:
    row: dict[str, str]

    @property
    def id(self) -> str:
        return self.row["case_id"]

    @property
    def gpu(self) -> str:
        return gpu_name(self.row["gpu"])

    @property
    def vllm_version(self) -> str | None:
        """The release the run served with (its defaults and scheduling are that release's)."""
        m = re.match(r"\d+(?:\.\d+)+", self.row["vllm_version"].strip())
        return m.group(0) if m else None

    @property
    def kv_fp8(self) -> bool:
        return self.row["kv_cache_dtype"].strip().lower().startswith("fp8")

    def number(self, field: str) -> float | None:
        """A printed result: the cell's figure where the cell is one (commas allowed)."""
        value = self.row.get(field, "").strip().replace(",", "")
        try:
            return float(value)
        except ValueError:
            return None

    @property
    def rate(self) -> float | None:
        """The printed request_rate in requests/s; None for `inf` or none printed."""
        text = self.row["request_rate"].strip().lower()
        return None if not text or text.startswith("inf") else _first_number(text)

    @property
    def arrives_at_once(self) -> bool:
        """Every request sent at t = 0: no closed loop and no finite rate (`request_rate inf`)."""
        return not self.setting("max_concurrency") and not self.rate

    @property
    def requests(self) -> int | None:
        """Requests the run sent: its num_prompts, else the successful requests it printed."""
        return self.setting("num_prompts") or self.setting("successful_requests")

    def setting(self, field: str) -> int | None:
        """A setup cell's integer, from free text ("model default (131072)", "2 (TP)"); None if absent."""
        return _integer(self.row.get(field, ""))


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
    elif (derived := _derived(case.row.get("notes", ""), "output tok/s")) is not None:
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


@functools.cache
def _sharegpt(mean_in: float, mean_out: float, seed: int = 1) -> np.ndarray:
    """mk_sharegpt's lengths for these means (~0.9 s a fit): drawn once per means, read-only, as the
    GSREF rows share their means and a run's workload and its TTFT floor read the same lengths."""
    sys.path.insert(0, str(VALIDATION))
    try:
        import mk_sharegpt  # the validation directory's own generator
    finally:
        sys.path.pop(0)
    drawn = mk_sharegpt.fit(mean_in, mean_out, seed=seed)
    drawn.setflags(write=False)
    return drawn


# LLMServingSim's workload file: llmss_4090_replay.jsonl holds its requests as the RTX 4090 run sent them
LLMSS_WORKLOAD = "sharegpt-llama-3.1-8b-300-sps10.jsonl"
SHAREGPT_MEANS = (217.393, 201.648)  # GS-Q14 sharegpt's published totals ÷ 1000: the GSREF rows' workload


def _spread(text: str) -> float:
    """A random dataset's length spread as a fraction either side: "±15%" → 0.15, vLLM bench's
    `--random-range-ratio 0.3` → 0.3; 0 for fixed lengths."""
    if (m := re.search(r"±\s*(\d+(?:\.\d+)?)\s*%", text)) is not None:
        return float(m.group(1)) / 100
    if (m := re.search(r"range[-_ ]ratio[ =]+(\d*\.?\d+)", text, re.I)) is not None:
        return float(m.group(1))
    return 0.0


def lengths(case: Case) -> list[tuple[int, int]]:
    """(prompt, output) tokens per request of the run's dataset (see the module's docstring)."""
    r = case.row
    n = case.requests
    if not n:
        raise LookupError("no num_prompts (nor successful_requests)")
    totals = (case.number("total_input_tokens"), case.number("total_output_tokens"))
    if r["dataset"].strip().lower().startswith("sharegpt"):
        means = (totals[0] / n, totals[1] / n) if totals[0] and totals[1] else SHAREGPT_MEANS
        drawn = _sharegpt(*means)
        return [(int(p), int(o)) for p, o in (drawn if case.setting("max_concurrency") else drawn[:n])]
    if totals[0] and totals[1]:  # as printed: a few outputs stop early, and the template adds tokens
        mean_in, mean_out = totals[0] / n, totals[1] / n
    else:
        mean_in, mean_out = _first_number(r["input_len"]), _first_number(r["output_len"])  # type: ignore[assignment]
    if not mean_in or not mean_out:
        raise LookupError(f"no prompt/output lengths for dataset {r['dataset']!r}")
    spread = _spread(" ".join(r.get(f, "") for f in ("dataset", "input_len", "output_len", "bench_cmd")))
    if not spread:
        return [(round(mean_in), max(1, round(mean_out)))] * n
    rng = np.random.default_rng(0)
    return [(int(mean_in * rng.uniform(1 - spread, 1 + spread)),
             max(1, int(mean_out * rng.uniform(1 - spread, 1 + spread)))) for _ in range(n)]


def workload(case: Case, work: Path) -> tuple[Path, list[str]]:
    """The log to simulate and the load options: a closed loop (`max_concurrency`), an open loop at
    the printed `request_rate` (Poisson, or gamma gaps where a burstiness is printed), else every
    request at t = 0; runs of LLMServingSim's workload replay its trace."""
    r = case.row
    if LLMSS_WORKLOAD in r["dataset"]:
        return VALIDATION / "llmss_4090_replay.jsonl", ["--replay"]
    if "per request" in r["input_len"]:
        raise LookupError(f"no trace here for the per-request lengths of {r['dataset'][:80]!r}")
    n = case.requests
    concurrency, rate, at_once = case.setting("max_concurrency"), case.rate, case.arrives_at_once
    path = work / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', case.id)}.jsonl"
    with path.open("w") as f:
        for prompt, output in lengths(case):
            record: dict[str, object] = {"route": "/v1/chat/completions", "prompt_tokens": prompt,
                                         "output_tokens": output, "finish_reason": "stop"}
            if at_once:
                record["timestamp_s"] = 0.0
            f.write(json.dumps(record) + "\n")
    if concurrency:
        return path, ["--concurrency", str(concurrency), "--requests", str(n)]
    if rate:
        load = ["--rate", repr(rate), "--requests", str(n)]
        if (m := re.search(r"burstiness[ =]+(\d*\.?\d+)", f"{r['request_rate']} {r.get('bench_cmd', '')}", re.I)):
            load += ["--burstiness", m.group(1)]
        return path, load
    return path, ["--replay"]


BLOCK_SIZE = 16  # vLLM's default KV block on GPUs


def kv_bytes_per_token(model: str, case: Case) -> int:
    """KV bytes per token per GPU of `model` at the run's KV dtype and TP (kvtune.kv, as `kvtune kv`)."""
    from kvtune.kv import kv_bytes
    from kvtune.model.sources import resolve_model

    return kv_bytes(resolve_model(model), kv_cache_dtype="fp8" if case.kv_fp8 else "auto",
                    tp=case.setting("tp") or 1).kv_bytes_per_token_per_gpu


def capacity_options(case: Case, model: str) -> tuple[list[str], str]:
    """simulate's engine options: TP, the run's max_model_len, KV dtype, gpu_memory_utilization and
    batch limits where printed, and the published pool where the source printed one (in blocks, in
    tokens, or vLLM's "Available KV cache memory" in GiB, as whole blocks of `model`'s KV), else
    kvtune's estimate for the run's settings."""
    r = case.row
    options: list[str] = []
    if (tp := case.setting("tp")) and tp > 1:
        options += ["--tp", str(tp)]
    if mml := case.setting("max_model_len"):
        options += ["--max-model-len", str(mml)]
    if case.kv_fp8:
        options += ["--kv-cache-dtype", "fp8"]
    for field, option in (("max_num_seqs", "--max-num-seqs"), ("max_num_batched_tokens", "--max-num-batched-tokens")):
        if value := case.setting(field):
            options += [option, str(value)]
    size = r.get("kv_cache_size", "").replace(",", "")
    if (m := re.match(r"\s*(\d+) blocks x (\d+)", size)) is not None:
        return options + ["--num-gpu-blocks", m.group(1)], f"published ({m.group(1)} × {m.group(2)})"
    if (m := re.search(r"(\d+)\s*tokens", size)) is not None:
        return options + ["--kv-tokens", m.group(1)], f"published ({int(m.group(1)):,} tokens)"
    if (m := re.search(r"(\d+(?:\.\d+)?)\s*GiB", size)) is not None:
        blocks = int(float(m.group(1)) * 2**30 // (BLOCK_SIZE * kv_bytes_per_token(model, case)))
        return options + ["--num-gpu-blocks", str(blocks)], f"published ({m.group(1)} GiB = {blocks} × {BLOCK_SIZE})"
    util = _first_number(r.get("gpu_memory_utilization", ""))
    if util is not None and 0 < util <= 1:
        options += ["--gpu-memory-utilization", str(util)]
    return options, "kvtune estimate"


def ttft_floor_ms(case: Case, model: str) -> float | None:
    """The least mean TTFT the row's stated setup can give when its N requests arrive at once.

    vLLM serves first come first served, so the i-th request's first token waits for the prefill of
    the i prompts sent before it and its own; in an order that does not favour short prompts (the
    benchmark's dataset order) that is i mean prompts, so the mean TTFT is at least (N + 1) / 2 ×
    the mean prompt × one prompt token's time. A token's time is taken at its least: 2 FLOPs per
    linear-layer parameter (no embedding, no LM head; a MoE's routed experts at top-k) at the GPU's
    peak dense rate in the fastest dtype the checkpoint's GEMMs can use, split over TP with no
    communication. No attention, no decode step between, no server, no chat template: a floor, not
    an estimate. None for other loads (a request's floor is then its own prefill) or a GPU with no
    peak on record."""
    if not case.arrives_at_once:
        return None
    from kvtune.capacity.timing import matmul_dtype
    from kvtune.hardware import find_gpu
    from kvtune.model.sources import resolve_model
    from kvtune.weights import active_parameters, count_parameters

    spec, gpu = resolve_model(model), find_gpu(case.gpu)
    peaks = [f for f in (gpu.bf16_dense_flops, gpu.peak_dense_flops(matmul_dtype(spec, gpu))) if f]
    if not peaks:
        return None
    count = count_parameters(spec)
    linear = active_parameters(spec)[0] - count.embedding - count.lm_head - count.norms
    prompts = [p for p, _ in lengths(case)]
    token_s = 2 * linear / ((case.setting("tp") or 1) * max(peaks))
    return (len(prompts) + 1) / 2 * statistics.fmean(prompts) * token_s * 1000


def beyond_setup(case: Case, floor_ms: float | None) -> str | None:
    """Why the published figures cannot come from the setup the row states (its mean TTFT is under
    `floor_ms`, ttft_floor_ms), else None."""
    pub = published(case)["ttft"]
    if floor_ms is None or pub is None or pub[0] != "ttft_mean_ms" or pub[1] >= floor_ms:
        return None
    tp = case.setting("tp") or 1
    gpus = f"{tp} × {case.gpu}'s" if tp > 1 else f"the {case.gpu}'s"
    return (f"published mean TTFT {pub[1]:,.0f} ms is under the {floor_ms:,.0f} ms its stated setup needs at "
            f"least ({case.requests:,} prompts sent at once, each prompt token's linear layers at {gpus} "
            "peak FLOPs, first come first served): the run was not the setup the row states")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def simulate(case: Case, work: Path) -> dict[str, object]:
    try:
        gpus, tp = case.setting("num_gpus") or 1, case.setting("tp") or 1
        if gpus > tp:  # kvtune simulates one engine of `tp` GPUs
            raise LookupError(f"{gpus} GPUs at TP {tp}: a run over several engines (data or pipeline "
                              "parallel) is not replayed")
        log, load = workload(case, work)
        model, model_from = model_source(case.row, work)
        gpu = case.gpu
    except LookupError as exc:
        return {"error": str(exc), "wall_s": 0.0, "capacity": "—"}
    pool, cap_source = capacity_options(case, model)
    cmd = [sys.executable, "-m", "kvtune", "simulate", str(log), "--model", model, "--gpu", gpu, *pool,
           "--json", *load]
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
    floor = ttft_floor_ms(case, model)
    return {"ttft_floor_ms": floor, "beyond_setup": beyond_setup(case, floor),
            "tok/s": tput["output_tokens_per_s"], "total tok/s": total,
            "ttft_mean_ms": lat["ttft"]["mean"], "ttft_median_ms": lat["ttft"]["p50"],
            "tpot_mean_ms": lat["tpot"]["mean"], "itl_median_ms": lat["tpot"]["p50"],
            "source": timing["source"], "label": timing.get("label", timing["source"]),
            "model": model_from, "gpu": gpu,
            "preemptions": data["server"]["preemptions"],
            "admission": "whole prompt" if data["simulation"]["engine"]["reserve_full_sequence"]["value"]
            else "first chunk",
            "wall_s": wall, "capacity": cap_source,
            "notes": [line.removeprefix("note: ") for line in out.stderr.splitlines() if line.startswith("note: ")]}


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


def judged(results: list[dict], metric: str) -> dict[str, object]:
    """The median |ratio − 1| of `metric` over `results`, and how many are off by more than 2×."""
    values = [r["ratio"][metric] for r in results if r["ratio"].get(metric)]
    errors = [abs(v - 1) for v in values]
    return {"runs": len(values), "median_abs_error": statistics.median(errors) if errors else None,
            "target": TARGETS[metric], "off_by_more_than_2x": sum(1 for v in values if v > 2 or v < 0.5)}


def _summary_line(metric: str, s: object) -> str:
    assert isinstance(s, dict)
    med = s["median_abs_error"]
    return (f"median |ratio − 1| {metric}: {'—' if med is None else f'{med:.1%}'} over {s['runs']} runs "
            f"(target ≤ {s['target']:.0%}); off by > 2×: {s['off_by_more_than_2x']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="only runs whose case_id starts with one of these (comma-separated)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # offline, as the runs are simulated (and _env): no model hub is asked
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
    summary: dict[str, object] = {metric: judged(results, metric) for metric in TARGETS}
    beyond = [r["case"] for r in results if r["predicted"].get("beyond_setup")]
    if beyond:  # the same figures over the runs whose published results their stated setup can give
        summary["beyond_setup"] = beyond
        summary["within_setup"] = {metric: judged([r for r in results if r["case"] not in beyond], metric)
                                   for metric in TARGETS}
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
        for line in p["notes"]:  # what simulate said of the setup (e.g. a release whose scheduler it does not run)
            print(f"{'':34} note: {line}")
        if p["beyond_setup"]:
            print(f"{'':34} beyond its setup: {p['beyond_setup']}")
    for metric in TARGETS:
        print(_summary_line(metric, summary[metric]))
    if beyond:
        print(f"without the {len(beyond)} run(s) beyond their stated setup ({', '.join(beyond)}):")
        within = summary["within_setup"]
        assert isinstance(within, dict)
        for metric in TARGETS:
            print("  " + _summary_line(metric, within[metric]))
    print(f"slowest simulate: {summary['wall_s_max']:.1f} s wall (target ≤ 3 s; the machine's cores are shared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
