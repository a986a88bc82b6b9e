"""Measuring and storing the step-time model (kvtune.domain.step_time holds the model and its formula).

Two ways to get the coefficients, labelled so that every output that uses them can say which:
  calibrated          `kvtune calibrate URL --timing` fitted them to a live engine
                      (kvtune.bench.timing runs the sweeps; `fit_step_time` here fits them)
  roofline-estimate   `roofline_step_time` from the GPU's bandwidth and FLOPs and the model's
                      weight and KV bytes, for a GPU nobody calibrated on

Everything here is pure: observations in, coefficients and errors out. The fit is non-negative
least squares on relative error, solved exactly by trying every support of the 5 unknowns
(c0..c3 and the HTTP overhead): 32 small least-squares problems, no scipy needed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtune.domain.fields import Fields
from kvtune.domain.step_time import (
    COEFFICIENT_UNITS,
    COEFFICIENTS,
    FORMULA,
    FRONTEND_TERMS,
    FRONTEND_UNITS,
    FrontEndModel,
    StepTimeModel,
    TimingSource,
    step_features,
)
from kvtune.errors import CapacityError
from kvtune.kv import kv_bytes
from kvtune.model.spec import LayerKind
from kvtune.profile.histogram import nearest_rank_index
from kvtune.weights import active_parameters, quantization_of, weights_for

if TYPE_CHECKING:
    from kvtune.hardware import Gpu
    from kvtune.model.spec import ModelSpec

SWEEPS = ("overhead", "prefill", "load", "decode")
# calibrate fits c0..c3 and leaves c4 at 0: its decode sweeps see the KV read and the attention
# FLOPs only together (n = 1), which c2 alone carries as before c4 existed
FITTED = 4
_MAX_SECONDS = 3600.0  # no coefficient of a real engine comes near an hour


def prefill_chunks(prompt_tokens: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The (chunk, context) steps a lone request's prefill takes under vLLM's token budget."""
    chunks = []
    done = 0
    while done < prompt_tokens:
        n = min(max_num_batched_tokens, prompt_tokens - done)
        chunks.append((n, done))
        done += n
    return chunks


def lone_prefill_features(prompt_tokens: int, max_num_batched_tokens: int) -> np.ndarray:
    """Σ of step features over the chunks of one request alone, max_tokens 1: its TTFT less HTTP."""
    return sum((step_features([c]) for c in prefill_chunks(prompt_tokens, max_num_batched_tokens)),
               start=np.zeros(len(COEFFICIENTS)))


def decode_features(contexts: Sequence[int]) -> np.ndarray:
    """One decode step of len(contexts) requests, each computing one token on its context."""
    return step_features((1, ctx) for ctx in contexts)


def wave_decode_features(concurrency: int, prompt_tokens: int, output_tokens: int,
                         max_num_batched_tokens: int) -> np.ndarray:
    """The mean inter-token gap of `concurrency` identical requests sent together, as features.

    vLLM schedules running requests first, each decoding one token, then prefill chunks in arrival
    order within the token budget: the first requests start decoding while later ones still
    prefill, so some gaps span mixed steps. The mean gap over all requests is the average of the
    steps' features weighted by how many requests each step gave a token to after their first.
    """
    remaining = [prompt_tokens] * concurrency  # prompt tokens still to prefill
    generated = [0] * concurrency
    total = np.zeros(len(COEFFICIENTS))
    gaps = 0
    while any(g < output_tokens for g in generated):
        budget = max_num_batched_tokens
        batch: list[tuple[int, int]] = []
        decoding = 0
        for i in range(concurrency):
            if generated[i] >= output_tokens or budget == 0:
                continue
            if remaining[i] > 0:
                n = min(remaining[i], budget)
                batch.append((n, prompt_tokens - remaining[i]))
                remaining[i] -= n
                if remaining[i] == 0:
                    generated[i] = 1  # the step that completes a prompt samples its first token
            else:
                batch.append((1, prompt_tokens + generated[i] - 1))
                generated[i] += 1
                decoding += 1
                n = 1
            budget -= n
        total += decoding * step_features(batch)
        gaps += decoding
    return total / max(gaps, 1)


def decode_weighted_features(decisions: Sequence[Any], prompt_tokens: Sequence[int]) -> np.ndarray | None:
    """The mean inter-token gap of a replayed run, as features: each step's features (from the
    simulator's decisions: (request, tokens) scheduled, preempted) weighted by how many decoding
    requests it gave a token. A preempted request computes again from nothing (its cached
    prefix is not counted as context: a small underestimate of its attention)."""
    computed: dict[int, int] = {}
    total = np.zeros(len(COEFFICIENTS))
    weight = 0
    for d in decisions:
        for r in d.preempted:
            computed[r] = 0
        batch = [(n, computed.get(r, 0)) for r, n in d.scheduled]
        decoders = sum(1 for r, n in d.scheduled if n == 1 and computed.get(r, 0) >= prompt_tokens[r])
        if decoders:
            total += decoders * step_features(batch)
            weight += decoders
        for r, n in d.scheduled:
            computed[r] = computed.get(r, 0) + n
    return None if weight == 0 else total / weight


# --- observations and the fit ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured time explained as HTTP overhead (0 or 1 of it) plus some steps' features."""

    sweep: str  # overhead | prefill | decode
    features: tuple[float, float, float, float]  # summed over the steps the time covers
    http: int  # 1 when the time includes a request's HTTP overhead (TTFT), 0 for an ITL
    seconds: float

    @classmethod
    def of(cls, sweep: str, features: np.ndarray, http: int, seconds: float) -> Observation:
        f = tuple(float(x) for x in features)
        return cls(sweep, (f[0], f[1], f[2], f[3]), http, seconds)

    @property
    def row(self) -> np.ndarray:
        return np.array([*self.features, float(self.http)])


@dataclass(frozen=True, slots=True)
class FitError:
    """Relative error |predicted − measured| / measured over a sweep's observations."""

    observations: int
    median: float
    p90: float
    max: float

    def to_dict(self) -> dict[str, Any]:
        return {"observations": self.observations, "median": round(self.median, 6), "p90": round(self.p90, 6),
                "max": round(self.max, 6)}


@dataclass(frozen=True, slots=True)
class StepTimeFit:
    """The fitted model, the HTTP overhead it needed, and its error per sweep."""

    model: StepTimeModel
    http_overhead_s: float
    errors: dict[str, FitError]

    def predict(self, observation: Observation) -> float:
        return float(observation.row @ np.array([*self.model.coefficients[:FITTED], self.http_overhead_s]))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖Ax − b‖ subject to x ≥ 0, exactly, for a handful of columns.

    The optimum is the unconstrained least-squares solution on its own support, so trying every
    support and keeping the best non-negative solution finds it (2^k solves; k = 5 here).
    """
    k = a.shape[1]
    best = np.zeros(k)
    best_residual = float(np.sum(b * b))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            x_s, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_s < 0):
                continue
            x = np.zeros(k)
            x[cols] = x_s
            residual = float(np.sum((a @ x - b) ** 2))
            if residual < best_residual * (1 - 1e-12):
                best, best_residual = x, residual
    return best


def _nearest_rank(values: np.ndarray, q: float) -> float:
    """The one quantile kvtune reports (kvtune.profile.histogram), over the fit's errors."""
    return float(np.sort(values)[nearest_rank_index(values.size, q)])


def fit_step_time(observations: Sequence[Observation], *, sweep_weights: Mapping[str, float] | None = None,
                  http_overhead_s: float | None = None) -> StepTimeFit:
    """c0..c3 and the HTTP overhead by non-negative least squares on relative error.

    With `http_overhead_s` (measured apart) it is taken off the rows that include it and only c0..c3
    are fitted.

    Each row is divided by its measured time (a 5 ms decode step counts as much as a 2 s prefill),
    and each sweep's rows share one unit of weight (times `sweep_weights`) so the sweep with the most
    observations does not decide the fit alone.
    """
    kept = [o for o in observations if o.seconds > 0 and math.isfinite(o.seconds)]
    if not kept:
        raise CapacityError("no timing observations to fit: every sweep request failed", field="--timing")
    counts: dict[str, int] = {}
    for o in kept:
        counts[o.sweep] = counts.get(o.sweep, 0) + 1
    weights = np.array([(sweep_weights or {}).get(o.sweep, 1.0) / math.sqrt(counts[o.sweep]) / o.seconds
                        for o in kept])
    rows = np.array([o.row for o in kept])
    seconds = np.array([o.seconds for o in kept])
    if http_overhead_s is not None:
        seconds = seconds - rows[:, 4] * http_overhead_s
        rows = rows[:, :4]
    a = rows * weights[:, None]
    b = seconds * weights
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # columns differ by ~10 orders of magnitude
    x = nnls(a / scale, b) / scale
    if http_overhead_s is not None:
        x = np.append(x, http_overhead_s)
    model = StepTimeModel(float(x[0]), float(x[1]), float(x[2]), float(x[3]))
    fit = StepTimeFit(model, float(x[4]), {})
    return StepTimeFit(model, float(x[4]), fit_errors(fit, kept))


def fit_errors(fit: StepTimeFit, observations: Sequence[Observation]) -> dict[str, FitError]:
    """Relative error per sweep, nearest-rank median and p90."""
    by_sweep: dict[str, list[float]] = {}
    for o in observations:
        if not o.seconds > 0:
            continue
        by_sweep.setdefault(o.sweep, []).append(abs(fit.predict(o) - o.seconds) / o.seconds)
    errors = {}
    for sweep, values in by_sweep.items():
        arr = np.array(values)
        errors[sweep] = FitError(arr.size, _nearest_rank(arr, 0.5), _nearest_rank(arr, 0.9), float(arr.max()))
    return errors


def fit_frontend(lone_ttft_s: Sequence[float], bursts: Sequence[tuple[int, float]],
                 stream: Sequence[tuple[int, float, float]]) -> FrontEndModel | None:
    """The API server's serial work per request and per streamed token (kvtune.domain.step_time.FrontEndModel).

    lone_ttft_s  TTFTs of near-empty requests (max_tokens 1) sent one at a time
    bursts       (B, seconds from the first send to the last answer) of B near-empty requests
                 sent together: the server is busy B requests' work whether it shares itself
                 among them (as vLLM's does: kvtune.sim.frontend) or takes them one by one, so each
                 one after the first adds one request's work (and its one token's): (burst − lone) / (B − 1)
    stream       (B, client's mean gap, engine's mean gap) of the decode sweep's streamed cells:
                 where the server cannot stream B tokens a step as fast as the engine makes them,
                 the client's gap exceeds the engine's by what the B tokens cost beyond the step,
                 (client − engine) / B per token (the median over cells of B ≥ 4; 0 when hidden)
    None without lone requests or bursts (the file then keeps only `http_overhead_s`).
    """
    lone = [x for x in lone_ttft_s if x > 0 and math.isfinite(x)]
    per_request = [(wall - float(np.median(lone))) / (b - 1) for b, wall in bursts
                   if b > 1 and wall > 0 and math.isfinite(wall)] if lone else []
    if not per_request:
        return None
    gaps = [(client - engine) / b for b, client, engine in stream
            if b >= 4 and math.isfinite(client) and math.isfinite(engine)]
    token_s = max(0.0, float(np.median(gaps))) if gaps else 0.0
    per = max(0.0, float(np.median(per_request)))
    return FrontEndModel(max(0.0, per - token_s), min(token_s, per))


# --- the capacity file's `timing` object -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerCheck:
    """What the server's own /metrics said about a sweep (deltas of its counters before/after)."""

    iterations: int | None = None  # vllm:iteration_tokens_total count: steps that produced output
    iteration_tokens: int | None = None  # its sum: prompt tokens computed + tokens generated
    prompt_tokens: int | None = None
    generation_tokens: int | None = None
    preemptions: int | None = None
    engine_itl_mean_s: float | None = None  # vllm:inter_token_latency_seconds sum / count
    engine_prefill_mean_s: float | None = None  # vllm:request_prefill_time_seconds sum / count

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SERVER_INTS + _SERVER_FLOATS}


_SERVER_INTS = ("iterations", "iteration_tokens", "prompt_tokens", "generation_tokens", "preemptions")
_SERVER_FLOATS = ("engine_itl_mean_s", "engine_prefill_mean_s")


@dataclass(frozen=True, slots=True)
class SweepReport:
    """One sweep: what it sent, the fit's error on it, and the server's view of it."""

    name: str  # overhead | prefill | decode
    requests: int  # sent
    completed: int  # answered in full and used
    prompt_tokens: tuple[int, int]  # the range sent
    output_tokens: tuple[int, int]
    concurrency: tuple[int, ...]
    wall_s: float
    error: FitError | None  # None when nothing of it could be fitted
    client_mean_s: float | None  # mean measured time of its observations (TTFT, or decode ITL)
    server: ServerCheck = field(default_factory=ServerCheck)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "requests": self.requests,
            "completed": self.completed,
            "prompt_tokens": list(self.prompt_tokens),
            "output_tokens": list(self.output_tokens),
            "concurrency": list(self.concurrency),
            "wall_s": round(self.wall_s, 3),
            "error": None if self.error is None else self.error.to_dict(),
            "client_mean_s": self.client_mean_s,
            "server": self.server.to_dict(),
            "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class MeasuredAgainst:
    """The server and settings a calibration ran on: the fit holds for these."""

    url: str
    model: str | None
    max_model_len: int | None
    block_size: int | None
    num_blocks: int | None
    kv_cache_dtype: str | None
    max_num_batched_tokens: int
    max_num_batched_tokens_from: str  # option | vllm-log | server-info | engine-default

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "max_model_len": self.max_model_len,
                "block_size": self.block_size, "num_blocks": self.num_blocks,
                "kv_cache_dtype": self.kv_cache_dtype, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_batched_tokens_from": self.max_num_batched_tokens_from}


BATCHED_TOKENS_FROM = ("option", "vllm-log", "server-info", "engine-default")


@dataclass(frozen=True, slots=True)
class Timing:
    """A calibrated step-time model as the capacity file holds it (`timing`)."""

    model: StepTimeModel
    http_overhead_s: float  # per request, fitted with the coefficients
    sweeps: tuple[SweepReport, ...]
    measured_against: MeasuredAgainst
    budget_s: float
    wall_s: float
    kvtune_version: str
    frontend: FrontEndModel | None = None  # the API server's serial work; older files have none

    @property
    def source(self) -> TimingSource:
        return self.model.source

    def sweep(self, name: str) -> SweepReport | None:
        return next((s for s in self.sweeps if s.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.model.source.value,
            "formula": FORMULA,
            "coefficients": self.model.to_dict(),
            "units": dict(COEFFICIENT_UNITS),
            "http_overhead_s": self.http_overhead_s,
            **({} if self.frontend is None else
               {"frontend": {**self.frontend.to_dict(), "units": dict(FRONTEND_UNITS)}}),
            "sweeps": [s.to_dict() for s in self.sweeps],
            "measured_against": self.measured_against.to_dict(),
            "budget_s": self.budget_s,
            "wall_s": round(self.wall_s, 3),
            "kvtune_version": self.kvtune_version,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> Timing:
        """Parse the `timing` object strictly; every error names the file and field."""
        _known(f, {"source", "formula", "coefficients", "units", "http_overhead_s", "frontend", "sweeps",
                   "measured_against", "budget_s", "wall_s", "kvtune_version"})
        frontend = None
        if (fe := f.obj("frontend", optional=True)) is not None:
            _known(fe, {*FRONTEND_TERMS, "units"})
            if (fe_units := fe.obj("units", optional=True)) is not None:
                _known(fe_units, set(FRONTEND_TERMS))
                for name in FRONTEND_TERMS:
                    fe_units.string(name, optional=True)
            frontend = FrontEndModel(*(fe.number(name, maximum=_MAX_SECONDS) for name in FRONTEND_TERMS))
        source = TimingSource(f.choice("source", tuple(s.value for s in TimingSource if s is not TimingSource.SILICON)))
        c = f.obj("coefficients")
        _known(c, set(COEFFICIENTS))
        c0, c1, c2, c3 = (c.number(name, maximum=_MAX_SECONDS) for name in COEFFICIENTS[:4])
        c4 = c.number("c4", maximum=_MAX_SECONDS, optional=True) or 0.0  # files from before c4: 0
        f.string("formula", optional=True)
        if (units := f.obj("units", optional=True)) is not None:
            _known(units, set(COEFFICIENTS))
            for name in COEFFICIENTS:
                units.string(name, optional=True)
        m = f.obj("measured_against")
        _known(m, {"url", "model", "max_model_len", "block_size", "num_blocks", "kv_cache_dtype",
                   "max_num_batched_tokens", "max_num_batched_tokens_from"})
        against = MeasuredAgainst(
            url=m.string("url", nonempty=True),
            model=m.string("model", optional=True),
            max_model_len=m.integer("max_model_len", minimum=1, optional=True),
            block_size=m.integer("block_size", minimum=1, optional=True),
            num_blocks=m.integer("num_blocks", optional=True),
            kv_cache_dtype=m.string("kv_cache_dtype", optional=True),
            max_num_batched_tokens=m.integer("max_num_batched_tokens", minimum=1),
            max_num_batched_tokens_from=m.choice("max_num_batched_tokens_from", BATCHED_TOKENS_FROM),
        )
        return cls(
            model=StepTimeModel(c0, c1, c2, c3, c4, source=source),
            http_overhead_s=f.number("http_overhead_s", maximum=_MAX_SECONDS),
            sweeps=tuple(_sweep_from_fields(s) for s in f.items("sweeps")),
            measured_against=against,
            budget_s=f.number("budget_s", maximum=float(7 * 24 * 3600)),
            wall_s=f.number("wall_s", maximum=float(7 * 24 * 3600)),
            kvtune_version=f.string("kvtune_version", nonempty=True),
            frontend=frontend,
        )


def _known(f: Fields, keys: set[str]) -> None:
    unknown = sorted(str(k) for k in set(f.data) - keys)
    if unknown:
        raise f.fail(unknown[0], f"unknown field (known: {', '.join(sorted(keys))})")


def _pair(f: Fields, key: str) -> tuple[int, int]:
    values = f.integers(key)
    if len(values) != 2 or values[0] > values[1]:
        raise f.fail(key, f"expected [minimum, maximum], got {values[:4]}")
    return values[0], values[1]


def _sweep_from_fields(f: Fields) -> SweepReport:
    _known(f, {"name", "requests", "completed", "prompt_tokens", "output_tokens", "concurrency", "wall_s", "error",
               "client_mean_s", "server", "notes"})
    error = f.obj("error", optional=True)
    if error is not None:
        _known(error, {"observations", "median", "p90", "max"})
    server = f.obj("server", optional=True)
    check = ServerCheck()
    if server is not None:
        _known(server, set(_SERVER_INTS + _SERVER_FLOATS))
        ints = {name: server.integer(name, optional=True) for name in _SERVER_INTS}
        check = ServerCheck(
            iterations=ints["iterations"], iteration_tokens=ints["iteration_tokens"],
            prompt_tokens=ints["prompt_tokens"], generation_tokens=ints["generation_tokens"],
            preemptions=ints["preemptions"], engine_itl_mean_s=server.number("engine_itl_mean_s", optional=True),
            engine_prefill_mean_s=server.number("engine_prefill_mean_s", optional=True))
    concurrency = f.integers("concurrency", minimum=1)
    return SweepReport(
        name=f.choice("name", SWEEPS),
        requests=f.integer("requests"),
        completed=f.integer("completed"),
        prompt_tokens=_pair(f, "prompt_tokens"),
        output_tokens=_pair(f, "output_tokens"),
        concurrency=tuple(concurrency),
        wall_s=f.number("wall_s"),
        error=None if error is None else FitError(
            error.integer("observations", minimum=1), error.number("median"), error.number("p90"),
            error.number("max")),
        client_mean_s=f.number("client_mean_s", optional=True),
        server=check,
        notes=tuple(f.strings("notes", optional=True) or ()),
    )


# --- without a calibration: the roofline -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class RooflineInputs:
    """What a roofline estimate was computed from, per GPU (after the TP split)."""

    gpu: str
    tensor_parallel_size: int
    hbm_bandwidth_bytes_per_s: int
    bf16_dense_flops: float
    weights_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    active_parameters: int  # whole model; per token, a MoE computes only its routed top-k
    #: of active_parameters, those whose GEMMs run in `matmul_dtype` (a W8A8 checkpoint's linear
    #: layers on a GPU with that tensor path); the rest run at 16 bits
    quantized_active_parameters: int = 0
    matmul_dtype: str = "bf16"  # bf16 | fp8 | int8 | fp4
    matmul_dense_flops: float | None = None  # the GPU's peak in matmul_dtype (None: bf16's)
    weight_format: str | None = None  # the checkpoint's, as kvtune.weights prices it
    attention_flops_per_pair: int = 0  # per (query, key) pair, all attending layers, whole model

    def to_dict(self) -> dict[str, Any]:
        return {"source": TimingSource.ROOFLINE.value, "gpu": self.gpu,
                "tensor_parallel_size": self.tensor_parallel_size,
                "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth_bytes_per_s,
                "bf16_dense_flops": self.bf16_dense_flops, "weights_bytes_per_gpu": self.weights_bytes_per_gpu,
                "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
                "active_parameters": self.active_parameters,
                "quantized_active_parameters": self.quantized_active_parameters,
                "matmul_dtype": self.matmul_dtype,
                "matmul_dense_flops": self.matmul_dense_flops or self.bf16_dense_flops,
                "weight_format": self.weight_format,
                "attention_flops_per_pair": self.attention_flops_per_pair}


def roofline_coefficients(inputs: RooflineInputs) -> StepTimeModel:
    """c0..c4 from peak bandwidth and FLOPs: a lower bound on a real engine's step, labelled an estimate.

    c0 = weight bytes / bandwidth   every step reads every weight once (memory-bound decode); a
                                    quantized checkpoint's bytes as stored (kvtune.weights)
    c1 = 2·active params / FLOPs    one multiply-add per parameter per token (compute-bound prefill):
                                    the quantized GEMMs at the GPU's peak in their dtype (FP8 W8A8
                                    on Hopper at the FP8 peak), the rest at the BF16 peak
    c2 = attention FLOPs per (query, key) pair / BF16 FLOPs
                                    QKᵀ and PV: 4·heads·head_dim per attending layer; what a long
                                    prefill chunk pays on top of its matmuls
    c3 = 0                          per-request bookkeeping has no roofline
    c4 = KV bytes per token / bandwidth
                                    each request's KV is read once per step, decoding (n = 1: c4·ctx)
                                    or a chunk (before c4, c2 charged a chunk's KV read once per
                                    token: 11.5 s for an 8,192-token chunk at 24k context)
    The terms add (memory then compute) instead of overlapping: up to 2× above the ideal roofline
    where both are equal, and close to it where one dominates, as in decode and long prefills.
    """
    bw = inputs.hbm_bandwidth_bytes_per_s
    tp = inputs.tensor_parallel_size
    fast = inputs.matmul_dense_flops or inputs.bf16_dense_flops
    quantized = inputs.quantized_active_parameters if inputs.matmul_dtype != "bf16" else 0
    seconds_per_token = 2 * ((inputs.active_parameters - quantized) / inputs.bf16_dense_flops + quantized / fast)
    return StepTimeModel(
        c0=inputs.weights_bytes_per_gpu / bw,
        c1=seconds_per_token / tp,
        c2=inputs.attention_flops_per_pair / (tp * inputs.bf16_dense_flops),
        c3=0.0,
        c4=inputs.kv_bytes_per_token_per_gpu / bw,
        source=TimingSource.ROOFLINE,
    )


def matmul_dtype(spec: ModelSpec, gpu: Gpu) -> str:
    """The dtype a checkpoint's quantized GEMMs run in on `gpu`: its activation dtype where the GPU
    has that tensor path (vLLM's W8A8 FP8/INT8 and NVFP4 kernels), else bf16 (weight-only formats,
    and W8A8 FP8 on Ampere, which vLLM serves through weight-only Marlin kernels)."""
    scheme = quantization_of(spec)
    activations = None if scheme is None else scheme.activations
    if activations is not None and gpu.peak_dense_flops(activations) is not None:
        return activations
    return "bf16"


def roofline_step_time(spec: ModelSpec, gpu: Gpu, *, tp: int = 1, kv_cache_dtype: str = "auto"
                       ) -> tuple[StepTimeModel, RooflineInputs]:
    """The roofline estimate for `spec` on `tp` GPUs of kind `gpu`, and what it was computed from."""
    if gpu.bf16_dense_flops is None:
        raise CapacityError(f"no peak BF16 FLOPs on record for {gpu.name}, so no roofline step time; "
                            "calibrate one with `kvtune calibrate URL --timing`", field="gpu")
    active, quantized = active_parameters(spec)
    dtype = matmul_dtype(spec, gpu)
    weights = weights_for(spec)
    inputs = RooflineInputs(
        gpu=gpu.name,
        tensor_parallel_size=tp,
        hbm_bandwidth_bytes_per_s=gpu.hbm_bandwidth_bytes_per_s,
        bf16_dense_flops=gpu.bf16_dense_flops,
        weights_bytes_per_gpu=weights.bytes_per_gpu(tp),
        kv_bytes_per_token_per_gpu=kv_bytes(spec, kv_cache_dtype=kv_cache_dtype, tp=tp).kv_bytes_per_token_per_gpu,
        active_parameters=active,
        quantized_active_parameters=quantized,
        matmul_dtype=dtype,
        matmul_dense_flops=gpu.peak_dense_flops(dtype),
        weight_format=weights.weight_format,
        attention_flops_per_pair=4 * spec.attention.num_heads * spec.attention.head_dim * sum(
            kind in _ATTENDING for kind in spec.layer_kinds),
    )
    return roofline_coefficients(inputs), inputs


_ATTENDING = {LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED, LayerKind.MLA}


__all__ = [
    "COEFFICIENTS",
    "COEFFICIENT_UNITS",
    "FORMULA",
    "SWEEPS",
    "BATCHED_TOKENS_FROM",
    "TimingSource",
    "StepTimeModel",
    "step_features",
    "prefill_chunks",
    "lone_prefill_features",
    "decode_features",
    "wave_decode_features",
    "Observation",
    "FitError",
    "StepTimeFit",
    "nnls",
    "fit_step_time",
    "fit_errors",
    "fit_frontend",
    "decode_weighted_features",
    "FITTED",
    "FRONTEND_TERMS",
    "FRONTEND_UNITS",
    "FrontEndModel",
    "ServerCheck",
    "SweepReport",
    "MeasuredAgainst",
    "Timing",
    "RooflineInputs",
    "roofline_coefficients",
    "roofline_step_time",
    "matmul_dtype",
]
