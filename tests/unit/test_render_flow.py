"""nginx.conf with flow control (RenderOptions.flow, docs/guides/flow-control.md): the queue's data
in the Lua config, one worker whatever was asked, client aborts watched, /metrics served; check's
reader still reads the file; a route band the flow lacks is refused. The queue itself runs in
tests/lua/flow_spec.lua (busted) and tests/integration/test_enforcer_parity_flow.py (nginx)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.deploy.read import parse_deployed
from kvtune.deploy.render import RenderOptions, render_files
from kvtune.domain.flow_control import Band, FlowControl
from kvtune.domain.recommendation import Recommendation
from kvtune.errors import OptionError
from kvtune.policy.recommendation import read_recommendation

DATA = Path(__file__).parents[1] / "data"
FLOW = FlowControl(token_time_s=0.02, bands=(Band("interactive", 2.0), Band("batch", 60.0)),
                   weights={'tenant "a"': 4.0}, max_waiting_per_flow=8)


def _rec() -> Recommendation:
    return read_recommendation(json.loads((DATA / "recommendation.json").read_text(encoding="utf-8")))


def _conf(**options) -> str:
    return render_files(_rec(), targets=["nginx.conf"], options=RenderOptions(**options))["nginx.conf"]


def test_flow_control_runs_one_worker_watches_aborts_and_serves_metrics():
    routes = [r.route for r in _rec().routes]
    conf = _conf(flow=FLOW, nginx_worker_processes="4", route_bands={str(routes[0]): "batch"})
    assert "worker_processes 1;" in conf and 'worker_processes "4";' not in conf
    assert "lua_check_client_abort on;" in conf
    assert "location = /metrics {" in conf
    assert 'require("kvtune_gateway").watch_flow()' in conf
    assert 'weights = { { "tenant \\034a\\034", 4.0 } },' in conf
    assert '{ name = "batch", deadline_s = 60.0, reserve_blocks = 0 },' in conf
    assert "max_waiting_per_flow = 8," in conf
    assert 'band = "batch"' in conf and "band = nil" in conf
    # check reads the deployed file as before
    deployed = parse_deployed(conf, source="nginx.conf")
    assert deployed.block_budget == _rec().budget_blocks


def test_without_flow_control_nothing_changes():
    conf = _conf(nginx_worker_processes="4")
    assert 'worker_processes "4";' in conf
    assert "lua_check_client_abort" not in conf and "/metrics" not in conf and "watch_flow" not in conf
    assert "flow = {" not in conf


@pytest.mark.parametrize("route_bands, flow, message", [
    ({"/v1/chat/completions": "bulk"}, FLOW, "names band 'bulk', which flow.bands lacks"),
    ({"/v1/chat/completions": "batch"}, None, "names band 'batch', which flow.bands lacks"),
    ({"no-such-route": "batch"}, FLOW, "route_bands names 'no-such-route', which is no route"),
])
def test_a_route_band_the_flow_lacks_is_refused(route_bands, flow, message):
    with pytest.raises(OptionError, match=message):
        _conf(flow=flow, route_bands=route_bands)


def test_recommend_flow_control_renders_the_same_queue_into_nginx_conf(tmp_path):
    """`recommend --flow-control --out`: nginx.conf's flow table is gateway.yaml's flow: (bands,
    deadlines, token time, bounds), so the two enforcers deployed from one run queue alike."""
    from click.testing import CliRunner

    from kvtune.cli import cli
    from kvtune.gateway.config import load_gateway_config

    repo = Path(__file__).resolve().parents[2]
    result = CliRunner().invoke(cli, ["recommend", str(repo / "sample_logs"), "--model", "llama-3.1-8b", "--gpu",
                                      "H100-80GB", "--slo", "ttft=2000,tpot=50,e2e=30000", "--flow-control",
                                      "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    flow = load_gateway_config(tmp_path / "gateway.yaml").flow
    assert flow is not None
    conf = (tmp_path / "nginx.conf").read_text(encoding="utf-8")
    assert "worker_processes 1;" in conf and "lua_check_client_abort on;" in conf
    assert f"token_time_s = {flow.token_time_s!r}," in conf
    assert f"max_waiting = {flow.max_waiting}," in conf and f"max_waiting_per_flow = {flow.max_waiting_per_flow}," in conf
    for band in flow.bands:
        assert (f'{{ name = "{band.name}", deadline_s = {band.deadline_s!r}, '
                f'reserve_blocks = {band.reserve_blocks} }},') in conf


def test_render_options_flow_reaches_gateway_yaml_too():
    from kvtune.gateway.config import parse_gateway_config

    text = render_files(_rec(), targets=["gateway.yaml"],
                        options=RenderOptions(flow=FLOW, route_bands={"/v1/completions": "batch"}))["gateway.yaml"]
    import yaml

    config = parse_gateway_config(yaml.safe_load(text), path="gateway.yaml")
    assert config.flow == FLOW
    assert {r.name: r.band for r in config.routes}["/v1/completions"] == "batch"


def test_a_bands_reserve_renders_into_both_files_and_reads_back():
    """flow.bands[].reserve_blocks (The reserve): gateway.yaml reads back the FlowControl rendered,
    nginx.conf's band table carries the same reserve."""
    import yaml

    from kvtune.gateway.config import parse_gateway_config

    flow = FlowControl(token_time_s=0.02, bands=(Band("interactive", 2.0, reserve_blocks=40), Band("batch", 60.0)))
    files = render_files(_rec(), targets=["gateway.yaml", "nginx.conf"], options=RenderOptions(flow=flow))
    config = parse_gateway_config(yaml.safe_load(files["gateway.yaml"]), path="gateway.yaml")
    assert config.flow == flow and config.flow.kept_blocks(1) == 40
    assert '{ name = "interactive", deadline_s = 2.0, reserve_blocks = 40 },' in files["nginx.conf"]
    assert '{ name = "batch", deadline_s = 60.0, reserve_blocks = 0 },' in files["nginx.conf"]
