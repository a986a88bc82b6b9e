"""The gateway's Lua modules (kvtune/deploy/lua/kvtune/*.lua) as Lua: busted runs their unit
specs (tests/lua/*_spec.lua: the ledger's release rate, the token estimate, the event count, the
reservation arithmetic, the refusal log, the statistical ledger and its Chernoff bound, the
flow-control queue and its forecast) under
LuaJIT, as nginx runs them, and luacheck lints them. nginx itself, the end-to-end proof, runs them
in test_enforcer_parity.py and the other nginx tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtune.deploy.render import LUA_DIR, lua_modules

REPO = Path(__file__).resolve().parents[2]
SPECS = Path(__file__).parents[1] / "lua"
INSTALL_HINT = "apt-get install -y lua-busted lua-check luajit2 (scripts/install-test-deps.sh)"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: {INSTALL_HINT}")
    return path


def test_busted_specs_of_the_lua_modules_pass():
    """Every spec passes; a failing or erroring one fails this test with busted's report."""
    busted, luajit = _tool("busted"), _tool("luajit")
    env = {**os.environ, "LUA_PATH": f"{LUA_DIR}/?.lua;{SPECS}/?.lua;;"}
    done = subprocess.run([busted, f"--lua={luajit}", "-o", "TAP", str(SPECS)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    passed = [line for line in report.splitlines() if line.startswith("ok ")]
    assert len(passed) >= 40, report  # busted found the specs and ran them all
    assert "not ok" not in report, report


def test_the_lua_modules_pass_luacheck():
    luacheck = _tool("luacheck")
    done = subprocess.run([luacheck, "--no-color", "kvtune/deploy/lua", "tests/lua"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_ships_every_module_the_gateway_requires():
    """gateway.lua requires its sibling modules by name; each is in lua_modules (what recommend
    --out writes beside nginx.conf) and in the package data pyproject.toml installs."""
    import re

    modules = lua_modules()
    gateway = modules["lua/kvtune/gateway.lua"]
    required = set(re.findall(r'require "(kvtune\.[a-z_]+)"', gateway))
    assert required == {"kvtune.counting", "kvtune.events", "kvtune.flow", "kvtune.ledger", "kvtune.refusals",
                        "kvtune.reservation", "kvtune.statistical"}
    assert {f"lua/{name.replace('.', '/')}.lua" for name in required} < set(modules)
    assert '"deploy/lua/kvtune/*.lua"' in (REPO / "pyproject.toml").read_text(encoding="utf-8")


def test_check_warns_when_the_lua_beside_a_deployed_nginx_conf_is_missing_or_another(tmp_path):
    """recommend --out writes the modules beside nginx.conf; `kvtune check --deployed nginx.conf`
    says when they are not there (nginx would not start) or are not this kvtune's."""
    import json

    from click.testing import CliRunner

    from kvtune.cli import cli

    out = tmp_path / "deploy"
    made = CliRunner().invoke(cli, ["recommend", str(REPO / "sample_logs"), "--model", "llama-3.1-8b", "--gpu",
                                    "H100-80GB", "--out", str(out)])
    assert made.exit_code == 0, made.output

    def lua_findings() -> dict[str, dict]:
        result = CliRunner().invoke(cli, ["check", str(out / "recommendation.json"), "--deployed",
                                          str(out / "nginx.conf"), "--json"])
        assert result.exit_code == 0, result.output  # a warning: nginx may run with another prefix
        return {f["code"]: f for f in json.loads(result.output)["findings"] if f["code"].startswith("lua-")}

    assert lua_findings() == {}
    (out / "lua" / "kvtune" / "ledger.lua").write_text("return {}\n", encoding="utf-8")
    (out / "lua" / "kvtune" / "gateway.lua").unlink()
    found = lua_findings()
    assert set(found) == {"lua-modules-missing", "lua-modules-differ"}
    assert found["lua-modules-missing"]["severity"] == "warn"
    assert found["lua-modules-missing"]["message"] == "lua/kvtune/gateway.lua not beside nginx.conf"
    assert found["lua-modules-differ"]["message"] == "lua/kvtune/ledger.lua beside nginx.conf differ from this kvtune's"
    assert found["lua-modules-missing"]["source"] == str(out / "nginx.conf")
