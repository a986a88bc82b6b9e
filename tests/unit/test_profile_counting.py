"""The C counting kernels (`kvtune.profile.counting`) against numpy's counting, through the CLI:
`kvtune profile --json --save` gives the same bytes either way, on the sample logs, every test
log format, the real public traces and a generated million-row Parquet and JSONL log that reaches
every counting path (dense and sparse routes, censored rows, values past the dense limit and the
joint tables, nulls, arrivals, latencies)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import REPO

from kvtune.cli import cli
from kvtune.profile import build, counting

pytestmark = pytest.mark.skipif(not counting.available(), reason="kvtune.ingest._flatscan not built: numpy counts")

DATA = REPO / "tests" / "data"
SHARED_TRACES = Path("/work/shared/traces")
ROWS = 1_000_000


def _profile(paths: list[str], save: Path, *, kernels: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[str, bytes, int]:
    """(--json output, saved profile bytes, kernel calls) of one run in one counting path."""
    calls = 0
    add_counts, add_pair_counts = counting.add_counts, counting.add_pair_counts

    def counted(kernel):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            return kernel(*args, **kwargs)
        return call

    with monkeypatch.context() as m:
        m.setattr(counting, "available", lambda: kernels)
        m.setattr(counting, "add_counts", counted(add_counts))
        m.setattr(counting, "add_pair_counts", counted(add_pair_counts))
        result = CliRunner().invoke(cli, ["profile", *paths, "--json", "-q", "--save", str(save),
                                          "--max-routes", "2000"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout, save.read_bytes(), calls


def _same_both_ways(paths: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dense: bool = True) -> dict:
    """The profile, the same through both paths; dense: some route is busy enough (4,096 rows)
    to count densely, where the kernels run (small logs count sparse in both paths)."""
    numpy_json, numpy_saved, numpy_calls = _profile(paths, tmp_path / "numpy.json", kernels=False,
                                                    monkeypatch=monkeypatch)
    c_json, c_saved, c_calls = _profile(paths, tmp_path / "c.json", kernels=True, monkeypatch=monkeypatch)
    assert numpy_calls == 0 and (c_calls > 0) == dense  # each path really ran
    assert c_json == numpy_json
    assert c_saved == numpy_saved
    return json.loads(c_json)


@pytest.mark.parametrize("path,dense", [("sample_logs", False), ("tests/data/logs", False), ("tests/data/traces", True)])
def test_kernels_count_the_repo_logs_as_numpy_does(path, dense, tmp_path, monkeypatch):
    data = _same_both_ways([str(REPO / path)], tmp_path, monkeypatch, dense)
    assert data["requests"] > 0


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="the shared public traces are not on this machine")
def test_kernels_count_the_public_traces_as_numpy_does(tmp_path, monkeypatch):
    traces = sorted(str(p) for p in SHARED_TRACES.iterdir() if p.suffix in (".csv", ".jsonl"))
    data = _same_both_ways(traces, tmp_path, monkeypatch)
    assert data["requests"] > 20_000


@pytest.fixture(scope="module")
def million_rows(tmp_path_factory) -> tuple[Path, Path]:
    """1M rows as Parquet and JSONL: 5 busy routes, one that turns dense midway (5,000 rows) and
    300 rare ones (sparse), 4 % censored, 2 % null prompts, outputs and prompts past the dense
    limit (2^22) and past the joint lookup table (2^18), arrivals and latencies."""
    rng = np.random.default_rng(31)
    route = np.array([f"/v1/route-{i}" for i in range(5)], dtype=object)[rng.integers(0, 5, ROWS)]
    medium = rng.random(ROWS) < 0.005
    route[medium] = "/v1/medium"
    rare = rng.random(ROWS) < 0.002
    route[rare] = [f"/rare/{i}" for i in rng.integers(0, 300, int(rare.sum()))]
    output = np.clip(np.round(rng.lognormal(5.0, 0.9, ROWS)), 0, 16384).astype(np.int64)
    prompt = np.clip(np.round(rng.lognormal(6.6, 1.2, ROWS)), 1, 131072).astype(np.int64)
    huge = rng.choice(ROWS, 40, replace=False)
    output[huge[:10]] = (1 << 22) + rng.integers(0, 1000, 10)
    prompt[huge[10:25]] = 300_000 + rng.integers(0, 1000, 15)
    prompt[huge[25:]] = (1 << 22) + 7
    finish = np.where(rng.random(ROWS) < 0.04, "length", "stop")
    timestamp = 1_700_000_000 + np.sort(rng.integers(0, 3600_000, ROWS)) / 1000
    latency = rng.integers(50, 60_000, ROWS)
    prompt_valid = rng.random(ROWS) >= 0.02
    columns = {"route": route.astype(str), "prompt_tokens": pa.array(prompt, mask=~prompt_valid),
               "output_tokens": output, "finish_reason": finish, "timestamp_s": timestamp, "latency_ms": latency}
    root = tmp_path_factory.mktemp("million")
    parquet, jsonl = root / "flat.parquet", root / "flat.jsonl"
    pq.write_table(pa.table(columns), parquet, row_group_size=250_000)
    prompts = np.where(prompt_valid, prompt.astype(str), "null")
    line = '{{"route": "{}", "prompt_tokens": {}, "output_tokens": {}, "finish_reason": "{}", ' \
        '"timestamp_s": {}, "latency_ms": {}}}\n'.format
    jsonl.write_text("".join(map(line, route, prompts, output.tolist(), finish, timestamp.tolist(),
                                 latency.tolist())))
    return parquet, jsonl


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_kernels_count_a_million_rows_as_numpy_does(million_rows, fmt, tmp_path, monkeypatch):
    path = million_rows[0] if fmt == "parquet" else million_rows[1]
    data = _same_both_ways([str(path)], tmp_path, monkeypatch)
    assert data["requests"] == ROWS
    assert max(r["output_tokens"]["max"] for r in data["routes"]) >= 1 << 22


def test_a_key_outside_the_counts_is_refused():
    counts = np.zeros((2, 4), np.int64)
    with pytest.raises(ValueError, match="outside counts"):
        counting.add_counts(counts, np.array([1, 0]), 4, np.array([4, 1]))  # key 8 of 8
    with pytest.raises(ValueError, match="outside"):
        counting.add_pair_counts(counts, np.array([0]), 4, np.array([5]), np.array([0]), np.zeros(4, np.int32), 1)
    assert not counts.any()  # both stopped at their first row
    counting.add_counts(counts, np.array([0, 1]), 4, np.array([1, 3]), np.array([False, True]), 0)
    assert counts.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]



def test_rows_of_dense_routes_take_their_slots_straight_from_the_codes(tmp_path, monkeypatch):
    """A batch whose rows all have dense routes takes their slots in one take of the dictionary
    codes (`_Routes.slots_of`), not through global ids: the same bytes as through global ids, on
    rows with rare (sparse) routes early on, a route turning dense midway, null routes and prompts,
    censored rows and arrivals."""
    rng = np.random.default_rng(7)
    rows = 400_000
    route = np.array([f"/v1/r{i}" for i in range(4)], dtype=object)[rng.integers(0, 4, rows)]
    early = np.arange(rows) < 100_000
    rare = early & (rng.random(rows) < 0.01)
    route[rare] = [f"/rare/{i}" for i in rng.integers(0, 40, int(rare.sum()))]
    route[(np.arange(rows) > 250_000) & (rng.random(rows) < 0.03)] = "/v1/late"
    table = pa.table({
        "route": pa.array(route.astype(str), mask=early & (rng.random(rows) < 0.001)),
        "prompt_tokens": pa.array(rng.integers(1, 9000, rows), mask=rng.random(rows) < 0.02),
        "output_tokens": rng.integers(0, 3000, rows),
        "finish_reason": np.where(rng.random(rows) < 0.05, "length", "stop"),
        "timestamp_s": 1_700_000_000 + np.sort(rng.integers(0, 3600_000, rows)) / 1000,
    })
    path = tmp_path / "routes.parquet"
    pq.write_table(table, path, row_group_size=50_000)
    straight: list[bool] = []
    slots_of = build._Routes.slots_of

    def recorded(self, codes, mapping):
        slots = slots_of(self, codes, mapping)
        straight.append(slots is not None and slots.min() >= 0)
        return slots

    with monkeypatch.context() as m:
        m.setattr(build._Routes, "slots_of", recorded)
        fast = _profile([str(path)], tmp_path / "fast.json", kernels=True, monkeypatch=monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(build._Routes, "slots_of", lambda self, codes, mapping: None)
        slow = _profile([str(path)], tmp_path / "slow.json", kernels=True, monkeypatch=monkeypatch)
    assert fast[:2] == slow[:2]
    assert True in straight and False in straight  # both ways ran
    assert json.loads(fast[0])["requests"] == rows
