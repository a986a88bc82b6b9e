"""`kvtune profile` through CliRunner: JSON fields, save/merge, errors and exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.profile.build import load_profile

SAMPLES = REPO / "sample_logs"
ROUTE_KEYS = {
    "route", "requests", "censored", "output_tokens", "prompt_tokens", "total_tokens", "tail",
    "max_tokens_requested", "finish_reasons", "models", "arrival", "latency_ms", "ttft_ms",
}
LENGTH_KEYS = {"p50", "p90", "p95", "p99", "p999", "max", "mean", "lower_bound"}


def run(*args: str):
    return CliRunner().invoke(cli, ["profile", *args], catch_exceptions=False)


def write_flat(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_json_fields_are_present_and_stable():
    result = run(str(SAMPLES / "openai_chat_pairs.jsonl"), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"requests", "routes", "skipped", "inputs", "folded", "skipped_files", "notes", "models"}
    assert data["skipped_files"] == [] and data["notes"] == []
    assert data["models"] == {"meta-llama/Llama-3.1-8B-Instruct": 2400}
    assert data["folded"] == {"routes": 0, "requests": 0, "into": "*"}
    assert data["inputs"] == [{"path": str(SAMPLES / "openai_chat_pairs.jsonl"), "format": "openai-pair", "rows": 2400}]
    assert data["skipped"] == {"count": 0, "reasons": {}, "examples": {}}
    assert [r["route"] for r in data["routes"]] == ["/v1/chat/completions", "/v1/code/completions", "/v1/summarize"]
    for route in data["routes"]:
        assert set(route) == ROUTE_KEYS
        for key in ("output_tokens", "prompt_tokens", "total_tokens", "max_tokens_requested"):
            assert set(route[key]) == LENGTH_KEYS
            assert set(route[key]["lower_bound"]) == LENGTH_KEYS - {"lower_bound"}
        assert set(route["censored"]) == {"count", "share"}
        assert route["censored"]["count"] == route["finish_reasons"].get("length", 0)
        assert set(route["tail"]) == {"class", "rule", "p99_over_p50", "p999_over_p99", "lower_bound"}
        assert route["arrival"]["peak_window_s"] == 60 and route["latency_ms"]["p50"] > 0
    assert data["requests"] == sum(r["requests"] for r in data["routes"]) == 2400
    # every summarize request asked for ≤ 1024 tokens and the longest were cut there: a lower bound
    summarize = data["routes"][2]["output_tokens"]
    assert summarize["max"] == 1024 and summarize["lower_bound"]["max"] is True


def test_percentiles_match_numpy_on_flat_logs(tmp_path):
    rng = np.random.default_rng(9)
    out = rng.integers(1, 3000, 3000)
    prompt = rng.integers(1, 9000, 3000)
    rows = [{"route": "/a" if i % 3 else "/b", "prompt_tokens": int(p), "output_tokens": int(o),
             "finish_reason": "stop"} for i, (p, o) in enumerate(zip(prompt, out, strict=True))]
    result = run(str(write_flat(tmp_path / "flat.jsonl", rows)), "--json")
    data = json.loads(result.output)
    mask_b = np.arange(3000) % 3 == 0
    for route, mask in (("/a", ~mask_b), ("/b", mask_b)):
        (got,) = [r for r in data["routes"] if r["route"] == route]
        for key, q in (("p50", 50), ("p90", 90), ("p95", 95), ("p99", 99), ("p999", 99.9)):
            assert got["output_tokens"][key] == np.percentile(out[mask], q, method="inverted_cdf")
            assert got["prompt_tokens"][key] == np.percentile(prompt[mask], q, method="inverted_cdf")
            assert got["total_tokens"][key] == np.percentile((prompt + out)[mask], q, method="inverted_cdf")


def test_human_output_has_table_histogram_and_rule():
    result = run(str(SAMPLES / "litellm_spend_logs.csv"))
    assert result.exit_code == 0
    assert "/v1/code/completions" in result.output and "out p99" in result.output
    assert "heavier than an exponential" in result.output
    assert "█" in result.output and "read " in result.output


def test_save_then_merge_equals_profiling_everything(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run(str(SAMPLES / "openai_chat_pairs.jsonl"), "--save", str(a), "--json").exit_code == 0
    assert run(str(SAMPLES / "litellm_spend_logs.csv"), "--save", str(b), "--json").exit_code == 0
    merged = run("--merge", str(a), str(b), "--json")
    both = run(str(SAMPLES / "openai_chat_pairs.jsonl"), str(SAMPLES / "litellm_spend_logs.csv"), "--json")
    assert merged.exit_code == 0
    assert json.loads(merged.output)["routes"] == json.loads(both.output)["routes"]
    # a saved profile plus more logs
    mixed = run("--merge", str(a), str(SAMPLES / "litellm_spend_logs.csv"), "--json", "--save", str(tmp_path / "m.json"))
    assert json.loads(mixed.output)["routes"] == json.loads(both.output)["routes"]
    assert load_profile(tmp_path / "m.json").requests == 3600


def test_saved_profile_without_merge_is_an_error(tmp_path):
    saved = tmp_path / "p.json"
    run(str(SAMPLES / "azure_style_trace.csv"), "--save", str(saved), "--json")
    result = run(str(saved))
    assert result.exit_code == 2
    assert result.output == f"Error: {saved}: this is a saved profile; pass --merge to combine saved profiles\n"


def test_bad_profile_file_exits_2_with_one_line(tmp_path):
    saved = tmp_path / "p.json"
    run(str(SAMPLES / "azure_style_trace.csv"), "--save", str(saved), "--json")
    data = json.loads(saved.read_text())
    data["schema_version"] = 7
    saved.write_text(json.dumps(data))
    result = run("--merge", str(saved))
    assert result.exit_code == 2
    assert result.output == (
        f"Error: {saved}: schema_version: unsupported version 7; this kvtune reads version 1\n"
    )


def test_trace_max_is_cap_marks_the_maximum_censored():
    plain = json.loads(run(str(SAMPLES / "azure_style_trace.csv"), "--json").output)["routes"][0]
    capped = json.loads(run(str(SAMPLES / "azure_style_trace.csv"), "--trace-max-is-cap", "--json").output)["routes"][0]
    assert plain["censored"]["count"] == 0 and plain["output_tokens"]["lower_bound"]["max"] is False
    assert capped["censored"]["count"] > 0
    assert capped["output_tokens"]["max"] == 1000 and capped["output_tokens"]["lower_bound"]["max"] is True
    assert capped["output_tokens"]["p50"] == plain["output_tokens"]["p50"]


def test_skips_are_counted_and_strict_makes_them_fatal(tmp_path):
    path = tmp_path / "logs.jsonl"
    path.write_text('{"route": "/a", "output_tokens": 5}\n{oops\n{"route": "/a", "output_tokens": 7}\n')
    data = json.loads(run(str(path), "--json").output)
    assert data["skipped"]["count"] == 1 and data["requests"] == 2
    assert data["skipped"]["examples"]
    result = run(str(path), "--strict")
    assert result.exit_code == 2
    assert result.output.startswith(f"Error: {path}:2:") and result.output.count("\n") == 1
    # --on-error takes its words and reaches ingest as the enum: skip counts, fail stops at the line
    assert json.loads(run(str(path), "--on-error", "skip", "--json").output)["skipped"]["count"] == 1
    result = run(str(path), "--on-error", "fail")
    assert result.exit_code == 2
    assert result.output.startswith(f"Error: {path}:2:") and result.output.count("\n") == 1
    result = run(str(path), "--on-error", "stop")
    assert result.exit_code == 2
    assert "Invalid value for '--on-error': 'stop' is not one of 'skip', 'fail'" in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (("--assume-cap", "5", "--trace-max-is-cap"), "--assume-cap and --trace-max-is-cap exclude each other"),
        (("--field", "output_tokens"), "Invalid value for '--field': expected target=path, got 'output_tokens'"),
    ],
)
def test_usage_errors_exit_2(args, message):
    result = run(str(SAMPLES / "azure_style_trace.csv"), *args)
    assert result.exit_code == 2
    assert message in result.output


def test_help_documents_json_fields():
    result = run("--help")
    assert result.exit_code == 0
    for name in ("lower_bound", "max_tokens_requested", "peak_rate_rps", "skipped", "inputs[]"):
        assert name in result.output


# -- a log truncated while it is read: a clean error line, never a signal -----------------------

_READY_THEN_PROFILE = """
import sys
import kvtune.cli.profile, kvtune.ingest.readers, kvtune.profile.build  # imported before the clock starts
from kvtune.cli import cli
print("ready", flush=True)
cli(["profile", sys.argv[1], "--json", "-q"])
"""


@pytest.mark.slow
def test_profile_survives_truncation_at_random_points(tmp_path):
    """copytruncate under a running `kvtune profile`: each trial truncates a ~200 MB JSONL file
    to a random length at a random moment of the read. The mapped reader died of SIGBUS in most
    such trials; now every run exits 0 (the file was cut before or after the read) or 2 with one
    line naming the file, and some trials must have hit the read itself."""
    import random
    import shutil
    import subprocess
    import sys
    import time

    rng = random.Random(12)
    block = "".join(
        json.dumps({"route": f"/v1/r{i % 7}", "prompt_tokens": rng.randint(1, 9000),
                    "output_tokens": rng.randint(1, 2000), "finish_reason": "stop"}) + "\n"
        for i in range(20_000)
    )
    template = tmp_path / "template.jsonl"
    with open(template, "w") as f:
        for _ in range(100):  # 2M rows
            f.write(block)
    size = template.stat().st_size
    live = tmp_path / "live.jsonl"

    def start():
        shutil.copyfile(template, live)
        child = subprocess.Popen([sys.executable, "-c", _READY_THEN_PROFILE, str(live)], cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "ready\n"
        return child, time.monotonic()

    child, began = start()
    child.communicate(timeout=120)
    assert child.returncode == 0
    read_s = time.monotonic() - began
    outcomes = []
    for _ in range(16):
        child, began = start()
        time.sleep(rng.uniform(0, read_s))
        with open(live, "r+b") as f:
            f.truncate(rng.randrange(size))
        out, err = child.communicate(timeout=120)
        assert child.returncode >= 0, f"killed by signal {-child.returncode}"
        assert child.returncode in (0, 2), err[-2000:]
        if child.returncode == 2:
            assert err.count("\n") == 1 and err.startswith(f"Error: {live}"), err[-2000:]
        outcomes.append(err)
    assert sum("truncated while being read" in e for e in outcomes) >= 1, outcomes


# -- hostile files in every container: exit 0 or one error line, never a traceback -------------

LOGS = REPO / "tests" / "data" / "logs"
_SEEDS = sorted(p for p in LOGS.iterdir() if p.suffix in (".jsonl", ".csv", ".json"))
# what garbles logs in practice and what the code must refuse: bad text, extreme numbers, structure
_HOSTILE = [
    b'"\\ud800"', b'"\\udfff\\ud800"', b"\xff", b"\xed\xa0\x80", b"\xc3", b"\x00", b"\r", b"\n", b",", b'"',
    b"1e308", b"-1e308", b"1e400", b"NaN", b"-Infinity", b"9223372036854775807", b"9223372036854775808",
    b"4611686018427387904", b"-1", b"0", b"1.5", b"true", b"null", b'""', b"{", b"}", b"[", b"]", b":",
    b'"route"', b'"output_tokens"', b'"timestamp_s"', b'"prompt_tokens"', b"2024-13-45T99:99:99Z",
    b'{"route": "a", "output_tokens": 4611686018427387904, "prompt_tokens": 4611686018427387904}',
    b'{"route": "a", "output_tokens": 5, "timestamp_s": 1e308}',
]


@st.composite
def _garbled_text_log(draw):
    """A real log of some schema, mutated at byte level, then maybe compressed and maybe cut."""
    seed = draw(st.sampled_from(_SEEDS))
    data = bytearray(seed.read_bytes())
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "replace", "delete", "duplicate"]))
        token = draw(st.sampled_from(_HOSTILE) | st.binary(min_size=1, max_size=6))
        if op == "insert":
            data[at:at] = token
        elif op == "replace":
            data[at : at + len(token)] = token
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 40))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 200))]
    return seed.name, bytes(data)


_HOSTILE_VALUES = [
    "\ud800", "a\udfff", "\x00", "", 1e308, -1e308, float("nan"), float("inf"), -1, 0, 2**53 + 1, 2**62, 2**63,
    10**30, -(2**63), 1.5, True, None, [], {}, "9223372036854775808", "1e308", "-5", "NaN", "2024-13-45T00:00:00Z",
    "99999-01-01", "length", "/v1/*",
]


@st.composite
def _hostile_values_log(draw):
    """A real log with hostile values put where values go: counts, times, labels, nested fields."""
    import csv
    import io

    seed = draw(st.sampled_from(_SEEDS))
    text = seed.read_text(encoding="utf-8")
    value = st.sampled_from(_HOSTILE_VALUES)
    if seed.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(text)))
        for _ in range(draw(st.integers(1, 4))):
            row = draw(st.integers(1, len(rows) - 1))
            col = draw(st.integers(0, len(rows[row]) - 1))
            rows[row][col] = str(draw(value)).encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        out = io.StringIO()
        csv.writer(out).writerows(rows)
        return seed.name, out.getvalue().encode()
    records = [json.loads(line) for line in text.splitlines() if line.strip()] if seed.suffix == ".jsonl" else [json.loads(text)]
    for _ in range(draw(st.integers(1, 4))):
        node = draw(st.sampled_from(records))
        for _ in range(draw(st.integers(0, 4))):  # walk down to some nested container
            inner = [v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list)) and v]
            if not inner:
                break
            node = draw(st.sampled_from(inner))
        if isinstance(node, dict) and node:
            node[draw(st.sampled_from(sorted(node)))] = draw(value)
        elif isinstance(node, list) and node:
            node[draw(st.integers(0, len(node) - 1))] = draw(value)
    if seed.suffix == ".jsonl":
        return seed.name, "".join(json.dumps(r) + "\n" for r in records).encode()
    return seed.name, json.dumps(records[0]).encode()


@st.composite
def _hostile_parquet(draw):
    """A Parquet file of kvtune columns with extreme, mistyped or null values, maybe corrupted."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    n = draw(st.integers(1, 6))
    ints = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**62, 2**63 - 1, -(2**63)]))
    floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([1e308, -1e308, 1.7e9])
    texts = st.text(max_size=5)
    kinds = {
        "int": lambda: pa.array(draw(st.lists(st.none() | ints, min_size=n, max_size=n)), pa.int64()),
        "float": lambda: pa.array(draw(st.lists(st.none() | floats, min_size=n, max_size=n)), pa.float64()),
        "text": lambda: pa.array(draw(st.lists(st.none() | texts, min_size=n, max_size=n)), pa.string()),
        "binary": lambda: pa.array(draw(st.lists(st.binary(max_size=4), min_size=n, max_size=n)), pa.binary()),
        "bool": lambda: pa.array(draw(st.lists(st.none() | st.booleans(), min_size=n, max_size=n))),
        "time": lambda: pa.array(draw(st.lists(st.none() | ints, min_size=n, max_size=n)), pa.timestamp("us")),
    }
    names = ["route", "model", "prompt_tokens", "output_tokens", "max_tokens", "finish_reason",
             "timestamp_s", "latency_ms", "ttft_ms", "censored"]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=6, unique=True))
    chosen += [name for name in ("route", "output_tokens") if name not in chosen]  # detected as kvtune rows
    columns = {name: kinds[draw(st.sampled_from(sorted(kinds)))]() for name in chosen}
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink)
    data = bytearray(sink.getvalue())
    if draw(st.booleans()):  # corrupt a few bytes (page data, footer or magic)
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] = draw(st.integers(0, 255))
    return "fuzz.parquet", bytes(data)


def _container(draw, name, data):
    """The bytes as written: plain, gzip or zstd (Parquet only plain), maybe cut short."""
    import gzip

    import zstandard

    codec = "" if name.endswith(".parquet") else draw(st.sampled_from(["", ".gz", ".zst"]))
    packed = {"": lambda d: d, ".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}[codec](data)
    if draw(st.integers(0, 4)) == 0 and len(packed) > 1:  # a truncated file or compressed stream
        packed = packed[: draw(st.integers(1, len(packed) - 1))]
    return name + codec, packed


def _assert_clean_exit(result):
    """Exit 0, or exit 2 with exactly one `Error: ...` line on stderr; a traceback fails."""
    if result.exit_code not in (0, 2) or (result.exception is not None and not isinstance(result.exception, SystemExit)):
        import traceback

        raise AssertionError("".join(traceback.format_exception(result.exception))) from result.exception
    if result.exit_code == 2:
        assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr


_FUZZ_OPTIONS = [[], ["--strict"], ["--route-by", "model"], ["--route-by", "route"], ["--format", "kvtune"],
                 ["--trace-max-is-cap"], ["--assume-cap", "5"], ["--field", "output_tokens=usage.completion_tokens"],
                 ["--field", "timestamp_s=created"]]


@pytest.mark.parametrize("reader", ["scan", "duckdb", "blocks"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_exit_0_or_one_error_line(tmp_path_factory, monkeypatch, reader, data):
    """Logs of every schema (JSONL, CSV, JSON documents) with hostile values or garbled bytes, and
    hostile Parquet files, plain, gzip or zstd, whole or cut short, through each JSONL reader: `kvtune profile` exits 0
    (bad rows counted) or 2 with one line, never with a traceback."""
    from kvtune.ingest import flatscan, readers

    name, raw = data.draw(st.one_of(_hostile_values_log(), _garbled_text_log(), _hostile_parquet()))
    name, packed = _container(data.draw, name, raw)
    path = tmp_path_factory.mktemp("fuzz") / name
    path.write_bytes(packed)
    args = ["profile", str(path), "--json", *data.draw(st.sampled_from(_FUZZ_OPTIONS))]
    with monkeypatch.context() as m:
        if reader != "scan":
            m.setattr(flatscan, "available", lambda: False)
        if reader == "blocks":
            m.setattr(readers._Reader, "_json_duckdb", lambda self, plan: self._json_fast(plan))
        result = CliRunner().invoke(cli, args)
    _assert_clean_exit(result)


# -- many routes: bounded memory, the busiest kept exactly, the rest folded with a note ----------

_PEAK_RSS = """
import resource, sys
from kvtune.cli import cli
try:
    cli(["profile", sys.argv[1], "--json", "-q"])
finally:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _peak_rss_mib(path) -> tuple[float, dict]:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stderr.strip().splitlines()[-1]) / 1024, json.loads(proc.stdout)


@pytest.mark.slow
def test_100k_routes_profile_in_bounded_memory(tmp_path):
    """100k distinct routes in a few MB (ids in the path) took over 3 GB (21 GB with prompts): a
    dense row of every histogram per route. Now a route with few rows is a few sparse counts:
    the whole run stays within 200 MiB of profiling a one-route file."""
    rng = np.random.default_rng(4)
    many = tmp_path / "many.jsonl"
    many.write_text("".join(
        f'{{"route":"/r/{i}","output_tokens":{o},"prompt_tokens":{p}}}\n'
        for i, o, p in zip(range(100_000), rng.integers(1, 2000, 100_000), rng.integers(1, 8000, 100_000), strict=True)
    ))
    one = write_flat(tmp_path / "one.jsonl", [{"route": "/r", "output_tokens": 5, "prompt_tokens": 9}])
    base_mib, _ = _peak_rss_mib(one)
    many_mib, data = _peak_rss_mib(many)
    assert data["requests"] == 100_000 and len(data["routes"]) == 2001
    assert data["folded"] == {"routes": 98_000, "requests": 98_000, "into": "*"}
    assert many_mib - base_mib < 200, (base_mib, many_mib)


def _many_routes(tmp_path, routes=2500):
    """Route /r{i} has i % 7 + 1 rows, so the busiest are known; one row per line."""
    rows = [{"route": f"/r{i}", "output_tokens": 10 * i + k, "prompt_tokens": k + 1}
            for i in range(routes) for k in range(i % 7 + 1)]
    return write_flat(tmp_path / "routes.jsonl", rows), rows


def test_routes_beyond_max_routes_fold_into_star_with_a_note(tmp_path):
    path, rows = _many_routes(tmp_path)
    result = CliRunner().invoke(cli, ["profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    kept = [r for r in data["routes"] if r["route"] != "*"]
    assert len(kept) == 2000 and data["requests"] == len(rows)
    star = next(r for r in data["routes"] if r["route"] == "*")
    assert data["folded"] == {"routes": 500, "requests": star["requests"], "into": "*"}
    assert result.stderr == (f"folded 500 routes ({star['requests']:,} requests) into * (--max-routes 2,000 keeps "
                             "the busiest); so many routes usually mean ids in the route key: see --route-by\n")
    # the busiest: 7 rows beat fewer; among equals, the first names
    counts = {f"/r{i}": i % 7 + 1 for i in range(2500)}
    assert {r["route"] for r in kept} == set(sorted(counts, key=lambda r: (-counts[r], r))[:2000])
    human = CliRunner().invoke(cli, ["profile", str(path), "--max-routes", "3"])
    assert human.exit_code == 0 and "folded 2,497 routes" in human.stderr


def test_kept_routes_are_exactly_as_without_folding(tmp_path):
    path, _ = _many_routes(tmp_path, routes=40)
    everything = json.loads(run(str(path), "--json").output)
    folded = json.loads(CliRunner().invoke(cli, ["profile", str(path), "--json", "--max-routes", "5"]).stdout)
    by_name = {r["route"]: r for r in everything["routes"]}
    kept = [r for r in folded["routes"] if r["route"] != "*"]
    assert len(kept) == 5 and all(r == by_name[r["route"]] for r in kept)
    star = next(r for r in folded["routes"] if r["route"] == "*")
    assert star["requests"] == everything["requests"] - sum(r["requests"] for r in kept)
    assert star["output_tokens"]["max"] == max(r["output_tokens"]["max"] for r in everything["routes"]
                                               if r["route"] not in {k["route"] for k in kept})


def test_saved_profiles_and_merges_fold_the_same_way(tmp_path):
    path, _ = _many_routes(tmp_path, routes=40)
    saved = tmp_path / "p.json"
    assert CliRunner().invoke(cli, ["profile", str(path), "--save", str(saved), "--json"]).exit_code == 0
    direct = json.loads(CliRunner().invoke(cli, ["profile", str(path), "--json", "--max-routes", "5"]).stdout)
    merged = json.loads(CliRunner().invoke(cli, ["profile", "--merge", str(saved), "--json", "--max-routes", "5"]).stdout)
    assert merged["routes"] == direct["routes"] and merged["folded"] == direct["folded"]


def test_max_routes_default_is_the_profilers():
    from kvtune.cli.options import MAX_ROUTES
    from kvtune.profile.build import MAX_ROUTES as LIBRARY

    assert MAX_ROUTES == LIBRARY
    assert "--max-routes N" in run("--help").output


# -- --save: all or nothing, never over something that is not a regular file -------------------


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "device", "proc"])
def test_save_refuses_what_is_not_a_regular_file(tmp_path, kind, private_device):
    """--save replaced a symlink, FIFO or device with a regular file (or died writing /proc)."""
    import os
    import stat
    from pathlib import Path

    real = tmp_path / "real.json"
    real.write_text("keep")
    # never the machine's /dev/null: the old writer replaced it with a regular file
    target = private_device(tmp_path) if kind == "device" else Path("/proc/self/status") if kind == "proc" \
        else tmp_path / "p.json"
    if kind == "symlink":
        target.symlink_to(real)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    result = CliRunner().invoke(cli, ["profile", str(SAMPLES / "azure_style_trace.csv"), "--json", "--save", str(target)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"Error: {target}: ") and result.stderr.count("\n") == 1, result.stderr
    assert real.read_text() == "keep"
    if kind == "symlink":
        assert target.is_symlink()
    if kind == "device":
        assert stat.S_ISCHR(os.lstat(target).st_mode)
    kept = {"device": ["null-device"], "proc": []}.get(kind, ["p.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["real.json", *kept])


def test_an_archive_is_named_with_what_to_do(tmp_path):
    """A .tar.gz of the sample logs said "not CSV text: the file holds NUL bytes"."""
    import tarfile
    import zipfile
    from bz2 import compress as bz2_compress

    archives = {"logs.tar.gz": "a tar archive, not a log file: extract it (tar xf logs.tar.gz)",
                "logs.tar": "a tar archive, not a log file: extract it (tar xf logs.tar)",
                "logs.zip": "a zip archive, not a log file: extract it (unzip logs.zip)"}
    for name in archives:
        path = tmp_path / name
        if name.endswith(".zip"):
            with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
                archive.write(SAMPLES / "openai_chat_pairs.jsonl", "openai_chat_pairs.jsonl")
        else:
            with tarfile.open(path, "w:gz" if name.endswith(".gz") else "w") as archive:
                archive.add(SAMPLES, "sample_logs")
    for name, says in archives.items():
        path = tmp_path / name
        result = run(str(path))
        assert result.exit_code == 2
        assert result.output == f"Error: {path}: {says} and pass the files or their directory\n"
    bz2 = tmp_path / "chat.jsonl.bz2"
    bz2.write_bytes(bz2_compress((SAMPLES / "openai_chat_pairs.jsonl").read_bytes()))
    result = run(str(bz2))
    assert result.exit_code == 2
    assert result.output == (f"Error: {bz2}: bzip2-compressed, not a log file: kvtune reads gzip and zstd: "
                             "recompress it (bzip2 -dc chat.jsonl.bz2 | gzip > chat.jsonl.gz)\n")


def test_a_latency_past_any_real_one_is_left_out_like_a_negative_one(tmp_path):
    """A latency of 1e300 ms (the fuzzer's corrupted Parquet double) used to land in a log bin whose
    value overflows a float: a RuntimeWarning, an Infinity in the JSON. Past 1e12 ms (31 years) it
    is not a latency: left out, as a negative one is (every reader's rows meet in kvtune.profile.build)."""
    path = tmp_path / "log.jsonl"
    write_flat(path, [{"route": "/v1/chat", "output_tokens": 10, "latency_ms": ms} for ms in (120.0, 1e300, -5.0)])
    result = run(str(path), "--json")
    assert result.exit_code == 0, result.output
    latency = json.loads(result.stdout)["routes"][0]["latency_ms"]
    assert latency["requests"] == 1 and latency["p50"] == pytest.approx(120, rel=0.01)
