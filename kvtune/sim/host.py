"""vLLM's host-side work around the GPU forward pass, which silicon data and the roofline leave out.

aiconfigurator's step latency is the sum of measured GPU kernels; the roofline is the GPU's
arithmetic. Neither has the Python that runs each step on the host: the engine core's
`scheduler.schedule()` and `update_from_output()`, the worker's input preparation
(`_prepare_inputs`: positions, block tables, slot mappings for every scheduled request) and the
sampler's bookkeeping. That code is the same on the CPU build as on a GPU host, so its cost is
measured on vLLM 0.32.0's CPU build (benchmarks/host_overheads.py): CPU seconds of the engine-core
process per step while B chat streams decode (B = 16 … 512), `sequence_s` per running sequence
per step (VLLM_ENGINE_HOST below says what the figure holds and what it leaves out).

Whether it adds to a step depends on the release (`adds_to_step`): vLLM ran scheduling and the
forward pass one after the other (EngineCore.step: schedule, execute_model, update_from_output)
until async scheduling became the default (FIRST_ASYNC_SCHEDULING_VERSION; 0.32's
vllm/config/vllm.py turns it on unless an incompatible option is set, and EngineCore then steps
with a batch queue); with it the scheduler prepares step n + 1 while the GPU runs step n, so the
host work hides behind the forward pass (as long as it is shorter, which at these sizes it is:
512 sequences × 6.9 µs = 3.5 ms against tens of ms) and is not added.

A second host cost is the launch of the model itself: a step vLLM cannot replay as one CUDA graph
(some request computes more than one token, or it has more tokens than the largest graph) runs
piecewise or eagerly, dispatched layer by layer. It could
not be measured here (the CPU build has no CUDA graphs); its figure is aiconfigurator-core's,
calibrated on measured vLLM runs (VLLM_DISPATCH_PER_LAYER_S below), and it is added whatever the
release.

Scaling a CPU measurement here to a GPU host: the assumption is one server core is no slower than
one core of this shared 2-core machine, so the figures are upper bounds of the same Python's cost;
CPU time (not wall time) is measured, so the other engineers' load on the machine does not enter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvtune.domain.step_time import StepTimeModel
from kvtune.errors import OptionError

# the first vLLM release whose scheduler overlaps the forward pass by default: vllm PR #27614
# ("[Core] Enable async scheduling by default", opened 2025-10-27) came after 0.11.0 (2025-10-02);
# 0.32.0's vllm/config/vllm.py sets async_scheduling when it is None. Whether 0.11.1/0.11.2 carry it
# was not checked here; kvtune counts from 0.12.
FIRST_ASYNC_SCHEDULING_VERSION = (0, 12)


@dataclass(frozen=True, slots=True)
class HostWork:
    """The engine's host-side work per step: `step_s` per step, `sequence_s` per running sequence."""

    step_s: float
    sequence_s: float

    def __post_init__(self) -> None:
        for name in ("step_s", "sequence_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise OptionError(f"must be a finite number of seconds in [0, 1], got {value}", field=name)

    def to_dict(self) -> dict[str, float]:
        return {"step_s": self.step_s, "sequence_s": self.sequence_s}


# benchmarks/host_overheads.py on vLLM 0.32.0 (CPU build), kvtune's 2-core test machine, 2026-12-07:
# the engine-core process's CPU time = step_s·steps + sequence_s·steps·B, non-negative least squares
# over 24 bursts (B = 16, 128, 512 chat streams; 4 and 64 tokens; 1- and 4-layer models) gives
# 2.04 ms per step + 6.9 µs per running sequence. Only the per-sequence part is used: the engine
# core busy-polls the worker's shared-memory queue while the forward pass runs, so its CPU time per
# step also counts the wait (1.5–2.9 ms per step across fits, larger with the deeper model), which
# on a GPU host is the GPU's time, already priced. The per-sequence figure ranges 0–15 µs across
# fits of the same bursts (noisy at /proc's 10 ms resolution): it is a measured order, not a digit.
# The worker's own host work (_prepare_inputs, sampler bookkeeping) is not in it: the CPU worker's
# time is its forward pass and OpenMP threads spinning (a 4-layer model cost less than a 1-layer one
# at B = 512), so it cannot be separated here.
VLLM_ENGINE_HOST = HostWork(step_s=0.0, sequence_s=6.9e-6)
VLLM_ENGINE_HOST_SOURCE = ("benchmarks/host_overheads.py on vLLM 0.32.0's engine core (CPU build, CPU time "
                           "per step and running sequence, 16-512 chat streams, 2026-12-07), not this deployment's")


# A step vLLM cannot replay as one CUDA graph (any step where some request computes more than one
# token: a prefill chunk beside the decodes) runs piecewise, its host launching the model layer by
# layer: vLLM 0.11.0's default cudagraph_mode FULL_AND_PIECEWISE (vllm/config/compilation.py:233-250)
# replays a full graph only for a uniform decode, longest query 1 token and one token per request
# (vllm/v1/worker/gpu_model_runner.py:2271-2278). aiconfigurator-core 0.12.0
# names this cost and prices it: sdk/backends/vllm_backend.py, `_prefill_dispatch_overhead_ms` =
# 0.8 ms × the model's layers, "CPU-side dispatch overhead ... not captured in silicon benchmarks.
# Recalibrated at ~0.8ms/layer against the full silicon corpus across hardware platforms and model
# families" (NVIDIA's measured vLLM runs, not the published runs kvtune is validated on), added to
# each request's prefill in its TTFT. kvtune adds it to each such step of the engine instead: the
# host's dispatch holds the step, so the decodes beside a prefill wait for it too, as the published
# runs' inter-token p99 at concurrency 4-8 shows (41-45 ms against 7.4 ms at the median, gpustack's
# Qwen3-8B on an H100). It is added whatever the release: aiconfigurator's corpus spans releases with
# and without async scheduling and has one figure for all. SGLang and TensorRT-LLM get none
# (aiconfigurator's backends for them add none).
VLLM_DISPATCH_PER_LAYER_S = 0.8e-3
VLLM_DISPATCH_SOURCE = ("aiconfigurator-core's vLLM backend (`_prefill_dispatch_overhead_ms`: 0.8 ms per layer, "
                        "calibrated by NVIDIA on its measured vLLM runs), per step not replayed as one CUDA graph")


# The most tokens a step vLLM replays as one CUDA graph: a larger one runs eagerly, every kernel
# launched from the host, so it pays the dispatch too (aiconfigurator's figure for a piecewise step,
# applied to an eager one, which launches at least as much). vLLM 0.11.0 captures sizes up to
# min(2 × max_num_seqs, 512) (vllm/config/scheduler.py:222-227, vllm/config/__init__.py:589-613) and
# runs a larger batch without graphs (v1/cudagraph_dispatcher.py: no key, CUDAGraphMode.NONE); a
# uniform decode batch holds at most max_num_seqs < 2 × max_num_seqs tokens, so only the 512 binds.
# Data-center Blackwell (compute capability 10.x) captures up to 1,024 since vllm PR #49390 (July
# 2026), in 0.32.0's vllm/config/vllm.py (`_set_cudagraph_sizes`); kvtune counts it from 0.32, the
# release whose source it read (the releases between the PR and 0.32 were not checked).
VLLM_LARGEST_CUDA_GRAPH = 512
VLLM_LARGEST_CUDA_GRAPH_BLACKWELL = 1024
FIRST_BLACKWELL_1024_VERSION = (0, 32)
DATACENTER_BLACKWELL = frozenset({"B200", "B300", "GB200", "GB300"})  # kvtune's catalog names, compute 10.x


def largest_cuda_graph(gpu_name: str | None, version: tuple[int, ...] | None) -> int:
    """The most tokens vLLM `version` (None: the current one) replays as one CUDA graph on `gpu_name`."""
    newer = version is None or version >= FIRST_BLACKWELL_1024_VERSION
    return VLLM_LARGEST_CUDA_GRAPH_BLACKWELL if newer and gpu_name in DATACENTER_BLACKWELL else VLLM_LARGEST_CUDA_GRAPH


def with_dispatch(model: StepTimeModel, num_layers: int, largest_graph_tokens: int) -> StepTimeModel:
    """The step time with vLLM's per-layer dispatch added to every step it does not replay as one
    CUDA graph: one that is not a uniform decode, or one of more than `largest_graph_tokens`."""
    return replace(model, mixed_step_s=model.mixed_step_s + num_layers * VLLM_DISPATCH_PER_LAYER_S,
                   largest_graph_tokens=largest_graph_tokens)


def adds_to_step(version: tuple[int, ...] | None) -> bool:
    """Whether vLLM `version` (None: the current one) runs its host work between forward passes."""
    return version is not None and version < FIRST_ASYNC_SCHEDULING_VERSION


def with_host_work(model: StepTimeModel, host: HostWork) -> StepTimeModel:
    """The step time with the host work added: `step_s` to c0, `sequence_s` to c3 (per request in the batch)."""
    return replace(model, c0=model.c0 + host.step_s, c3=model.c3 + host.sequence_s)


__all__ = ["HostWork", "VLLM_ENGINE_HOST", "VLLM_ENGINE_HOST_SOURCE", "FIRST_ASYNC_SCHEDULING_VERSION",
           "VLLM_DISPATCH_PER_LAYER_S", "VLLM_DISPATCH_SOURCE", "VLLM_LARGEST_CUDA_GRAPH", "largest_cuda_graph",
           "adds_to_step", "with_dispatch", "with_host_work"]
