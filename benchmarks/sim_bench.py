"""Benchmark kvtune.sim: the Azure conversation trace and a million requests, against the step-by-step peer.

Targets (issue 12): the whole Azure conversation trace (19,366 requests; ContextTokens as prompt,
GeneratedTokens as output, arrivals from TIMESTAMP) on a 28,760-block × 16-token pool in ≤ 3 s on
one core; 1 M requests in ≤ 60 s. The 1 M requests are synthetic: (prompt, output) pairs drawn
with replacement from the same trace, Poisson arrivals at the trace's mean rate (seeded).

The peer, measured in the same run: the simulator's own step-by-step reference (`fast=False`,
every engine step through the scheduler, which is what a per-step simulator does) on the first
--peer-requests of the trace, next to the fast path on the same slice; both must agree exactly.
Each figure is the median of --repeat runs. The step-time model is an illustrative GPU-like one
(6 ms + 20 µs/token + 2 ns/token·ctx + 30 µs/seq), not a calibration.

    python benchmarks/sim_bench.py --repeat 3
    python benchmarks/sim_bench.py --engines --repeat 3   # the trace under each engine's rule
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kvtune.domain.step_time import StepTimeModel
from kvtune.sim import EngineSettings, SimResult, Workload, simulate
from kvtune.sim.rules import ENGINE_RULES, EngineRule

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
ENGINE = EngineSettings(num_blocks=28_760, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192,
                        max_model_len=16_384)
TIMING = StepTimeModel(c0=0.006, c1=2e-5, c2=2e-9, c3=3e-5)


def load_trace(path: Path) -> Workload:
    import pandas as pd

    df = pd.read_csv(path)
    ts = pd.to_datetime(df["TIMESTAMP"])
    arrival = (ts - ts.min()).dt.total_seconds().to_numpy()
    return Workload.from_columns(arrival, df["ContextTokens"].to_numpy(), df["GeneratedTokens"].to_numpy())


def synthetic(trace: Workload, n: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(trace), n)
    rate = len(trace) / float(trace.arrival_s.max())
    return Workload.from_columns(np.cumsum(rng.exponential(1 / rate, n)), trace.prompt_tokens[pick],
                                 trace.output_tokens[pick])


def head(wl: Workload, n: int) -> Workload:
    return Workload(wl.arrival_s[:n], wl.prompt_tokens[:n], wl.output_tokens[:n], wl.max_tokens[:n])


def measure(wl: Workload, repeat: int, *, fast: bool = True,
            engine: EngineRule = None) -> tuple[float, float, SimResult]:
    """Median wall and CPU seconds: on a shared machine CPU time is what one core spent."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        result = simulate(wl, ENGINE, TIMING, fast=fast, engine=engine)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    assert result is not None
    return statistics.median(walls), statistics.median(cpus), result


def row(name: str, wl: Workload, wall: float, cpu: float, r: SimResult) -> str:
    return (f"{name:<34} {len(wl):>9,} {wall:>8.2f} {cpu:>7.2f} {r.events:>10,} {r.events / cpu:>10,.0f} "
            f"{r.num_steps:>11,} {r.preemptions:>7,} {r.running_peak:>5} {r.kv_usage_peak:>6.1%}")


def same(a: SimResult, b: SimResult) -> bool:
    cols = ("first_scheduled_s", "first_token_s", "finish_s", "output_tokens", "preemptions")
    return all(np.array_equal(getattr(a.requests, c), getattr(b.requests, c), equal_nan=True) for c in cols) \
        and a.num_steps == b.num_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=1_000_000, help="synthetic workload size")
    ap.add_argument("--peer-requests", type=int, default=2_000, help="trace slice the step-by-step peer runs")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", action="store_true",
                    help="time the trace (and 8× its arrival rate) under each engine's rule instead")
    args = ap.parse_args()

    trace = load_trace(args.trace)
    if args.engines:
        engines(trace, args)
        return
    print(f"engine: {ENGINE.num_blocks:,} blocks × {ENGINE.block_size}, max_num_seqs {ENGINE.max_num_seqs}, "
          f"max_num_batched_tokens {ENGINE.max_num_batched_tokens}; timing {TIMING}; median of {args.repeat}")
    print(f"{'workload':<34} {'requests':>9} {'wall s':>8} {'cpu s':>7} {'events':>10} {'events/s':>10} "
          f"{'steps':>11} {'preempt':>7} {'run^':>5} {'KV^':>6}   (events/s per CPU second)")
    wall, cpu, r = measure(trace, args.repeat)
    print(row("Azure conv (fast)", trace, wall, cpu, r), "  target ≤ 3 s:", "met" if wall <= 3 else "MISSED")

    squeezed = Workload(trace.arrival_s / 8, trace.prompt_tokens, trace.output_tokens, trace.max_tokens)
    wall8, cpu8, r8 = measure(squeezed, args.repeat)
    print(row("Azure conv, arrivals 8× (fast)", squeezed, wall8, cpu8, r8))

    peer_wl = head(trace, args.peer_requests)
    peer_wall, peer_cpu, peer = measure(peer_wl, args.repeat, fast=False)
    fast_wall, fast_cpu, fast = measure(peer_wl, args.repeat)
    print(row(f"peer: first {len(peer_wl):,}, step by step", peer_wl, peer_wall, peer_cpu, peer))
    print(row(f"      first {len(peer_wl):,}, fast", peer_wl, fast_wall, fast_cpu, fast),
          f"  fast/peer CPU {fast_cpu / peer_cpu:.3f} ({peer_cpu / fast_cpu:.1f}× faster), "
          f"identical: {same(peer, fast)}")

    big = synthetic(trace, args.requests, args.seed)
    wall_big, cpu_big, r_big = measure(big, args.repeat)
    print(row(f"synthetic {args.requests:,} (fast)", big, wall_big, cpu_big, r_big),
          "  target ≤ 60 s:", "met" if wall_big <= 60 else "MISSED", f"(CPU {cpu_big:.1f} s)")


def engines(trace: Workload, args: argparse.Namespace) -> None:
    """The Azure trace under each engine's rule (kvtune.sim.rules) on the same settings, and the
    fast path against the step-by-step one on the peer slice."""
    print(f"engine settings: {ENGINE}; timing {TIMING}; median of {args.repeat}")
    print(f"{'workload':<34} {'requests':>9} {'wall s':>8} {'cpu s':>7} {'events':>10} {'events/s':>10} "
          f"{'steps':>11} {'evict':>7} {'run^':>5} {'KV^':>6}")
    squeezed = Workload(trace.arrival_s / 8, trace.prompt_tokens, trace.output_tokens, trace.max_tokens)
    peer_wl = head(trace, args.peer_requests)
    for name, rule in ENGINE_RULES.items():
        wall, cpu, r = measure(trace, args.repeat, engine=rule)
        print(row(f"{name}: Azure conv", trace, wall, cpu, r))
        wall8, cpu8, r8 = measure(squeezed, args.repeat, engine=rule)
        print(row(f"{name}: Azure conv, arrivals 8×", squeezed, wall8, cpu8, r8))
        _, peer_cpu, peer = measure(peer_wl, 1, fast=False, engine=rule)
        _, fast_cpu, fast = measure(peer_wl, 1, engine=rule)
        print(f"{'':<34} first {len(peer_wl):,}: step by step {peer_cpu:.2f} s CPU, fast {fast_cpu:.2f} s, "
              f"identical: {same(peer, fast)}")


if __name__ == "__main__":
    main()
