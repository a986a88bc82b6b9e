"""`kvtune simulate` and `recommend --objective` without a live server (issue 27 item 3): the pool
from kvtune's own capacity estimate or a size the user knows, `kvtune capacity --json` as a
capacity file, the logs' arrival rate as the default load, and one-line refusals of options
that mean nothing together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtune.cli import cli

ROOT = Path(__file__).parents[2]
CHAT = str(ROOT / "sample_logs" / "openai_chat_pairs.jsonl")  # 2,400 rows at 3.34 req/s
DATA = Path(__file__).parents[1] / "data"
CPU_CAPACITY = str(DATA / "capacity-cpu-0.32-timing.json")
MODEL, GPU = "llama-3.1-8b", "H100-80GB"


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def run_json(*args: str) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def capacity_json(*args: str) -> dict:
    return run_json("capacity", MODEL, "--gpu", GPU, *args)


def test_simulate_runs_on_kvtunes_capacity_estimate():
    """No capacity file: the pool is `kvtune capacity`'s for the same options, each setting says
    where it came from, the step time is silicon data for that GPU and tensor-parallel size."""
    for tp in ("1", "2"):
        expected = capacity_json("--tp", tp)
        data = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--tp", tp, "--rate", "3",
                        "--requests", "40")
        engine = data["simulation"]["engine"]
        assert engine["num_blocks"] == {"value": expected["num_blocks"], "from": "estimate"}
        assert engine["block_size"] == {"value": 16, "from": "engine-default"}
        assert engine["max_model_len"] == {"value": expected["max_model_len"], "from": "engine-default"}
        assert engine["max_num_seqs"]["from"] == "engine-default"
        capacity = data["simulation"]["capacity"]
        assert capacity["from"] == "estimate" and capacity["file"] is None
        assert capacity["tensor_parallel_size"] == int(tp) and capacity["gpu"] == GPU
        assert capacity["kv_cache_tokens"] == expected["kv_cache_tokens"]
        assert data["simulation"]["timing"]["source"] == "silicon"  # the H100's aiconfigurator data (was the roofline)
        assert data["simulation"]["timing"]["silicon"]["tensor_parallel_size"] == int(tp)
        assert data["requests"]["completed"] == 40
    # the estimate's own settings change the pool as they change `kvtune capacity`'s
    fp8 = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--kv-cache-dtype", "fp8",
                   "--gpu-memory-utilization", "0.8", "--max-model-len", "32k", "--engine-version", "0.11.0",
                   "--rate", "3", "--requests", "10")
    expected = capacity_json("--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.8", "--max-model-len", "32k",
                             "--engine-version", "0.11.0")
    assert fp8["simulation"]["engine"]["num_blocks"]["value"] == expected["num_blocks"]
    assert fp8["simulation"]["engine"]["max_model_len"] == {"value": 32_000, "from": "option"}
    assert fp8["simulation"]["capacity"]["kv_cache_dtype"] == "fp8"
    assert fp8["simulation"]["capacity"]["engine_version"] == expected["engine_version"]


def test_a_known_pool_replaces_the_estimate():
    blocks = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--num-gpu-blocks", "5000", "--max-model-len",
                      "32k", "--rate", "3", "--requests", "20")
    assert blocks["simulation"]["engine"]["num_blocks"] == {"value": 5000, "from": "option"}
    assert blocks["server"]["num_blocks"] == 5000
    tokens = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--kv-tokens", "80k", "--max-model-len",
                      "16384", "--rate", "3", "--requests", "20")
    assert tokens["simulation"]["engine"]["num_blocks"] == {"value": 5000, "from": "option"}  # 80,000 / 16
    assert tokens["simulation"]["capacity"]["from"] == "option"


@pytest.mark.parametrize("args, message", [
    (["--capacity", CPU_CAPACITY, "--kv-tokens", "1000"],
     "Error: --kv-tokens: the capacity file holds the pool and the settings it was measured at"),
    (["--capacity", CPU_CAPACITY, "--num-gpu-blocks", "100"], "Error: --num-gpu-blocks: the capacity file holds"),
    (["--capacity", CPU_CAPACITY, "--kv-cache-dtype", "fp8"], "Error: --kv-cache-dtype: the capacity file holds"),
    (["--model", MODEL, "--gpu", GPU, "--kv-tokens", "1000", "--num-gpu-blocks", "100"],
     "Error: --num-gpu-blocks: give the pool once: --kv-tokens or --num-gpu-blocks"),
    (["--model", MODEL], "Error: --gpu: give --capacity FILE (`kvtune calibrate`, `kvtune capacity --json`), or "
                         "--model and --gpu"),
    (["--gpu", GPU], "Error: --model: give --capacity FILE"),
    (["--model", MODEL, "--gpu", GPU, "--engine", "sglang"], "Error: --engine: kvtune estimates vLLM's pool"),
    (["--model", MODEL, "--gpu", GPU, "--kv-tokens", "lots"], "Error: --kv-tokens: expected a positive integer"),
    (["--model", MODEL, "--gpu", GPU, "--num-gpu-blocks", "5000"],  # the model's 131,072-token context
     "Error: --max-model-len: 131,072 tokens need 8,192 blocks but only 4,999 are usable: vLLM refuses to start"),
])
def test_bad_combinations_are_one_line_and_exit_2(tmp_path, args, message):
    out = tmp_path / "out"
    r = run("simulate", CHAT, *args, "--rate", "3", "--requests", "5", "--out", str(out))
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.output
    assert not out.exists()


def test_capacity_json_is_a_capacity_file(tmp_path):
    """`kvtune capacity … --json > cap.json` is a --capacity FILE for simulate, capacity and
    recommend, and reads back to the same pool."""
    cap = tmp_path / "cap.json"
    written = capacity_json("--tp", "2", "--max-model-len", "32768")
    cap.write_text(json.dumps(written))
    data = run_json("simulate", CHAT, "--capacity", str(cap), "--model", MODEL, "--gpu", GPU,
                    "--rate", "3", "--requests", "20")  # the step time at the file's --tp 2
    engine = data["simulation"]["engine"]
    assert engine["num_blocks"] == {"value": written["num_blocks"], "from": "capacity-file"}
    assert engine["max_model_len"] == {"value": 32768, "from": "capacity-file"}
    assert data["simulation"]["capacity"] == {"from": "capacity-file", "file": str(cap)}
    assert data["simulation"]["timing"]["silicon"]["tensor_parallel_size"] == 2
    other = run("simulate", CHAT, "--capacity", str(cap), "--model", MODEL, "--gpu", GPU, "--tp", "4", "--rate", "3",
                "--requests", "20")
    assert other.exit_code == 2 and other.output.strip().splitlines() == [
        "Error: --tp: the capacity file's pool is per GPU at tensor-parallel size 2, not 4: leave --tp out, or write "
        "the file again with --tp 4"]
    again = run_json("capacity", MODEL, "--gpu", GPU, "--tp", "2", "--capacity", str(cap))
    for key in ("num_blocks", "block_size", "kv_cache_tokens", "max_model_len", "kv_cache_dtype"):
        assert again[key] == written[key], key
    # a calibrated file keeps its timing through `kvtune capacity --capacity FILE --json`
    calibrated = tmp_path / "calibrated.json"
    calibrated.write_text(json.dumps(run_json("capacity", MODEL, "--capacity", CPU_CAPACITY)))
    a = run_json("simulate", CHAT, "--capacity", str(calibrated), "--rate", "2", "--requests", "20")
    b = run_json("simulate", CHAT, "--capacity", CPU_CAPACITY, "--rate", "2", "--requests", "20")
    assert a["simulation"]["timing"] == b["simulation"]["timing"]
    assert a["latency_ms"] == b["latency_ms"] and a["server"] == b["server"]


def test_the_default_load_is_the_logs_arrival_rate(tmp_path):
    data = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--requests", "30")
    load = data["load"]
    assert load["kind"] == "poisson" and load["from"] == "logs" and load["concurrency"] is None
    assert load["rate_rps"] == pytest.approx(3.344938, rel=1e-6)  # 2,400 rows over their timestamps' span
    table = run("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--requests", "30")
    assert "Load: Poisson arrivals at 3.345 req/s (the logs' mean arrival rate), 30 requests." in table.stdout
    given = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--concurrency", "4", "--requests", "30")
    assert given["load"]["from"] == "option" and given["load"]["concurrency"] == 4
    # logs without timestamps: said on stderr, in the JSON and in the table, never silently
    log = tmp_path / "no-times.jsonl"
    log.write_text("".join(json.dumps({"route": "chat", "prompt_tokens": 100 + i, "output_tokens": 20 + i}) + "\n"
                           for i in range(50)))
    r = CliRunner().invoke(cli, ["simulate", str(log), "--model", MODEL, "--gpu", GPU, "--requests", "10", "--json"])
    assert r.exit_code == 0, r.output
    assert "note: the logs carry no timestamps to take an arrival rate from: simulating one client at a time" \
        in r.stderr
    load = json.loads(r.stdout)["load"]
    assert load["from"] == "default" and load["kind"] == "synchronous" and load["concurrency"] == 1
    table = run("simulate", str(log), "--model", MODEL, "--gpu", GPU, "--requests", "10")
    assert "Load: 1 concurrent client(s), closed loop (no timestamps in the logs, so one client at a time)" \
        in table.stdout


def test_recommend_objective_runs_on_the_same_estimate_as_simulate():
    """recommend --objective without --capacity simulates the pool simulate estimates for the same
    options (and a --num-gpu-blocks pool), instead of refusing."""
    args = ("--model", MODEL, "--gpu", GPU, "--tp", "2", "--objective", "throughput", "--requests", "20")
    rec = run_json("recommend", CHAT, *args)["recommendation"]
    sim = run_json("simulate", CHAT, "--model", MODEL, "--gpu", GPU, "--tp", "2", "--requests", "20")
    basis = rec["objective"]["simulator"]["engine"]
    engine = sim["simulation"]["engine"]
    for key in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        assert basis[key] == engine[key]["value"], key
    assert rec["objective"]["load"] == {"rate_rps": sim["load"]["rate_rps"], "concurrency": None, "from": "logs"}
    timing = rec["objective"]["simulator"]["timing"]
    assert timing["source"] == "silicon"
    assert {k: timing[k] for k in ("c0", "c1", "c2", "c3", "c4", "mixed_step_s", "largest_graph_tokens", "past_knee_s",
                                   "knee_tokens")} == sim["simulation"]["timing"]["coefficients"]
    assert timing["mixed_step_s"] == sim["simulation"]["timing"]["dispatch"]["mixed_step_s"] > 0  # vLLM's dispatch
    known = run_json("recommend", CHAT, *args, "--num-gpu-blocks", "6000", "--max-model-len", "32k")["recommendation"]
    assert known["objective"]["simulator"]["engine"]["num_blocks"] == 6000
    assert known["capacity"]["num_blocks"] == 6000
    no_gpu = run("recommend", CHAT, "--model", MODEL, "--gpu-memory", "80GB", "--objective", "throughput")
    assert no_gpu.exit_code == 2
    assert no_gpu.output.strip().splitlines()[-1].startswith(
        "Error: --gpu: an objective without a capacity file is simulated on the roofline step time of a catalog GPU")


def test_a_saturated_long_prompt_trace_gives_the_queue_its_step_time_implies(tmp_path):
    """100 requests of 32,000 prompt tokens at once (the published Qwen3-14B H100 run's shape),
    with a step time given: the simulator's own queueing, chunking and pool (8 fit at a time)
    give the figures the step time implies, neither more nor less: every prompt's prefill is
    served in 8,192-token chunks one after another, so the run lasts at least the prefills' sum
    and TTFT's median sits near half of it. (The absurd `ttft p50 1,589,028 ms` of issue 27 was
    the roofline's step time charging a chunk's KV read per token; its fix is the step model's.)"""
    from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, write_capacity_file
    from kvtune.capacity.timing import FitError, MeasuredAgainst, SweepReport, Timing
    from kvtune.domain.step_time import StepTimeModel

    c0, c1 = 0.02, 5.8e-5  # 1.86 s per 32k-token prefill, as aiconfigurator-core prices it on an H100
    sweep = SweepReport(name="decode", requests=1, completed=1, prompt_tokens=(32, 32), output_tokens=(8, 8),
                        concurrency=(1,), wall_s=1.0, error=FitError(1, 0.0, 0.0, 0.0), client_mean_s=0.0)
    against = MeasuredAgainst(url="http://127.0.0.1:8000", model="qwen3-14b", max_model_len=40960, block_size=16,
                              num_blocks=16270, kv_cache_dtype="auto", max_num_batched_tokens=8192,
                              max_num_batched_tokens_from="engine-default")
    timing = Timing(StepTimeModel(c0, c1, 0.0, 0.0), 0.0, (sweep,), against, 1.0, 1.0, "0")
    cap = tmp_path / "cap.json"
    write_capacity_file(cap, MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=16270, block_size=16,
                                              max_model_len=40960, device="GPU", timing=timing))
    log = tmp_path / "long.jsonl"
    log.write_text("".join(json.dumps({"route": "chat", "prompt_tokens": 32_000, "output_tokens": 100,
                                       "timestamp_s": 1_700_000_000 + i / 100}) + "\n" for i in range(100)))
    data = run_json("simulate", str(log), "--capacity", str(cap), "--requests", "100")
    assert data["load"]["from"] == "logs" and data["load"]["rate_rps"] > 99  # all within a second
    assert data["requests"]["completed"] == 100 and data["server"]["preemptions"] == 0
    assert data["server"]["running_peak"] == 8  # 16,269 blocks hold 8 of 2,007
    prefill_s = 100 * (32_000 * c1 + 4 * c0)  # 4 chunks each, none shared
    # the engine is never idle once the requests are in (sent within 1 s): the run is its steps
    busy_s = c1 * (100 * 32_000 + 100 * 99) + c0 * data["simulation"]["steps"]  # the 100th token is not fed
    assert busy_s - 0.001 <= data["duration_s"] <= busy_s + 1.0  # duration_s is rounded to ms
    assert prefill_s <= data["duration_s"]
    ttft = data["latency_ms"]["ttft"]
    assert 0.4 * prefill_s <= ttft["p50"] / 1000 <= 0.6 * prefill_s
    assert ttft["p99"] / 1000 <= data["duration_s"]
    tpot = data["latency_ms"]["tpot"]
    assert c0 * 1000 <= tpot["p50"] <= (c0 + 8192 * c1) * 1000  # between a decode step and a chunk step
