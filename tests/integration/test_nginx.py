"""The rendered nginx.conf on a real nginx with the Lua module: `nginx -t` accepts it, and catches
a broken one. The policy itself (paths, field rules, clamping, reservation, 429/400/413, client
bounds) is held to one behaviour with the Python gateway in test_enforcer_parity.py."""

from __future__ import annotations

import subprocess

from enforcers import HOSTILE, HOSTILE_MODEL, Nginx, base_rec

from kvtune.deploy.render import RenderOptions, render_files
from kvtune.policy.recommendation import read_recommendation


def test_rendered_nginx_conf_passes_nginx_t(tmp_path):
    rec = base_rec()
    rec["routes"][0]["route"] = HOSTILE
    rec["routes"][0]["match"]["model"] = HOSTILE_MODEL
    conf = render_files(read_recommendation(rec), targets=["nginx.conf"],
                        options=RenderOptions(listen_port=18080))  # -t binds nothing
    server = Nginx(tmp_path, conf["nginx.conf"], 0)
    result = subprocess.run(server.args("-t"), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_t_catches_a_broken_config(tmp_path):
    """The check above can fail: a misspelled directive is refused."""
    conf = render_files(read_recommendation(base_rec()), targets=["nginx.conf"])["nginx.conf"]
    server = Nginx(tmp_path, conf.replace("proxy_buffering off;", "proxy_bufering off;"), 0)
    result = subprocess.run(server.args("-t"), capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    assert "proxy_bufering" in result.stderr
