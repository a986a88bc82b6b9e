"""`recommend --objective` over several engine replicas (one capacity file each, as `kvtune
calibrate` writes them): every row simulated on the whole deployment, each replica with its own
budget and engine limits, the totals the sums of the replicas' figures, and files that pass check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from objective_logs import CPU_CAPACITY, MODEL, objective_log

import kvtune
from kvtune.cli import cli
from kvtune.domain.recommendation import Recommendation
from kvtune.policy import rules
from kvtune.policy.recommendation import read_recommendation
from kvtune.policy.replica_search import interleave, split_clients, split_draws


def replica_file(directory: Path, name: str, num_blocks: int, port: int, **extra) -> str:
    """The CPU test bed's calibrated capacity file (32 blocks of 128 tokens, its step time) as a
    replica with `num_blocks` blocks: its pool and reported tokens scaled with them."""
    doc = json.loads(Path(CPU_CAPACITY).read_text())
    scale = num_blocks / doc["num_blocks"]
    doc.update(num_blocks=num_blocks, kv_cache_tokens=num_blocks * doc["block_size"],
               kv_cache_memory_bytes=int(doc["kv_cache_memory_bytes"] * scale),
               max_concurrency=doc["max_concurrency"] * scale, origin=f"http://127.0.0.1:{port}", **extra)
    path = directory / name
    path.write_text(json.dumps(doc))
    return str(path)


def slower(factor: float) -> dict:
    """The test bed's calibrated step time, every coefficient `factor` times larger."""
    timing = json.loads(Path(CPU_CAPACITY).read_text())["timing"]
    timing["coefficients"] = {k: v * factor for k, v in timing["coefficients"].items()}
    return timing


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("replicas")
    return {"log": objective_log(d / "log.jsonl"),
            "small": replica_file(d, "small.json", 32, 8000), "large": replica_file(d, "large.json", 64, 8001),
            "twin": replica_file(d, "twin.json", 32, 8001),
            "slow": replica_file(d, "slow.json", 64, 8001, timing=slower(3.0)),
            "other": replica_file(d, "other.json", 64, 8001, model="another-model"),
            "short": replica_file(d, "short.json", 64, 8001, max_model_len=256)}


def searched(files, *names: str, **kwargs) -> Recommendation:
    """The recommendation kvtune.api makes for one engine replica per named capacity file (the
    first the smallest), each upstream with its budget (kvtune.policy.replicas.per_replica)."""
    profile = kvtune.profile_logs([files["log"]])
    kwargs.setdefault("concurrency", 32)
    return kvtune.recommend(profile, kvtune.Deployment(MODEL, replicas=len(names)),
                            objective=kvtune.Objective("throughput", requests=300, max_preemption_rate=0.01, **kwargs),
                            measured=kvtune.Measurement(capacity_files=tuple(files[n] for n in names)))


@pytest.fixture(scope="module")
def two(files) -> Recommendation:
    return searched(files, "small", "large")


def test_the_split_follows_the_weights():
    replica = interleave([1, 2], 9)
    assert replica.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1]  # spread evenly, in proportion
    assert np.bincount(interleave([31, 63], 9400)).tolist() == [3100, 6300]
    assert split_clients(32, [31 / 94, 63 / 94]) == [11, 21]
    assert split_clients(1, [0.5, 0.5]) == [1, 0]


def test_each_replica_gets_its_own_budget_and_engine_limits(two):
    chosen = two.chosen
    assert chosen is not None and len(chosen.replicas) == 2
    small, large = chosen.replicas
    safety = chosen.safety_fraction
    assert safety is not None
    assert small.budget_blocks == rules.block_budget(32, safety).tokens
    assert large.budget_blocks == rules.block_budget(64, safety).tokens
    assert large.budget_blocks > small.budget_blocks
    assert large.max_num_seqs > small.max_num_seqs  # each engine runs what its own budget admits
    # the top level is the smallest replica's, which the launch file runs
    assert two.budget_blocks == small.budget_blocks and two.setting("max_num_seqs").tokens == small.max_num_seqs
    assert chosen.budget_blocks == small.budget_blocks + large.budget_blocks
    # 32 clients over 31 and 63 usable blocks
    assert (small.share, large.share) == (11 / 32, 21 / 32)
    assert [u.block_budget for u in two.upstreams] == [small.budget_blocks, large.budget_blocks]
    assert [u.max_num_seqs for u in two.upstreams] == [small.max_num_seqs, large.max_num_seqs]
    assert [u.predicted for u in two.upstreams] == [small.predicted, large.predicted]
    assert any("each on its share of the load" in n for n in two.notes)


def test_every_rows_total_is_the_sum_of_its_replicas(two):
    for row in two.what_if or ():
        assert len(row.replicas) == 2, row.label
        parts = [r.predicted for r in row.replicas]
        total = row.predicted
        assert total.output_tokens_per_s == pytest.approx(sum(p.output_tokens_per_s for p in parts), abs=0.01)
        assert total.requests_per_s == pytest.approx(sum(p.requests_per_s for p in parts), abs=0.01)
        assert total.sent == sum(p.sent for p in parts) and total.completed == sum(p.completed for p in parts)
        preempted = sum(p.preemption_rate * p.sent for p in parts)
        refused = sum(p.share_429 * p.sent for p in parts)
        assert total.preemption_rate * total.sent == pytest.approx(preempted, abs=0.01 * total.sent / 100 + 1e-3)
        assert total.share_429 * total.sent == pytest.approx(refused, abs=0.01 * total.sent / 100 + 1e-3)
        assert total.ttft_p99_ms is None or total.ttft_p99_ms <= max(p.ttft_p99_ms or 0 for p in parts) + 1e-3


@pytest.mark.parametrize("load", [{"rate_rps": 150.0}, {"concurrency": 3}])
def test_open_loop_and_few_clients_add_up_too(files, load):
    rec = searched(files, "small", "large", **{"concurrency": None, **load})
    row = rec.chosen
    parts = [r.predicted for r in row.replicas]
    assert row.predicted.output_tokens_per_s == pytest.approx(sum(p.output_tokens_per_s for p in parts), abs=0.01)
    assert row.predicted.sent == sum(p.sent for p in parts) == 900  # 300 requests x 3 seeds, each sent once
    if "concurrency" in load:
        assert [r.share for r in row.replicas] == [round(1 / 3, 6), round(2 / 3, 6)]  # 3 clients: 1 and 2
    else:
        assert [round(r.share, 3) for r in row.replicas] == [round(31 / 94, 3), round(63 / 94, 3)]


def test_a_slower_replica_shows_in_its_own_figures(files):
    rec = searched(files, "small", "slow")
    fast, slow = rec.chosen.replicas
    # the slow replica has twice the blocks and two thirds of the load, at a third of the speed
    assert slow.budget_blocks > fast.budget_blocks
    assert slow.predicted.e2e_p50_ms > 2 * fast.predicted.e2e_p50_ms
    assert rec.chosen.predicted.e2e_p99_ms <= max(fast.predicted.e2e_p99_ms, slow.predicted.e2e_p99_ms) + 1e-3


def test_the_document_reads_back_and_the_files_pass_check(two, tmp_path):
    doc = two.to_dict()
    assert [r["capacity_file"] for r in doc["objective"]["replicas"]] == [u.capacity_file for u in two.upstreams]
    assert all("replicas" in row for row in doc["what_if"])
    assert "predicted" in doc["upstreams"][1] and doc["upstreams"][1]["max_num_seqs"] == two.upstreams[1].max_num_seqs
    again = read_recommendation(json.loads(json.dumps(doc)))
    assert again.to_dict() == doc
    files = kvtune.render(two)  # held to `kvtune check`, which simulates both replicas again
    script = files["vllm-serve.sh"]
    large = two.upstreams[1]
    assert (f"#   http://127.0.0.1:8001 ({large.capacity_file}): ./vllm-serve.sh --host 127.0.0.1 --port 8001 "
            f"--kv-cache-memory-bytes {large.kv_cache_memory_bytes} --max-num-seqs {large.max_num_seqs}") in script
    report = files["report.md"]
    assert "### The chosen row on each engine replica" in report
    assert f"| {large.capacity_file} | 66% | {large.block_budget} | {large.max_num_seqs} |" in report
    assert "| deployment (total) | 100% |" in report
    assert "The chosen row on each engine replica" in files["report.html"]
    assert yaml.safe_load(files["gateway.yaml"])["upstreams"] == [
        {"url": u.url, "block_budget": u.block_budget} for u in two.upstreams]


def test_identical_replicas_get_identical_settings(files):
    rec = searched(files, "small", "twin")
    a, b = rec.chosen.replicas
    assert (a.budget_blocks, a.max_num_seqs, a.max_num_batched_tokens, a.share) == \
        (b.budget_blocks, b.max_num_seqs, b.max_num_batched_tokens, b.share)
    assert a.budget_blocks == rec.budget_blocks
    assert "--max-num-seqs" not in kvtune.render(rec, targets=["vllm-serve.sh"], check=False)["vllm-serve.sh"] \
        .split("replicas behind the gateway")[1].split("set -euo")[0]


def test_the_cli_shows_each_replica_and_the_deployment(files, tmp_path):
    out = tmp_path / "deploy"
    result = CliRunner(env={"COLUMNS": "220"}).invoke(cli, [
        "recommend", files["log"], "--model", MODEL, "--capacity", files["small"], "--capacity", files["large"],
        "--requests", "300", "--objective", "throughput", "--concurrency", "32", "--max-preemption-rate", "0",
        "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "each replica's simulated figures" in result.stdout
    assert "│ deployment" in result.stdout and "the sum" in result.stdout
    # guaranteed: nginx.conf is rendered too, and checked first (gateway.yaml's upstreams are simulated)
    checked = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--model", MODEL,
                                       "--deployed", str(out / "nginx.conf"), "--deployed", str(out / "gateway.yaml"),
                                       "--deployed", str(out / "vllm-serve.sh")])
    assert checked.exit_code == 0, checked.output
    # check simulates both replicas again, as the search did: the chosen row's total
    doc = json.loads((out / "recommendation.json").read_text())
    total = next(r for r in doc["what_if"] if r["chosen"])["predicted"]["output_tokens_per_s"]
    assert f"objective-met [{out / 'gateway.yaml'}]: simulated {total:,.1f} output tokens/s" in checked.output


@pytest.mark.parametrize("objective", [[], ["--objective", "throughput", "--concurrency", "32"]])
def test_a_replica_of_another_model_is_one_line_naming_its_file(files, tmp_path, objective):
    out = tmp_path / "deploy"
    result = CliRunner().invoke(cli, ["recommend", files["log"], "--model", MODEL, "--capacity", files["small"],
                                      "--capacity", files["other"], *objective, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {files['other']}: served model 'another-model', but {files['small']} measured 'tiny': "
        "every replica behind one gateway serves the same model the same way; calibrate the replicas of this "
        "deployment"]
    assert not out.exists()


def test_a_replica_too_short_for_the_deployment_is_one_line_before_any_simulation(files, tmp_path):
    out = tmp_path / "deploy"
    result = CliRunner().invoke(cli, ["recommend", files["log"], "--model", MODEL, "--capacity", files["small"],
                                      "--capacity", files["short"], "--objective", "throughput", "--concurrency", "8",
                                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {files['short']}: --max-model-len: this replica holds 256 tokens of context, below the "
        "--max-model-len 512 every replica runs at: give it more KV memory or lower --max-model-len"]
    assert not out.exists()


def _recommend_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["recommend", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("objective", [[], ["--objective", "throughput", "--concurrency", "16", "--requests", "200"]])
def test_replicas_n_with_one_capacity_is_n_identical_capacity_files(files, tmp_path, objective):
    """The logs are the whole deployment's traffic: `--replicas 2 --capacity A` is two replicas of
    A, each simulated on its share of the load, exactly as `--capacity A --capacity A`."""
    doc = json.loads(Path(files["small"]).read_text())
    del doc["origin"]  # one file named twice is one server: without an origin, each on its own port
    a = tmp_path / "a.json"
    a.write_text(json.dumps(doc))
    head = [files["log"], "--model", MODEL, *objective]
    once = _recommend_json(*head, "--replicas", "2", "--capacity", str(a))
    twice = _recommend_json(*head, "--capacity", str(a), "--capacity", str(a))
    assert once == twice
    rec = once["recommendation"]
    assert [u["url"] for u in rec["upstreams"]] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert [u["capacity_file"] for u in rec["upstreams"]] == [str(a)] * 2
    if objective:  # every row on both replicas, each at half the load
        assert all([r["share"] for r in row["replicas"]] == [0.5, 0.5] for row in rec["what_if"])
        chosen = next(r for r in rec["what_if"] if r["chosen"])
        assert chosen["predicted"]["sent"] == sum(r["predicted"]["sent"] for r in chosen["replicas"]) == 600


def test_replicas_n_with_one_measured_capacity_takes_the_ports_not_its_origin(files):
    """One capacity file for N replicas names one server: the replicas are --upstream's ports."""
    rec = _recommend_json(files["log"], "--model", MODEL, "--replicas", "3", "--capacity", files["small"],
                          "--upstream", "http://10.0.0.5:9000")["recommendation"]
    assert [u["url"] for u in rec["upstreams"]] == [f"http://10.0.0.5:{9000 + i}" for i in range(3)]
    assert len({(u["block_budget"], u["max_num_seqs"], u["max_num_batched_tokens"]) for u in rec["upstreams"]}) == 1
    assert rec["upstreams"][0]["max_num_seqs"] == rec["settings"]["max_num_seqs"]["value"]


def test_interleave_is_deterministic_and_even_for_many_replicas():
    weights = np.random.default_rng(1).integers(30, 100, 256)
    order = interleave(weights, 100_000)
    assert np.array_equal(order, interleave(weights, 100_000))
    counts = np.bincount(order, minlength=256)
    assert counts.sum() == 100_000 and np.abs(counts - 100_000 * weights / weights.sum()).max() < 1
    assert np.array_equal(interleave([1, 0, 1], 5), [0, 2, 0, 2, 0])  # a replica without clients gets nothing
    assert interleave([3, 1], 0).size == 0


def test_split_draws_keeps_each_replicas_requests_in_order():
    from kvtune.policy.search import Draws

    n = 1000
    draws = Draws(tuple(f"/r{i % 7}" for i in range(n)), np.arange(n), np.arange(n) * 2, np.arange(n) / 10)
    replica = interleave([5, 3, 2], n)
    for i, part in enumerate(split_draws(draws, replica, 3)):
        mine = np.flatnonzero(replica == i)
        assert part.route == tuple(draws.route[j] for j in mine)
        assert np.array_equal(part.prompt, mine) and np.array_equal(part.output, 2 * mine)
        assert part.send_s is not None and np.array_equal(part.send_s, mine / 10)
