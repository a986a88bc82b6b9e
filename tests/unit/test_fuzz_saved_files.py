"""Damaged files kvtune wrote itself (recommendation.json, saved profiles, capacity files,
gateway.yaml): every mutation is read or refused as one `Error:` line (exit 2), never a traceback.

The files are real: produced in the test from sample_logs/ by the real CLI (recommend, profile) and
by kvtune.capacity.measured (the capacity file `kvtune calibrate` writes). Mutations: delete a key
anywhere, replace any value with another JSON type, duplicate a key, truncate the bytes, flip bytes.
Each is driven through the real entry point: `check` (with a gateway and with an engine command),
`bench --expect` (the parse and the verdict, no server), `profile --merge`, `recommend` with a
saved profile, `capacity`/`recommend --capacity`, and `kvtune gateway --config`'s parse.

KVTUNE_FUZZ_SCALE multiplies the number of examples (CI runs 4,000 in total, in ~30 s); any other
scale also draws new random examples instead of CI's fixed ones.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.errors import KvtuneError

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data"
SCALE = float(os.environ.get("KVTUNE_FUZZ_SCALE", "1"))
MODEL = ["--model", "llama-3.1-8b"]


def fuzz_settings(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# --- the real files ---------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


class RealFiles(dict):
    """The real files, as bytes and parsed; a short repr, since hypothesis prints a failing
    example's arguments (and warns, an error here, on a repr of half a megabyte)."""

    def __repr__(self) -> str:
        return f"RealFiles({self['root']})"


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> RealFiles:
    """recommendation.json, gateway.yaml and vllm-serve.sh from `recommend`, a profile from
    `profile --save`, a capacity file from a real vLLM startup log; bytes and parsed trees."""
    from kvtune.capacity.measured import read_vllm_log, write_capacity_file

    root = tmp_path_factory.mktemp("real")
    deploy = root / "deploy"
    made = invoke("recommend", str(REPO / "sample_logs"), *MODEL, "--gpu", "H100-80GB", "--out", str(deploy))
    assert made.exit_code == 0, made.output
    saved = invoke("profile", str(REPO / "sample_logs"), "--save", str(root / "profile.json"), "--json")
    assert saved.exit_code == 0, saved.output
    write_capacity_file(root / "capacity.json", read_vllm_log(DATA / "vllm-0.12-tp2-startup.log"))
    files = {"recommendation": deploy / "recommendation.json", "profile": root / "profile.json",
             "capacity": root / "capacity.json", "gateway": deploy / "gateway.yaml"}
    out = RealFiles(root=root, deploy=deploy, paths=files)
    for name, path in files.items():
        out[name] = path.read_bytes()
    import yaml

    out["trees"] = {name: (yaml.safe_load(out[name]) if name == "gateway" else json.loads(out[name]))
                    for name in files}
    return out


# --- mutations --------------------------------------------------------------------------------

ODD_VALUES = [None, True, False, 0, 1, -1, 2**63, 2**70, -(2**70), 0.5, -0.5, 1e308, -1e308, 1e-320,
              math.nan, math.inf, -math.inf, "", "NaN", "x" * 10_000, "/v1/*", "\u00e9\U0001F600",
              [], [None], [[1, 2], [3]], {}, {"value": None}, {"a": {"b": [1]}}, [0] * 50]
#: What a number becomes: the edges of int64, of a double's exact integers and of a float.
NUMBERS = st.sampled_from([-1, 0, 1, 2**31, 2**53 + 1, 2**62, 2**63, 2**64, 2**70, -(2**63), 1e-320,
                           0.5, 1e15, 1e308, -1e308]) | st.integers(-(2**65), 2**65)
ANY = object()  # a path's last step: some item of a long list
VALUES = st.sampled_from(ODD_VALUES) | st.integers() | st.floats() | st.text(max_size=12) | \
    st.lists(st.integers(-3, 2**40), max_size=5)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into the tree; a long list contributes its first and last items and ANY, which
    the mutation replaces by an index it draws (histogram entries are where numbers go wrong)."""
    out = [prefix]
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(tree, list):
        picks = range(len(tree)) if len(tree) <= 8 else (0, len(tree) - 1)
        for i in picks:
            out.extend(_paths(tree[i], (*prefix, i)))
        if len(tree) > 8:
            out.extend([(*prefix, ANY)] * 3)
    return out


def _parent(tree: Any, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _dump(node: Any, duplicates: dict[int, tuple[dict, list[tuple[str, Any]]]]) -> str:
    """JSON text (NaN/Infinity as Python writes them), with extra (key, value) pairs appended to the
    objects named in `duplicates` (by id; each entry holds its object, so no id is reused) so a key
    appears twice."""
    if isinstance(node, dict):
        items = [*node.items(), *duplicates.get(id(node), (None, []))[1]]
        return "{" + ", ".join(f"{json.dumps(k)}: {_dump(v, duplicates)}" for k, v in items) + "}"
    if isinstance(node, list) and any(isinstance(v, (dict, list)) for v in node):
        return "[" + ", ".join(_dump(v, duplicates) for v in node) + "]"
    return json.dumps(node)


@st.composite
def mutated(draw, tree: Any) -> bytes:
    """1-3 structural mutations of a copy of `tree`, serialized, then perhaps truncated or flipped."""
    tree = copy.deepcopy(tree)
    duplicates: dict[int, tuple[dict, list[tuple[str, Any]]]] = {}
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(tree)
        path = paths[draw(st.integers(0, len(paths) - 1))]
        if path and path[-1] is ANY:
            path = (*path[:-1], draw(st.integers(0, len(_parent(tree, path)) - 1)))
        action = draw(st.sampled_from(["delete", "replace", "replace", "duplicate"]))
        target = _parent(tree, path)[path[-1]] if path else tree
        if isinstance(target, (int, float)) and not isinstance(target, bool) and draw(st.booleans()):
            action = "renumber"
        if not path:
            if action == "replace":
                tree = copy.deepcopy(draw(VALUES))
            continue
        parent = _parent(tree, path)
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "renumber":
            parent[path[-1]] = draw(NUMBERS)
        elif action == "duplicate" and isinstance(parent, dict):
            duplicates.setdefault(id(parent), (parent, []))[1].append((path[-1], copy.deepcopy(draw(VALUES))))
        else:
            parent[path[-1]] = copy.deepcopy(draw(VALUES))  # a copy: the next mutation may edit it
    data = bytearray(_dump(tree, duplicates).encode("utf-8", "surrogatepass"))
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip"]))
    if damage == "truncate" and data:
        del data[draw(st.integers(0, len(data) - 1)):]
    elif damage == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
    return bytes(data)


@st.composite
def damaged_bytes(draw, original: bytes) -> bytes:
    """The file's own bytes truncated or with bytes flipped (keeps YAML comments and layout)."""
    data = bytearray(original)
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data) - 1)):]
    else:
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    return bytes(data)


# --- the outcome: success or one error line ---------------------------------------------------


def assert_clean(result) -> None:
    """Exit 0/1 (ran, verdict), or 2 with one `Error: ...` line; any other exception is a bug."""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr[:500]


def write(real: dict, name: str, data: bytes) -> str:
    path = real["root"] / name
    path.write_bytes(data)
    return str(path)


# --- recommendation.json ----------------------------------------------------------------------


@fuzz_settings(800)
@given(data=st.data())
def test_check_with_a_damaged_recommendation(real, data):
    rec = write(real, "recommendation.json", data.draw(mutated(real["trees"]["recommendation"])))
    deployed = data.draw(st.sampled_from([["gateway.yaml"], ["vllm-serve.sh"], ["vllm-serve.sh", "gateway.yaml"]]))
    args = [arg for name in deployed for arg in ("--deployed", str(real["deploy"] / name))]
    assert_clean(invoke("check", rec, *MODEL, *args, "--json"))


def _bench_summary(rec: Any) -> tuple[dict, list]:
    """What a bench run hands the verdict: a server that answered /metrics, a few results."""
    from kvtune.workload.requests import Outcome, RequestResult

    results = []
    for i, route in enumerate(["/v1/chat/completions", "/v1/summarize", "/other"]):
        r = RequestResult(i, route, 100 + i, 50, 0.0, outcome=Outcome.OK, status=200, attempts=1)
        r.output_tokens, r.finish_reason = 50, "length"
        results.append(r)
    summary = {"server": {"preemptions": 0, "num_blocks": None, "block_size": None, "kv_cache_usage_peak": 0.4,
                          "running_peak": 3},
               "routes": {r.route: {"completed": 1, "truncation_share": 0.0} for r in results}, "goodput": None}
    return summary, results


@fuzz_settings(800)
@given(data=st.data())
def test_bench_expect_with_a_damaged_recommendation(real, data):
    from kvtune.bench.report import verdict
    from kvtune.cli.bench import _parse_expect

    path = write(real, "expect.json", data.draw(mutated(real["trees"]["recommendation"])))
    try:
        expect = _parse_expect(path)
        summary, results = _bench_summary(expect)
        verdict(expect, summary, results)
    except KvtuneError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 1000


# --- saved profiles ---------------------------------------------------------------------------


@fuzz_settings(500)
@given(data=st.data())
def test_profile_merge_with_a_damaged_profile(real, data):
    damaged = write(real, "damaged-profile.json", data.draw(mutated(real["trees"]["profile"])))
    others = data.draw(st.sampled_from([[], [str(real["paths"]["profile"])]]))
    assert_clean(invoke("profile", "--merge", damaged, *others, "--json"))


@fuzz_settings(200)
@given(data=st.data())
def test_recommend_from_a_damaged_profile(real, data):
    damaged = write(real, "damaged-profile.json", data.draw(mutated(real["trees"]["profile"])))
    assert_clean(invoke("recommend", damaged, *MODEL, "--gpu", "H100-80GB", "--json"))


# --- capacity files ---------------------------------------------------------------------------


@fuzz_settings(600)
@given(data=st.data())
def test_capacity_with_a_damaged_capacity_file(real, data):
    path = write(real, "damaged-capacity.json", data.draw(mutated(real["trees"]["capacity"])))
    assert_clean(invoke("capacity", "llama-3.1-8b", "--capacity", path, "--prompt-tokens", "1000",
                        "--max-tokens", "500", "--json"))


@fuzz_settings(150)
@given(data=st.data())
def test_recommend_with_a_damaged_capacity_file(real, data):
    path = write(real, "damaged-capacity.json", data.draw(mutated(real["trees"]["capacity"])))
    assert_clean(invoke("recommend", str(real["paths"]["profile"]), *MODEL, "--capacity", path, "--json"))


# --- gateway.yaml -----------------------------------------------------------------------------


@fuzz_settings(800)
@given(data=st.data())
def test_gateway_config_parse_of_a_damaged_file(real, data):
    from kvtune.gateway.config import load_gateway_config

    if data.draw(st.booleans()):
        text = data.draw(mutated(real["trees"]["gateway"]))  # JSON is YAML
    else:
        text = data.draw(damaged_bytes(real["gateway"]))
    path = write(real, "gateway.yaml", text)
    try:
        load_gateway_config(path)
    except KvtuneError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 1000


@fuzz_settings(150)
@given(data=st.data())
def test_check_with_a_damaged_gateway_yaml(real, data):
    path = write(real, "deployed-gateway.yaml", data.draw(mutated(real["trees"]["gateway"])))
    assert_clean(invoke("check", str(real["paths"]["recommendation"]), *MODEL, "--deployed", path))
