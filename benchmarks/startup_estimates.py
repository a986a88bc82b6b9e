"""kvtune's vLLM memory estimate against public vLLM startups: measured KV pool next to estimated.

The measurements are `tests/data/vllm-startups.csv`, the usable rows of
`../shared/reference/vllm-startups.csv` (each row cites its GitHub issue, PR or blog post). This
file says how kvtune reads each row: which preset stands for the model, which vLLM release's
memory model applies, what the row leaves to vLLM's defaults, and where a figure is derived
rather than printed. `tests/unit/test_startup_estimates.py` asserts on the same table.

    python benchmarks/startup_estimates.py          # the per-row table and the medians
    python benchmarks/startup_estimates.py --json

Rows of the reference file left out, and why:
    vllm#12126  Llama-3.2-11B-Vision: the 36.63 GiB activation peak is its vision encoder's and
                cross-attention's profile; kvtune has no multimodal model (and no preset for it)
    vllm#12569  GPU not stated (TP 1, 67.7 GiB of weights fit several GPU sizes)
    vllm#13596  model and GPU not stated (a log-format fixture)
    vllm#830    GPU type and utilization not stated
    hf-mem#60   GPU and utilization not shown
    gemma-4-26B-A4B (blog, 2026-04-17)  vLLM version not in the excerpt, and kvtune has no
                Gemma 4 preset whose config facts could be checked
    club-3090#612, club-3090#295  local checkpoints (NVFP4 / AutoRound int4 hybrids) kvtune
                has no config for; utilization not in the excerpts
    OpenRLHF#336  GPU, TP and utilization not in the excerpt
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtune.capacity.memory import GiB  # noqa: E402
from kvtune.capacity.plan import CapacityInputs, CapacityReport, plan_capacity  # noqa: E402
from kvtune.errors import CapacityError  # noqa: E402
from kvtune.hardware import GPUS  # noqa: E402
from kvtune.kv import kv_bytes  # noqa: E402
from kvtune.model import resolve_model  # noqa: E402
from kvtune.weights import WeightsEstimate, WeightsSource, estimate_from_parameters  # noqa: E402

DATA = REPO / "tests" / "data" / "vllm-startups.csv"
BLOCK_SIZE = 16  # vLLM's GPU block size in every release here


@dataclass(frozen=True, slots=True)
class Startup:
    """How kvtune reads one row of the startups file."""

    key: str  # the start of the row's `source` cell
    preset: str  # the kvtune preset that stands for the row's model
    engine_version: str  # the release whose memory model applies
    why_version: str
    kv: str  # "available_kv_gib", "num_gpu_blocks" or "derived": how the measured pool is read
    gpu: str | None = None  # catalog GPU
    gpu_memory_gib: float | None = None  # the total vLLM logged, when the row has it
    max_model_len: int | None = None  # None: the row's cell, else the model's default
    weights_from_log: bool = False  # use the row's model_weights_gib (per GPU) instead of counting
    quantization: str | None = None  # the served checkpoint's format where the preset is the base model
    vocab_size: int | None = None  # where the row's model differs from the preset's only there
    enforce_eager: bool = False
    modelled: bool = True  # inside the releases kvtune's memory model covers (see `outside`)
    outside: str = ""  # why not, when modelled is False
    negative: str = ""  # "error" (the pool is negative) or "max-model-len" (one request does not fit)
    blocks: int | None = None  # a block count the row's notes give for another run than its own cell
    label: str = ""  # how the table names the run, when a row gives two
    notes: str = ""


STARTUPS = (
    Startup(
        "vllm-project/vllm#10511", "llama-3.1-8b", "0.6.5",
        "dev main of Dec 2024 with vllm#10511's profiler, first released in 0.6.5", kv="derived",
        gpu_memory_gib=79.22, max_model_len=8192, weights_from_log=True,
        notes="Meta-Llama-3-8B = the llama-3.1-8b architecture (32 layers, 8 kv heads, vocab 128,256) at its "
              "8,192 context; the available KV is cut off in the excerpt, so it is derived with that profiler's "
              "own formula from the row's figures: 79.22 × 0.90 − weights 7.48 − non_torch 3.58 − activation 1.26",
    ),
    Startup(
        "vllm-project/vllm#2031 ", "llama-3.1-70b", "0.2.5",
        "main with vllm#2031, which shipped in 0.2.5 (vllm#2248)", kv="num_gpu_blocks", gpu="A100-80GB",
        max_model_len=4096, vocab_size=32_000, modelled=False,
        outside="vLLM < 0.6.5 at tp × pp > 1: the profiler charged all device memory in use and its authors "
                "could not size the TP > 1 part ('probably related to NCCL?')",
        notes="Llama-2-70B = the llama-3.1-70b architecture (80 layers, 8 kv heads, hidden 8,192, MLP 28,672) "
              "with vocab 32,000 and context 4,096 (meta-llama/Llama-2-70b-hf config.json, as quoted in public "
              "code); benchmark_throughput.py with the engine defaults",
    ),
    Startup(
        "vllm-project/vllm#2031 ", "llama-3.1-70b", "0.2.4",
        "main just before vllm#2031: the torch-peak profiler of 0.2.4 and earlier", kv="num_gpu_blocks",
        gpu="A100-80GB", max_model_len=4096, vocab_size=32_000, blocks=31_615, label="vllm-project/vllm#2031 before",
        notes="the row's notes: '# GPU blocks: 31615' on main before the PR; Llama-2-70B as in the next run",
    ),
    Startup(
        "vllm-project/vllm#21348", "qwen3-235b-a22b", "0.9.2",
        "not stated; July 2025, after vllm#19312 (0.9.2); every V1 release before 0.21 has this memory model",
        kv="available_kv_gib", gpu="H100-80GB", quantization="fp8",
        notes="Qwen3-235B-A22B-FP8 = the qwen3-235b-a22b architecture with fp8 weights (its config's quant_method); "
              "utilization 0.9, the default then; an LMCache connector is configured (not modelled)",
    ),
    Startup(
        "vllm-project/vllm#2382 ", "mixtral-8x7b", "0.2.7", "stated", kv="num_gpu_blocks", gpu="A100-80GB",
        max_model_len=32768, quantization="awq", enforce_eager=True, modelled=False,
        outside="vLLM < 0.6.5 at tp × pp > 1 (as vllm#2031); AWQ's GEMM in 0.2.x also allocated split-k partial "
                "outputs (8 × tokens × features) that kvtune does not model",
        notes="TheBloke's AWQ checkpoint = the mixtral-8x7b architecture with 4-bit group-128 weights",
    ),
    Startup(
        "https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/ (blog, 2026-04-18)", "gpt-oss-20b", "0.19.0", "stated",
        kv="available_kv_gib", gpu="A100-80GB", weights_from_log=True,
        notes="A100 size not stated: weights 13.72 + KV 36.56 = 50.28 GiB exceed 0.65 × an A100-40GB, so the 80 GB one",
    ),
    Startup(
        "vllm-project/vllm#13882", "qwen2-7b", "0.7.3", "V0 of Feb 2025: the 0.7 series", kv="available_kv_gib",
        gpu_memory_gib=8.00, weights_from_log=True, negative="error",
        notes="Qwen2.5-7B = the qwen2-7b architecture (28 layers, 4 kv heads, hidden 3,584, vocab 152,064); the "
              "row's 5.20 GiB of 4-bit weights; vLLM logged non_torch 0.03 + activation peak 1.42 GiB",
    ),
    Startup(
        "vllm-project/vllm#27508", "gpt-oss-120b", "0.11.0", "not stated; Oct 2025: the 0.11 series",
        kv="available_kv_gib", gpu="H100-80GB", negative="max-model-len",
        notes="--max-num-batched-tokens 1024; the default max_model_len 131,072; weights counted (mxfp4 experts)",
    ),
)


def _number(cell: str) -> float | None:
    """The leading number of a cell ('5.20 (5.2032 'GB')' → 5.2), None when empty."""
    match = re.match(r"\s*(-?\d+(?:\.\d+)?)", cell)
    return float(match.group(1)) if match else None


def load_rows(path: Path = DATA) -> dict[str, dict[str, str]]:
    """The startups file's rows by source."""
    with path.open(newline="", encoding="utf-8") as f:
        return {row["source"]: row for row in csv.DictReader(f)}


def row_for(startup: Startup, rows: dict[str, dict[str, str]]) -> dict[str, str]:
    found = [row for source, row in rows.items() if source.startswith(startup.key)]
    if len(found) != 1:
        raise LookupError(f"{startup.key}: {len(found)} rows in {DATA.name}")
    return found[0]


@dataclass(frozen=True, slots=True)
class Estimate:
    """One row: what vLLM had, what kvtune estimates, or the error kvtune raised."""

    startup: Startup
    source: str
    model: str
    gpu: str
    measured_kv_bytes: int
    report: CapacityReport | None
    error: CapacityError | None

    @property
    def estimated_kv_bytes(self) -> int | None:
        m = self.report.capacity.memory if self.report else None
        return m.kv_cache_bytes if m else None

    @property
    def relative_error(self) -> float | None:
        est = self.estimated_kv_bytes
        if est is None or self.measured_kv_bytes <= 0:
            return None
        return (est - self.measured_kv_bytes) / self.measured_kv_bytes


def estimate(startup: Startup, row: dict[str, str]) -> Estimate:
    """Run kvtune's estimate for one row, as `kvtune capacity` would with the row's settings."""
    spec = resolve_model(startup.preset)
    changes: dict[str, object] = {}
    if startup.quantization:
        changes.update(quantization=startup.quantization, quantization_bits=None)
    if startup.vocab_size:
        changes["vocab_size"] = startup.vocab_size
    if startup.max_model_len and startup.vocab_size:
        changes["max_position_embeddings"] = startup.max_model_len
    spec = dataclasses.replace(spec, **changes)
    tp = int(row["tensor_parallel"] or 1)
    kv = kv_bytes(spec, tp=tp)
    if startup.weights_from_log:
        per_gpu = _number(row["model_weights_gib"])
        assert per_gpu is not None, startup.key
        weights = WeightsEstimate(round(per_gpu * GiB * tp), WeightsSource.PARAMETER_COUNT, "as logged", None,
                                  ("weights as the startup log printed them",))
    else:
        weights = estimate_from_parameters(spec)
    if startup.gpu_memory_gib is not None:
        gpu_name, memory = startup.gpu, round(startup.gpu_memory_gib * GiB)
        gpu = f"{startup.gpu_memory_gib} GiB (logged)"
    else:
        assert startup.gpu is not None, startup.key
        gpu_name, memory = startup.gpu, GPUS[startup.gpu].memory_bytes
        gpu = startup.gpu
    utilization = _number(row["gpu_memory_utilization"]) or 0.9  # 0.9: the default of every release here
    max_len = startup.max_model_len or (int(row["max_model_len"]) if row["max_model_len"] else None)
    batched = int(_number(row["notes"].split("--max-num-batched-tokens")[1]) or 0) \
        if "--max-num-batched-tokens" in row["notes"] else None
    if startup.kv == "num_gpu_blocks":
        measured = (startup.blocks or int(row["num_gpu_blocks"])) * BLOCK_SIZE * kv.kv_bytes_per_token_per_gpu
    elif startup.kv == "available_kv_gib":
        value = _number(row["available_kv_gib"])
        assert value is not None, startup.key
        measured = round(value * GiB)
    else:  # derived from the V0 profiler's figures in the row's notes (see the Startup's notes)
        measured = round((79.22 * 0.90 - 7.48 - 3.58 - 1.26) * GiB)
    report = error = None
    try:
        report = plan_capacity(spec, kv, CapacityInputs(
            weights, gpu_name=gpu_name, gpu_memory_bytes=memory, gpu_memory_utilization=utilization,
            max_model_len=max_len, max_num_batched_tokens=batched, enforce_eager=startup.enforce_eager,
            engine_version=startup.engine_version))
    except CapacityError as exc:
        error = exc
    return Estimate(startup, row["source"], row["model"], gpu, measured, report, error)


def estimates() -> list[Estimate]:
    rows = load_rows()
    return [estimate(s, row_for(s, rows)) for s in STARTUPS]


def median_error(results: list[Estimate], *, modelled_only: bool) -> float:
    """Median |relative error| over the positive rows (modelled_only: those inside the model's releases)."""
    errors = [abs(r.relative_error) for r in results
              if not r.startup.negative and r.relative_error is not None and (r.startup.modelled or not modelled_only)]
    return statistics.median(errors)


def main(argv: list[str]) -> int:
    results = estimates()
    table = []
    for r in results:
        est = r.estimated_kv_bytes
        table.append({
            "source": r.startup.label or _short(r.source), "vllm": r.startup.engine_version, "model": r.model,
            "gpu": r.gpu,
            "tp": r.report.tensor_parallel_size if r.report else None,
            "measured_kv_gib": round(r.measured_kv_bytes / GiB, 2),
            "estimated_kv_gib": None if est is None else round(est / GiB, 2),
            "error_pct": None if r.relative_error is None else round(100 * r.relative_error, 1),
            "modelled": r.startup.modelled, "negative": r.startup.negative or None,
            "verdict": _verdict(r),
        })
    medians = {"median_abs_error_pct_modelled": round(100 * median_error(results, modelled_only=True), 1),
               "median_abs_error_pct_all": round(100 * median_error(results, modelled_only=False), 1)}
    if "--json" in argv:
        print(json.dumps({"rows": table, **medians}, indent=2))
        return 0
    head = f"{'source':<30} {'vLLM':<7} {'model':<40} {'GPU':<22} {'measured':>9} {'estimate':>9} {'error':>8}  note"
    print(head)
    print("-" * len(head))
    for t in table:
        est = "—" if t["estimated_kv_gib"] is None else f"{t['estimated_kv_gib']:.2f}"
        err = "—" if t["error_pct"] is None else f"{t['error_pct']:+.1f}%"
        print(f"{t['source']:<30} {t['vllm']:<7} {t['model'][:40]:<40} {t['gpu'][:22]:<22} "
              f"{t['measured_kv_gib']:>9.2f} {est:>9} {err:>8}  {t['verdict']}")
    print(f"\nmedian |error|, rows inside the modelled releases: {medians['median_abs_error_pct_modelled']:.1f}%")
    print(f"median |error|, all positive rows:                 {medians['median_abs_error_pct_all']:.1f}%")
    print("KV figures in GiB per GPU; measured = vLLM's available KV (or blocks × 16 × KV bytes per token)")
    return 0


def _short(source: str) -> str:
    """'vllm-project/vllm#10511 (PR ...)' → itself up to the parenthesis; a URL → host and date."""
    head, _, rest = source.partition(" (")
    if head.startswith("http"):
        date = re.search(r"\d{4}-\d{2}-\d{2}", rest)
        return head.split("/")[2] + (f" {date.group(0)}" if date else "")
    return head


def _verdict(r: Estimate) -> str:
    if r.startup.negative == "error":
        return "negative: " + ("estimate fails too (CapacityError)" if r.error else "estimate MISSES the failure")
    if r.startup.negative == "max-model-len":
        c = r.report.capacity if r.report else None
        fits = c is not None and c.max_concurrency_at_max_model_len >= 1
        return "negative: " + ("estimate MISSES the failure" if fits else
                               f"estimate says max_model_len does not fit ({c.max_concurrency_at_max_model_len:.2f}x)"
                               if c else "estimate fails too")
    return "" if r.startup.modelled else "outside the modelled releases"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
