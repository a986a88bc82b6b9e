"""Rendering: every target from one recommendation, escaped for its own syntax."""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvtune.deploy.charts import histogram_bars
from kvtune.deploy.filters import human_bytes, human_number, lua_string, md_cell, nginx_time, one_line, yaml_scalar
from kvtune.deploy.read import parse_deployed
from kvtune.deploy.render import (
    COMMON_TARGETS,
    TARGETS,
    RenderOptions,
    local_chat_tokenizer,
    lua_modules,
    make_environment,
    render_files,
    write_files,
)
from kvtune.domain.recommendation import Recommendation
from kvtune.endpoint import parse_upstream
from kvtune.errors import InputError, KvtuneError
from kvtune.gateway.config import CountingMethod, load_gateway_config, parse_gateway_config
from kvtune.policy.recommendation import read_recommendation

DATA = Path(__file__).parents[1] / "data"
NASTY = [
    'quote " and \' apostrophe',
    "$(touch /tmp/kvtune-pwned-render)",
    "`touch /tmp/kvtune-pwned-render`",
    "new\nline\r\nand\ttab",
    "{{ 7 * 7 }} {% if true %}x{% endif %} {# c #}",
    "]] [[ ]=] --[[ comment",
    "100% & <script>alert(1)</script> | pipe ` tick",
    "é ü 中文 😀 \u2028 \u2029 \x85 \x00 \x7f",
    "back\\slash \\n not a newline",
]


def rec_dict() -> dict:
    return json.loads((DATA / "recommendation.json").read_text(encoding="utf-8"))


def rec() -> Recommendation:
    return read_recommendation(rec_dict(), path="recommendation.json")


def hostile_rec() -> Recommendation:
    r = rec_dict()
    template = r["routes"][0]
    routes = []
    for i, name in enumerate(NASTY):
        route = json.loads(json.dumps(template))
        route["route"] = name
        route["match"] = {"path": "/v1/chat/completions", "model": name}
        route["max_new_tokens"]["value"] = 100 + i
        route["max_new_tokens"]["reason"] = "reason with " + name
        routes.append(route)
    r["routes"] = routes
    r["model"] = NASTY[4]
    r["served_model"] = NASTY[1] + NASTY[3]
    r["notes"] = list(NASTY)
    r["settings"]["max_model_len"]["reason"] = NASTY[3] + NASTY[5]
    return read_recommendation(r)


def test_a_second_render_compiles_no_template(monkeypatch):
    """One environment per process keeps the compiled templates: compiling them was ~90 % of a
    render's CPU, paid again by every recommend --out and every enforcer a test starts."""
    render_files(rec(), targets=list(COMMON_TARGETS))  # whatever compiled before, these are compiled now
    env = make_environment()
    compiled: list[str | None] = []
    compile_ = env.compile
    monkeypatch.setattr(env, "compile", lambda source, name=None, *a, **k: compiled.append(name) or
                        compile_(source, name, *a, **k))
    again = render_files(rec(), targets=list(COMMON_TARGETS))
    assert make_environment() is env and compiled == []
    assert again == render_files(rec(), targets=list(COMMON_TARGETS))


# ---------------------------------------------------------------- filters

def test_one_line_leaves_no_line_break_of_any_kind():
    for text in NASTY:
        out = one_line(text)
        assert not any(ch in out for ch in "\n\r\x0b\x0c\x85\u2028\u2029\x00")
        assert len(out.splitlines()) <= 1


@pytest.mark.parametrize("text", NASTY)
def test_yaml_scalar_round_trips_exactly(text):
    if "\x00" in text:
        text = text.replace("\x00", "")  # YAML has no NUL; route names never carry one
    assert yaml.safe_load(f"k: {yaml_scalar(text)}\n") == {"k": text}
    assert yaml_scalar(text).isascii()


def test_lua_string_escapes_everything_but_plain_characters():
    out = lua_string('a"b\\c\n]]{x}$é')
    assert out == '"a\\034b\\092c\\010\\093\\093\\123x\\125\\036\\195\\169"'
    assert lua_string(None) == "nil" and lua_string(12) == "12" and lua_string(True) == "true"
    # tables: keys escaped like any string, sets in order
    assert lua_string({"/a]]": [1, "b"], "k": {"x"}}) == '{ ["/a\\093\\093"] = { 1, "b" }, ["k"] = { "x" } }'


def test_nginx_time_is_whole_seconds_or_milliseconds():
    assert (nginx_time(60), nginx_time(2.0), nginx_time(0.5), nginx_time(1.25)) == ("60s", "2s", "500ms", "1250ms")
    for bad in (float("nan"), float("inf"), -1):
        with pytest.raises(KvtuneError):
            nginx_time(bad)


def test_nginx_conf_renders_client_limits_and_admin_access():
    from kvtune.gateway.config import Access, AdminAccess, ClientLimits

    limits = ClientLimits(header_timeout_s=2.5, body_timeout_s=3, keepalive_timeout_s=4, send_timeout_s=5,
                          max_header_bytes=8192, max_header_line_bytes=4096, max_body_bytes=300_000,
                          max_connections=10)
    text = render_files(rec(), targets=["nginx.conf"], options=RenderOptions(limits=limits))["nginx.conf"]
    for line in ("client_header_timeout 2500ms;", "client_body_timeout 3s;", "keepalive_timeout 4s;",
                 "send_timeout 5s;", "large_client_header_buffers 2 4096;", "client_max_body_size 300000;",
                 "worker_connections 20;", "allow 127.0.0.1;"):
        assert line in text, line
    assert "max_body_bytes = 300000," in text and not re.search(r"^env ", text, re.M)
    token = RenderOptions(admin=AdminAccess(ledger=Access.TOKEN, token_env="KVTUNE_LEDGER_TOKEN"))
    text = render_files(rec(), targets=["nginx.conf"], options=token)["nginx.conf"]
    assert 'env "KVTUNE_LEDGER_TOKEN";' in text and "allow 127.0.0.1;" not in text
    assert 'ledger_access = "token",' in text and 'token_env = "KVTUNE_LEDGER_TOKEN",' in text
    for bad in (AdminAccess(ledger=Access.TOKEN), AdminAccess(ledger=Access.TOKEN, token_env="NOT A NAME"),
                AdminAccess(ledger="anyone")):
        with pytest.raises(KvtuneError, match="admin"):
            render_files(rec(), targets=["nginx.conf"], options=RenderOptions(admin=bad))


def test_md_cell_escapes_table_syntax():
    out = md_cell("a|b`c\nd <b>x</b> & [l](u)")
    assert "\n" not in out
    assert "\\|" in out and "\\`" in out and "\\<b\\>" in out and "&amp;" in out and "\\[l\\]" in out
    assert re.search(r"(?<!\\)\|", out) is None


def test_human_numbers():
    assert human_number(1234567) == "1,234,567"
    assert human_number(5.77) == "5.77"
    assert human_number(0.123456) == "0.123"
    assert human_number(None) == "–"
    assert human_bytes(16060522496) == "14.96 GiB"


def test_histogram_bars_mark_the_cap():
    chart = histogram_bars([0, 10, 20, 30, 40], [5, 10, 1, 0], 15, width=300, height=120)
    assert [b["above_cap"] for b in chart["bars"]] == [False, False, True]
    assert chart["cap_x"] == 150.0
    assert chart["bars"][1]["h"] == chart["plot_h"]  # the tallest bar fills the plot


def test_parse_upstream_refuses_what_it_cannot_render():
    assert parse_upstream("http://127.0.0.1:8000").host_port == "127.0.0.1:8000"
    assert parse_upstream("https://vllm.internal").host_port == "vllm.internal:443"
    assert parse_upstream("http://[::1]:9000/").host_port == "[::1]:9000"
    for bad in ("ftp://x", "http://x:80/v1", "http://a b:80", "http://x;y:80", "127.0.0.1:8000"):
        with pytest.raises(InputError):
            parse_upstream(bad)


# ---------------------------------------------------------------- targets

def test_litellm_config_wires_the_hook_to_the_rendered_engine_and_gateway_yaml():
    """litellm-config.yaml: the served model on the engine (hosted_vllm, api_base its /v1), kvtune's
    callback, and gateway.yaml's caps named in its header; hostile route names stay comments."""
    r = rec()
    files = render_files(r, targets=["litellm-config.yaml", "gateway.yaml"])
    doc = yaml.safe_load(files["litellm-config.yaml"])
    gateway = parse_gateway_config(yaml.safe_load(files["gateway.yaml"]))
    served = r.served_model or r.model
    assert doc == {"model_list": [{"model_name": served, "litellm_params": {
        "model": f"hosted_vllm/{served}", "api_base": f"{gateway.upstream.rstrip('/')}/v1"}}],
        "litellm_settings": {"callbacks": "kvtune.integrations.litellm.proxy_handler"}}
    for route in gateway.routes:
        assert f"#   {route.name}: max_new_tokens {route.max_new_tokens}" in files["litellm-config.yaml"]
    hostile = yaml.safe_load(render_files(hostile_rec(), targets=["litellm-config.yaml"])["litellm-config.yaml"])
    assert set(hostile) == {"model_list", "litellm_settings"}


def test_render_files_gives_every_target_and_refuses_unknown():
    files = render_files(rec())
    assert set(files) == {"vllm-serve.sh", *COMMON_TARGETS}  # a vLLM recommendation: vLLM's launch file
    assert set(TARGETS) == {"vllm-serve.sh", "sglang-serve.sh", "trtllm-serve.sh", "trtllm-llm-api.yaml",
                            *COMMON_TARGETS}
    with pytest.raises(KvtuneError, match="launches SGLang, but the recommendation is for vLLM"):
        render_files(rec(), targets=["sglang-serve.sh"])
    assert json.loads(files["recommendation.json"]) == rec().to_dict()
    assert read_recommendation(json.loads(files["recommendation.json"])).to_dict() == rec().to_dict()
    assert set(render_files(rec(), targets=["gateway.yaml"])) == {"gateway.yaml"}
    with pytest.raises(KvtuneError, match="unknown render target"):
        render_files(rec(), targets=["docker-compose.yml"])


def test_missing_field_is_a_clear_error():
    r = rec_dict()
    del r["concurrency"]["admitted"]
    with pytest.raises(InputError, match="recommendation.json: concurrency.admitted: missing"):
        read_recommendation(r, path="recommendation.json")
    r = rec_dict()
    del r["settings"]["max_new_tokens_backstop"]
    with pytest.raises(InputError, match="settings.max_new_tokens_backstop: missing"):
        read_recommendation(r, path="recommendation.json")


def test_gateway_yaml_loads_and_reproduces_the_recommendation(tmp_path):
    r = rec()
    path = tmp_path / "gateway.yaml"
    path.write_text(render_files(r, targets=["gateway.yaml"],
                                 options=RenderOptions(listen_port=9123))["gateway.yaml"])
    config = load_gateway_config(path)
    assert config.upstream == "http://127.0.0.1:8000"
    assert (config.block_size, config.block_budget, config.max_model_len) == (16, 26999, 14512)
    assert config.port == 9123 and config.model == "meta-llama/Llama-3.1-8B"
    assert config.prompt_tokens.method is CountingMethod.UPSTREAM_TOKENIZE
    assert [(x.name, x.match.path, x.match.model, x.max_new_tokens) for x in config.routes] == [
        ("/v1/chat/completions", "/v1/chat/completions", None, 451),
        ("/v1/completions", "/v1/completions", None, 700),
        ("default", None, None, 700),
    ]
    # the catch-all caps anything the recommended routes do not match
    assert config.route_for("/v1/responses", "other").max_new_tokens == 700
    # a full budget queues one budget's worth of requests for 10 s before answering 429
    assert (config.queue_max_waiting, config.queue_timeout_s) == (300, 10.0)
    # each recommended route carries its measured output lengths for the statistical policy, the
    # catch-all none (its requests count as reaching the cap)
    for route, recommended in zip(config.routes, r.routes, strict=False):
        law = route.output_law
        assert law is not None and law.lengths[-1] == recommended.cap and len(law.lengths) <= 32
        lengths = recommended.output_lengths
        assert sum(law.counts) == lengths.uncensored.total + lengths.censored.total
    assert config.routes[-1].output_law is None


@pytest.mark.parametrize("admission", [{"policy": "guaranteed"}, {"policy": "overcommit", "factor": 1.75},
                                       {"policy": "statistical", "epsilon": 0.02}])
def test_the_admission_policy_reaches_gateway_yaml_and_nginx_conf(admission):
    from kvtune.deploy.read import parse_deployed

    doc = rec_dict()
    doc["admission"] = admission
    r = read_recommendation(doc)
    config = parse_gateway_config(yaml.safe_load(render_files(r, targets=["gateway.yaml"])["gateway.yaml"]))
    assert config.admission == r.admission
    assert set(render_files(r)) == {"vllm-serve.sh", *COMMON_TARGETS}  # nginx.conf enforces every policy too
    conf = render_files(r, targets=["nginx.conf"])["nginx.conf"]
    limit = r.admission.limit_blocks(r.budget_blocks)
    assert f"admit_limit = {limit}," in conf and f'policy = "{admission["policy"]}",' in conf
    deployed = parse_deployed(conf, source="nginx.conf")
    assert deployed.block_budget == r.budget_blocks and deployed.admission == r.admission
    statistical = admission["policy"] == "statistical"
    # the statistical ledger lives in one worker's memory; the others keep the option's worker count
    assert ("worker_processes 1;" in conf) is statistical and ('worker_processes "auto";' in conf) is not statistical
    assert "body_filter_by_lua_block" in conf  # every policy: an engine answer that is not HTTP becomes a 502 there
    assert ("epsilon = 0.02," in conf) is statistical


def test_nginx_conf_carries_the_statistical_constants_and_route_laws():
    """The Lua runs on the Python ledger's own constants and each route's output_histogram, as
    gateway.yaml carries them; the catch-all has none (worst case)."""
    from kvtune.deploy.read import _LuaReader
    from kvtune.deploy.render import gateway_routes
    from kvtune.gateway.overflow import EXACT_WORK, FIRST_MARK, THETAS, interval_edges

    doc = rec_dict()
    doc["admission"] = {"policy": "statistical", "epsilon": 0.001}
    r = read_recommendation(doc)
    conf = render_files(r, targets=["nginx.conf"])["nginx.conf"]
    block = conf[conf.index("local CONFIG =") + len("local CONFIG ="):]
    config = _LuaReader(block, "nginx.conf").value()
    stat = config["statistical"]
    assert stat["epsilon"] == 0.001 and tuple(stat["thetas"]) == THETAS
    assert stat["exact_work"] == EXACT_WORK and stat["first_mark"] == FIRST_MARK
    assert [tuple(e) for e in stat["edges"]] == list(interval_edges(r.max_model_len))
    assert stat["events_without_tokens"] == 3
    laws = [route.get("law") for route in config["routes"]]
    assert laws[:-1] == [g["output_histogram"] for g in gateway_routes(r)][:-1] and laws[-1] is None
    assert all(law["lengths"] and len(law["lengths"]) == len(law["counts"]) for law in laws[:-1])


def test_gateway_yaml_counts_with_a_local_tokenizer_when_given_one(tmp_path):
    from kvtune.gateway.counting import make_counter

    folder = _model_dir(tmp_path)
    text = render_files(rec(), targets=["gateway.yaml"],
                        options=RenderOptions(gateway_tokenizer=str(folder)))["gateway.yaml"]
    config = parse_gateway_config(yaml.safe_load(text))
    assert config.prompt_tokens.method is CountingMethod.TOKENIZER and config.prompt_tokens.tokenizer == str(folder)
    assert make_counter(config.prompt_tokens).method is CountingMethod.TOKENIZER  # what the gateway loads at start


def _model_dir(tmp_path: Path) -> Path:
    """tokenizer.json and a chat template, as a model directory holds them."""
    from tokenizers import Tokenizer, models

    tmp_path.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return tmp_path


def test_local_chat_tokenizer_needs_a_tokenizer_and_a_chat_template(tmp_path):
    folder = _model_dir(tmp_path / "model")
    (folder / "config.json").write_text("{}")
    for spec in (folder, folder / "config.json", folder / "tokenizer.json"):
        assert local_chat_tokenizer(str(spec)) == str(folder.resolve())
    assert local_chat_tokenizer(None) is None
    assert local_chat_tokenizer("meta-llama/Llama-3.1-8B") is None  # a hub id: nothing local
    assert local_chat_tokenizer(str(tmp_path / "missing")) is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert local_chat_tokenizer(str(folder)) is None  # no template: the gateway could not start
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert local_chat_tokenizer(str(folder)) == str(folder.resolve())
    (folder / "tokenizer_config.json").write_text("[1]")  # the gateway could not read it: no
    assert local_chat_tokenizer(str(folder)) is None
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": "x"}]}))
    assert local_chat_tokenizer(str(folder)) == str(folder.resolve())
    (folder / "tokenizer.json").unlink()
    assert local_chat_tokenizer(str(folder)) is None


def test_gateway_yaml_round_trips_hostile_names():
    r = hostile_rec()
    text = render_files(r, targets=["gateway.yaml"])["gateway.yaml"]
    assert all(line.isascii() for line in text.splitlines() if not line.lstrip().startswith("#"))
    config = parse_gateway_config(yaml.safe_load(text))
    assert [x.name for x in config.routes[:-1]] == NASTY
    assert [x.match.model for x in config.routes[:-1]] == NASTY
    assert [x.max_new_tokens for x in config.routes] == [100 + i for i in range(len(NASTY))] + [700]
    assert config.model == NASTY[1] + NASTY[3]


def test_shell_script_has_no_command_substitution(tmp_path):
    r = hostile_rec()
    script = render_files(r, targets=["vllm-serve.sh"])["vllm-serve.sh"]
    # every line is either a comment, a known statement or part of the exec command
    body = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert body[0] == "set -euo pipefail"
    assert body[1].startswith("exec vllm serve ")
    words = shlex.split(script.split("set -euo pipefail", 1)[1].replace("\\\n", " "))
    assert words[:3] == ["exec", "vllm", "serve"]
    assert words[3] == NASTY[1] + NASTY[3]
    assert words[-1] == "$@"
    # bash agrees: run it with a stand-in vllm
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    (bindir / "vllm").chmod(0o755)
    (tmp_path / "s.sh").write_text(script)
    marker = Path("/tmp/kvtune-pwned-render")
    marker.unlink(missing_ok=True)
    out = subprocess.run(["bash", str(tmp_path / "s.sh")], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)
    assert argv[:2] == ["serve", NASTY[1] + NASTY[3]]
    assert not marker.exists()
    # each flag's reason is a one-line comment
    assert "# --max-model-len 14512: max-model-len-longest-request: new line and tab]] [[ ]=] --[[ comment" in script


def test_nginx_conf_embeds_names_as_lua_escapes_only():
    text = render_files(hostile_rec(), targets=["nginx.conf"])["nginx.conf"]
    config = text.split("-- kvtune:config begin", 1)[1].split("-- kvtune:config end", 1)[0]
    assert config.isascii()
    assert "$(" not in config and "`" not in config and "]]" not in config and "{{" not in config
    # comments outside Lua carry reasons on one line each
    for line in text.splitlines():
        if line.startswith("#"):
            assert "\r" not in line and "\u2028" not in line


def test_html_report_escapes_and_is_self_contained():
    text = render_files(hostile_rec(), targets=["report.html"])["report.html"]
    assert "<script>alert(1)</script>" not in text
    assert html.escape("<script>alert(1)</script>") in text
    assert "{{ 7 * 7 }}" in html.unescape(text)  # shown, never evaluated
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "<link" not in text and "@import" not in text
    assert text.count("<svg") >= len(NASTY) + 1


def test_reports_show_headline_routes_capacity_settings_and_notes():
    files = render_files(rec(), targets=["report.md", "report.html"])
    for text in files.values():
        assert "5.77" in text  # the gain
        assert "300" in text and "52" in text
        assert "26,999" in text
        assert "14.96 GiB" in text  # weights
        for name in rec().settings:
            if rec().settings[name] is not None:
                assert name in text.replace("\\_", "_")
        assert "calibrate with --vllm-log" in text
    md = files["report.md"]
    assert "| /v1/chat/completions |" in md and "cap-p95-light-tail" in md
    assert "✂ above cap" in md
    html_text = files["report.html"]
    assert html_text.count('class="capline"') == 2


def test_markdown_report_keeps_hostile_names_inside_their_cells():
    md = render_files(hostile_rec(), targets=["report.md"])["report.md"]
    table = md.split("## Routes", 1)[1].split("###", 1)[0]
    rows = [row for row in table.splitlines() if row.startswith("| ") and "---" not in row][1:]
    assert len(rows) == len(NASTY)
    widths = {len(re.split(r"(?<!\\)\|", row)) for row in rows}
    assert len(widths) == 1


def test_write_files_is_all_or_nothing(tmp_path, monkeypatch):
    files = render_files(rec())
    out = tmp_path / "out"
    written = write_files(out, files)
    # nginx.conf brings the Lua modules it loads, under lua/ beside it
    modules = lua_modules()
    assert sorted(p.relative_to(out).as_posix() for p in written) == sorted([*files, *modules])
    assert {name: (out / name).read_text(encoding="utf-8") for name in modules} == modules
    assert os.stat(out / "vllm-serve.sh").st_mode & stat.S_IXUSR
    assert not os.stat(out / "gateway.yaml").st_mode & stat.S_IXUSR
    assert not os.stat(out / "lua" / "kvtune" / "gateway.lua").st_mode & stat.S_IXUSR
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "lua"])  # no temp folder left

    # a failure while writing leaves the previous files intact and nothing half-written
    before = {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*") if p.is_file()}
    changed = {name: "new " + text for name, text in files.items()}
    real_chmod = os.chmod
    calls = []

    def failing_chmod(path, mode):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_chmod(path, mode)

    monkeypatch.setattr(os, "chmod", failing_chmod)
    with pytest.raises(InputError, match="disk full"):  # an OSError is one error line naming the file
        write_files(out, changed)
    monkeypatch.undo()
    assert {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "lua"])  # no staging folder left either


def test_write_files_refuses_paths():
    with pytest.raises(KvtuneError):
        write_files("/tmp", {"../x": "y"})


def test_coarsen_histogram_keeps_totals_and_edges():
    from kvtune.deploy.charts import coarsen_histogram

    edges = list(range(0, 16 * 513, 16))
    counts = [i % 7 for i in range(512)]
    counts[-5:] = [0] * 5
    new_edges, new_counts = coarsen_histogram(edges, counts, 24)
    assert len(new_counts) <= 24 and len(new_edges) == len(new_counts) + 1
    assert sum(new_counts) == sum(counts)
    assert new_edges[0] == 0 and new_edges[-1] == edges[507]


def test_refused_values_are_quoted_briefly():
    from kvtune.deploy.filters import nginx_listen, nginx_word
    from kvtune.errors import KvtuneError

    for call in (lambda: nginx_word("/v1/" + "x" * 1_000_000 + "$"), lambda: nginx_listen("h" * 1_000_000)):
        with pytest.raises(KvtuneError) as info:
            call()
        assert len(str(info.value)) < 200


# ---------------------------------------------------------------- several engine replicas

def test_replicas_render_upstreams_on_consecutive_ports_each_with_the_budget():
    files = render_files(rec(), options=RenderOptions(replicas=4))
    conf = parse_deployed(files["nginx.conf"], source="nginx.conf")  # one budget per engine, under its own keys
    assert [(u.url, u.block_budget) for u in conf.upstreams] == [(f"http://127.0.0.1:{8000 + i}", 26999)
                                                                  for i in range(4)]
    doc = yaml.safe_load(files["gateway.yaml"])
    assert doc["upstreams"] == [{"url": f"http://127.0.0.1:{8000 + i}", "block_budget": 26999} for i in range(4)]
    assert "# 4 engine replicas, one per port" in files["gateway.yaml"]
    config = parse_gateway_config(doc)
    assert [u.block_budget for u in config.upstreams] == [26999] * 4 and config.block_budget == 4 * 26999
    one = yaml.safe_load(render_files(rec(), targets=["gateway.yaml"])["gateway.yaml"])
    assert (one["upstream"], one["block_budget"], "upstreams" in one) == ("http://127.0.0.1:8000", 26999, False)


def test_replicas_measured_each_render_their_own_budgets_and_no_nginx_conf():
    upstreams = [{"url": "http://10.0.0.7:8000", "block_budget": 1799, "num_blocks": 2000, "capacity_file": "a.json"},
                 {"url": "http://10.0.0.8:8000", "block_budget": 2700, "num_blocks": 3001, "capacity_file": "b.json"}]
    measured = read_recommendation({**rec_dict(), "upstreams": upstreams}, path="recommendation.json")
    files = render_files(measured)  # RenderOptions' replicas=1 does not hide them
    conf = parse_deployed(files["nginx.conf"], source="nginx.conf")
    assert [(u.url, u.block_budget) for u in conf.upstreams] == [(u["url"], u["block_budget"]) for u in upstreams]
    assert "budget 1799 blocks (a.json)" in files["nginx.conf"]
    doc = yaml.safe_load(files["gateway.yaml"])
    assert doc["upstreams"] == [{"url": u["url"], "block_budget": u["block_budget"]} for u in upstreams]
    assert "each block_budget its own measured KV pool" in files["gateway.yaml"]
    assert json.loads(files["recommendation.json"])["upstreams"] == upstreams


def test_nginx_conf_for_several_statistical_replicas_is_refused_with_the_reason():
    statistical = read_recommendation({**rec_dict(), "admission": {"policy": "statistical", "epsilon": 0.01}},
                                           path="recommendation.json")
    assert "nginx.conf" not in render_files(statistical, options=RenderOptions(replicas=2))
    with pytest.raises(KvtuneError) as caught:
        render_files(statistical, targets=["gateway.yaml", "nginx.conf"], options=RenderOptions(replicas=2))
    assert caught.value.field == "replicas"
    assert caught.value.message.startswith("nginx.conf's statistical ledger holds one engine's sequences")
    with pytest.raises(KvtuneError, match="must be from 1 to 256, got 65000"):
        render_files(rec(), targets=["gateway.yaml"], options=RenderOptions(replicas=65000))
