"""Per-group caps (`recommend --route-by FIELD --route-header NAME`) are enforced, or refused:
recommend renders one header route per group in gateway.yaml and nginx.conf, `check` reads them
back and catches a drifted group cap, both enforcers started from the rendered files cap each
group at its own cap; without a header that carries the group, recommend refuses in one line."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from enforcers import start_enforcer
from fake_vllm import FakeVllm

from kvtune.cli import cli
from kvtune.deploy.read import load_deployed
from kvtune.gateway.config import load_gateway_config
from kvtune.policy.recommendation import load_recommendation

DATA = Path(__file__).parents[1] / "data"
TEAMS = str(DATA / "logs" / "litellm_teams.jsonl")
BY_TEAM = ["--route-by", "metadata.user_api_key_team_alias"]
COMMON = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB"]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def deploy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("teams") / "deploy"
    made = invoke("recommend", TEAMS, *COMMON, *BY_TEAM, "--route-header", "X-Team", "--out", str(out))
    assert made.exit_code == 0, made.output
    return out


def _group_caps(rec) -> dict[str, int]:
    return {r.route: r.cap for r in rec.routes}


def test_recommend_renders_a_header_route_per_group(deploy):
    rec = load_recommendation(deploy / "recommendation.json")
    caps = _group_caps(rec)
    assert set(caps) == {"rag-search", "support-chat"} and caps["rag-search"] != caps["support-chat"]
    config = load_gateway_config(deploy / "gateway.yaml")
    for name in ("gateway.yaml", "nginx.conf"):
        deployed = load_deployed(deploy / name)
        for team, cap in caps.items():
            assert deployed.route_for("/v1/chat/completions", None, {"x-team": team}).max_new_tokens == cap, name
        # no header, or one no route names: the catch-all, still capped
        assert deployed.route_for("/v1/chat/completions", None).name == "default"
        assert deployed.route_for("/v1/chat/completions", None, {"x-team": "other"}).max_new_tokens == max(caps.values())
    assert [(r.match.header, r.match.value) for r in config.routes] == [
        ("x-team", "rag-search"), ("x-team", "support-chat"), (None, None)]
    assert "set it in a trusted layer in front" in (deploy / "gateway.yaml").read_text()
    assert "set it in a trusted layer in front" in (deploy / "nginx.conf").read_text()
    assert not [n for n in rec.notes if "cannot match" in n]


def test_per_group_caps_without_a_header_are_refused_in_one_line(tmp_path):
    out = tmp_path / "deploy"
    result = invoke("recommend", TEAMS, *COMMON, *BY_TEAM, "--out", str(out))
    assert result.exit_code == 2
    assert result.output == (
        "Error: --route-header: routes by 'metadata.user_api_key_team_alias' give 2 groups a cap each, but no "
        "gateway sees that field: name the request header a trusted layer in front sets to it with "
        "--route-header NAME (e.g. X-Team), or drop --route-by\n")
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--route-header", "X-Team"], "Error: --route-header: only with --route-by FIELD: routes by path are "
                                   "matched on the request's path, not a header\n"),
    ([*BY_TEAM, "--route-header", "X Team"], "Error: --route-header: 'X Team' is not a header name\n"),
])
def test_a_route_header_that_cannot_work_is_refused(tmp_path, args, message):
    result = invoke("recommend", TEAMS, *COMMON, *args, "--out", str(tmp_path / "d"))
    assert (result.exit_code, result.output) == (2, message)
    assert not (tmp_path / "d").exists()


def test_check_passes_the_header_routes_and_catches_a_drifted_group_cap(deploy, tmp_path):
    rec_path = str(deploy / "recommendation.json")
    for name in ("gateway.yaml", "nginx.conf"):
        result = invoke("check", rec_path, "--model", "llama-3.1-8b", "--deployed", str(deploy / name))
        assert result.exit_code == 0, result.output
        assert "cap-" not in result.output and "uncapped" not in result.output
    # the logs again, as check profiles them itself: the same groups, by the same header
    result = invoke("check", TEAMS, *COMMON, *BY_TEAM, "--route-header", "X-Team",
                    "--deployed", str(deploy / "gateway.yaml"))
    assert result.exit_code == 0, result.output
    caps = _group_caps(load_recommendation(deploy / "recommendation.json"))
    # support-chat's cap lowered by hand in gateway.yaml: its answers are cut
    text = (deploy / "gateway.yaml").read_text()
    at = text.index("max_new_tokens:", text.index('value: "support-chat"'))
    drifted = tmp_path / "gateway.yaml"
    drifted.write_text(text[:at] + "max_new_tokens: 40" + text[text.index("\n", at):])
    result = invoke("check", rec_path, "--model", "llama-3.1-8b", "--deployed", str(drifted))
    assert result.exit_code == 1
    assert "RISK cap-truncates" in result.output and "route 'support-chat': cap 40" in result.output
    # rag-search's header route gone: its requests fall to the catch-all, above its own cap
    start = text.index('  - name: "rag-search"')
    dropped = tmp_path / "dropped.yaml"
    dropped.write_text(text[:start] + text[text.index("  - name:", start + 1):])
    result = invoke("check", rec_path, "--model", "llama-3.1-8b", "--deployed", str(dropped), "--json")
    found = {(f["code"], f["message"]) for f in json.loads(result.output)["findings"]}
    assert ("cap-above-recommendation", f"route 'rag-search': cap {max(caps.values())} is above the "
            f"recommended {caps['rag-search']}") in found


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["python", "nginx"])
def test_both_enforcers_cap_each_group_from_the_rendered_files(deploy, tmp_path, kind):
    """The files recommend wrote, on the real gateway and a real nginx in front of the fake vLLM:
    each team's request is capped at its team's cap, one without the header at the catch-all's."""
    rec = load_recommendation(deploy / "recommendation.json")
    caps = _group_caps(rec)
    with FakeVllm(max_model_len=rec.max_model_len) as fake:
        rec = dataclasses.replace(rec, upstream=fake.url)
        server = start_enforcer(kind, rec, tmp_path / "nginx", nginx_worker_processes="1",
                                nginx_user="root" if os.geteuid() == 0 else None)
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "w " * 10}], "max_tokens": 100_000}
            for team, cap in [*caps.items(), (None, max(caps.values()))]:
                status, headers, answer = server.request("/v1/chat/completions", body,
                                                         headers={"X-Team": team} if team else None)
                assert status == 200, answer
                assert fake.seen[-1]["max_tokens"] == cap and headers["X-Kvtune-Max-Tokens"] == str(cap), team
        finally:
            server.stop()


def test_the_what_if_search_simulates_each_group_under_its_own_cap(deploy):
    """recommend --objective simulates the files it renders: each logged group meets its own header
    route, not the first route of the table nor the catch-all."""
    from kvtune.deploy.render import gateway_routes
    from kvtune.policy.search import route_caps

    rec = load_recommendation(deploy / "recommendation.json")
    table = [load_deployed(deploy / "gateway.yaml").routes, load_deployed(deploy / "nginx.conf").routes]
    assert [route_caps(t, rec.routes) for t in table] == [_group_caps(rec)] * 2
    assert [(r["header"], r["value"]) for r in gateway_routes(rec)] == [
        ("x-team", "rag-search"), ("x-team", "support-chat"), (None, None)]


def test_simulate_routes_each_group_by_its_header(deploy, tmp_path):
    """simulate --gateway runs the gateway's admission with each simulated request's group in the
    route header: every group's route caps it (here all at 1 token, the catch-all at its own)."""
    from test_cli_simulate import capacity_file

    # the engine runs the model's whole 131,072-token context, as rendered since issue 25 item 11
    cap_file = capacity_file(tmp_path, num_blocks=9000, block_size=16, max_model_len=131072, device="GPU")
    text = (deploy / "gateway.yaml").read_text()
    for team in ("rag-search", "support-chat"):
        at = text.index("max_new_tokens:", text.index(f'value: "{team}"'))
        text = text[:at] + "max_new_tokens: 1" + text[text.index("\n", at):]
    gateway = tmp_path / "gateway.yaml"
    gateway.write_text(text)
    args = ["simulate", TEAMS, *BY_TEAM, "--capacity", cap_file, "--gateway", str(gateway), "--rate", "4",
            "--requests", "80", "--json"]
    refused = invoke(*args)
    assert refused.exit_code == 2 and refused.output.startswith(
        f"Error: --route-header: {str(gateway)!r} caps routes by the x-team header: name it (--route-header x-team)")
    result = invoke(*args, "--route-header", "X-Team")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["simulation"]["admission"]["route_header"] == "x-team"
    assert data["requests"]["completed"] == 80 and data["output_tokens_total"] == 80
    wrong = invoke(*args, "--route-header", "X-Tenant")
    assert wrong.exit_code == 2 and "matches the 'x-tenant' header (its routes match x-team)" in wrong.output


def test_a_group_no_header_value_can_carry_is_refused(tmp_path):
    log = tmp_path / "teams.jsonl"
    log.write_text(Path(TEAMS).read_text().replace('"support-chat"', '"support, chat"'))
    result = invoke("recommend", str(log), *COMMON, *BY_TEAM, "--route-header", "X-Team", "--out", str(tmp_path / "d"))
    assert (result.exit_code, result.output) == (2, (
        "Error: --route-header: the group 'support, chat' is not a header value a gateway can match exactly "
        "(printable ASCII, no comma, no space at either end, at most 256 characters)\n"))
    assert not (tmp_path / "d").exists()
