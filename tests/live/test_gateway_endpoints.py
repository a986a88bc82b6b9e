"""The gateway's endpoint table against the vLLM it fronts: every route vLLM 0.32's server
defines (read from the installed package's entrypoints/, not from memory) has a class, so a vLLM
release that adds a generating endpoint fails here until someone decides how to govern it."""

from __future__ import annotations

import ast

import pytest
from vllm_server import venv_python

from kvtune.domain.route import Api
from kvtune.engines import sglang, vllm
from kvtune.gateway.endpoints import (
    DEFAULT_PASSTHROUGH,
    GENERATE,
    OPERATOR,
    OTHER_KNOWN,
    POOL,
    UNCOUNTABLE,
    PathClass,
    canonical_path,
    classify,
    never_passthrough,
    why_not_a_route_path,
)

ROUTE_CALLS = {"post", "get", "put", "delete", "patch", "api_route", "websocket", "add_api_route"}


def vllm_routes() -> set[str]:
    """Every literal path passed to a FastAPI route decorator or add_api_route in vllm/entrypoints."""
    python = venv_python()
    site = next((python.parent.parent / "lib").glob("python3*/site-packages"))
    root = site / "vllm" / "entrypoints"
    assert root.is_dir(), root
    paths: set[str] = set()
    for source in root.rglob("*.py"):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ROUTE_CALLS and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("/")):
                paths.add(node.args[0].value)
    return paths


def test_every_vllm_route_has_a_class():
    routes = vllm_routes()
    assert "/v1/chat/completions" in routes and "/invocations" in routes  # the reader works
    known = set(GENERATE) | set(POOL) | set(UNCOUNTABLE) | OPERATOR | OTHER_KNOWN
    unclassified = sorted(routes - known)
    assert not unclassified, f"vLLM routes the gateway has not classified: {unclassified}"


def test_the_tables_name_real_vllm_routes_and_do_not_overlap():
    routes = vllm_routes()
    tables = [set(GENERATE), set(POOL), set(UNCOUNTABLE), set(OPERATOR), set(OTHER_KNOWN)]
    vllm_tables = [set(vllm.GENERATE_PATHS), set(vllm.POOL_PATHS), set(vllm.UNCOUNTABLE_PATHS), vllm.OPERATOR_PATHS]
    for table in vllm_tables:
        assert table <= routes, sorted(table - routes)
    # what the gateway adds beyond vLLM's own is SGLang's (test_sglang_routes_have_a_class reads them)
    assert set(UNCOUNTABLE) - set(vllm.UNCOUNTABLE_PATHS) == set(sglang.NATIVE_GENERATE_PATHS) - routes
    assert OPERATOR - vllm.OPERATOR_PATHS == sglang.OPERATOR_PATHS - vllm.OPERATOR_PATHS
    for i, a in enumerate(tables):
        for b in tables[i + 1:]:
            assert not a & b, a & b
    assert set(DEFAULT_PASSTHROUGH) <= OTHER_KNOWN


@pytest.mark.parametrize("path", sorted(set(GENERATE) | set(POOL) | set(UNCOUNTABLE) | OPERATOR))
def test_no_governed_or_operator_path_can_be_passed_through(path):
    assert never_passthrough(path) is not None
    assert classify(path, frozenset({path})).path_class is not PathClass.PASSTHROUGH


def sglang_routes() -> set[str]:
    """Every literal path SGLang 0.5.23's HTTP server routes (srt/entrypoints/http_server.py in the
    parser venv; routes named by an environment variable count at their default)."""
    from sglang_parser import require_sglang_python

    python = require_sglang_python()
    site = next((python.parent.parent / "lib").glob("python3*/site-packages"))
    tree = ast.parse((site / "sglang" / "srt" / "entrypoints" / "http_server.py").read_text(encoding="utf-8"))
    paths: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ROUTE_CALLS
                and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.Call) and len(first.args) == 2:  # os.environ.get("NAME", "/default")
            first = first.args[1]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("/"):
            paths.add(first.value)
    return paths


def test_every_sglang_route_has_a_class():
    """A gateway in front of SGLang governs, refuses or knows every path SGLang serves."""
    routes = sglang_routes()
    assert "/generate" in routes and "/v1/chat/completions" in routes and "/api/chat" in routes
    known = (set(GENERATE) | set(POOL) | set(UNCOUNTABLE) | OPERATOR | OTHER_KNOWN | sglang.OTHER_PATHS)
    unclassified = sorted(p for p in routes - known if not p.startswith(sglang.OPERATOR_PREFIXES))
    assert not unclassified, f"SGLang routes the gateway has not classified: {unclassified}"
    assert sglang.OPERATOR_PATHS <= routes and set(sglang.NATIVE_GENERATE_PATHS) <= routes


def test_sglang_templated_control_routes_are_operator_paths():
    for path in ("/dumper/start", "/dumper/anything/else"):
        assert classify(path, frozenset({path})).path_class is PathClass.OPERATOR
        assert never_passthrough(path) is not None


@pytest.mark.parametrize("path", [
    "/v1/chat%2Fcompletions", "/v1//chat", "/v1/./x", "/v1/../sleep", "/v1/x/..", "/v1/x/.", "//",
    "/v1/x\\y", "/v1/x y", "/v1/\x00", "v1/chat", "", "/v1/é",
])
def test_paths_that_mean_two_things_are_not_canonical(path):
    assert canonical_path(path) is None


@pytest.mark.parametrize("path", ["/", "/v1/chat/completions", "/v1/chat/completions/", "/a.b/c..d/.e",
                                  "/v1/responses/resp_1?x=%2F"])
def test_plain_paths_are_canonical(path):
    assert canonical_path(path) == path.split("?")[0]


def test_route_paths_from_logs():
    assert why_not_a_route_path("/v1/chat/completions") is None
    assert why_not_a_route_path("/v1/summarize") is None
    assert "plain" in why_not_a_route_path("/v1/*")
    assert "pool" in why_not_a_route_path("/v1/embeddings")
    assert "operator" in why_not_a_route_path("/sleep")
    assert classify("/v1/messages").api is Api.MESSAGES
