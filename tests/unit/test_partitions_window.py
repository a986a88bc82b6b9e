"""Hive-partitioned datasets and the --since/--until window, on rows of the Azure conversation trace.

The dataset: the first 400 rows of the real trace spread over four UTC days (2026-11-27 … 30), one
partition per day (`dt=` for JSONL, `year=/month=/day=` for Parquet). A windowed profile must equal
the profile of a file holding exactly the rows inside the window; partitions outside are never
opened (a corrupt one there does not fail the run, while it fails an unwindowed run).
"""

from __future__ import annotations

import csv
import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtune.cli import cli
from kvtune.errors import InputError
from kvtune.ingest import IngestOptions, OnError
from kvtune.ingest.partitions import may_overlap, partition_keys, partition_span, prune
from kvtune.ingest.window import NO_TIMESTAMP, Window, parse_instant
from kvtune.profile.logs import profile_logs

# the header and first 400 rows of Azure's conversation trace, TIMESTAMP kept (tests/data/SOURCES.md)
TRACE = Path(__file__).parents[1] / "data" / "traces" / "AzureLLMInferenceTrace_conv.first-400.csv"
DAYS = [datetime(2026, 11, 27 + d, tzinfo=UTC) for d in range(4)]
PER_DAY = 100


def _rows() -> list[dict]:
    """400 trace rows: day d holds rows 100d … 100d+99, spread every 864 s over its UTC day, each
    keeping the fraction of a second it has in the trace."""
    with TRACE.open(newline="") as f:
        trace = [r for _, r in zip(range(PER_DAY * len(DAYS)), csv.DictReader(f), strict=False)]
    rows = []
    for k, r in enumerate(trace):
        day, slot = divmod(k, PER_DAY)
        fraction = float("0" + r["TIMESTAMP"][r["TIMESTAMP"].index("."):])
        ts = DAYS[day].timestamp() + slot * 864 + fraction
        rows.append({"timestamp_s": ts, "prompt_tokens": int(r["ContextTokens"]),
                     "output_tokens": int(r["GeneratedTokens"])})
    return rows


ROWS = _rows()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "timestamp_s": pa.array([datetime.fromtimestamp(r["timestamp_s"], UTC) for r in rows],
                                pa.timestamp("us", tz="UTC")),
        "prompt_tokens": pa.array([r["prompt_tokens"] for r in rows], pa.int64()),
        "output_tokens": pa.array([r["output_tokens"] for r in rows], pa.int64()),
    })
    pq.write_table(table, path)
    return path


def _day_rows(d: int) -> list[dict]:
    return ROWS[d * PER_DAY:(d + 1) * PER_DAY]


@pytest.fixture(params=["jsonl", "parquet"])
def dataset(request, tmp_path: Path) -> tuple[str, Path, list[Path]]:
    """(kind, dataset root, one file per day)."""
    root = tmp_path / "logs"
    files = []
    for d, day in enumerate(DAYS):
        if request.param == "jsonl":
            files.append(_jsonl(root / f"dt={day:%Y-%m-%d}" / "part-0.jsonl", _day_rows(d)))
        else:
            where = root / f"year={day:%Y}" / f"month={day:%m}" / f"day={day:%d}"
            files.append(_parquet(where / "part-0.parquet", _day_rows(d)))
    return request.param, root, files


def _reference(kind: str, tmp_path: Path, rows: list[dict]) -> Path:
    """One unpartitioned file holding exactly `rows`."""
    write = _jsonl if kind == "jsonl" else _parquet
    return write(tmp_path / "reference" / f"only.{'jsonl' if kind == 'jsonl' else 'parquet'}", rows)


def _windowed(root: Path, since: str | None, until: str | None, **kw):
    return profile_logs([str(root)], IngestOptions(window=Window.parse(since, until), **kw))


@pytest.mark.parametrize(("since", "until"), [
    ("2026-11-29T12:00", "2026-11-30"),  # inside one day: the two days before are pruned
    ("2026-11-28T06:30:00+02:00", "2026-11-30T03:00Z"),  # offsets on both ends
    (None, "2026-11-28T12:00"),  # open start
    ("2026-11-29", None),  # open end
])
def test_window_profiles_exactly_the_rows_inside(dataset, tmp_path: Path, since, until) -> None:
    kind, root, _ = dataset
    lo = -math.inf if since is None else parse_instant(since)
    hi = math.inf if until is None else parse_instant(until)
    inside = [r for r in ROWS if lo <= r["timestamp_s"] < hi]
    assert 0 < len(inside) < len(ROWS)
    windowed = _windowed(root, since, until)
    expected = profile_logs([str(_reference(kind, tmp_path, inside))], IngestOptions())
    assert windowed.routes == expected.routes
    assert windowed.requests == len(inside)
    assert windowed.skipped == {}
    w = windowed.window
    assert w is not None
    read_rows = sum(i.rows for i in windowed.inputs)
    assert w.outside_rows == read_rows - len(inside)
    assert w.pruned_files + len(windowed.inputs) == len(DAYS)


def test_pruned_partitions_are_never_opened(dataset) -> None:
    kind, root, files = dataset
    # 2026-11-27 and -28 lie wholly before 2026-11-29T12:00 in every time zone: corrupt them
    for f in files[:2]:
        f.write_bytes(b"PAR1 not a parquet file PAR1" if kind == "parquet" else b"{not json\n\x00\xff")
    with pytest.raises(InputError):  # without a window they are read, and fail
        profile_logs([str(root)], IngestOptions(on_error=OnError.FAIL))
    windowed = _windowed(root, "2026-11-29T12:00", "2026-11-30", on_error=OnError.FAIL)
    assert windowed.window is not None and windowed.window.pruned_files == 2
    assert [Path(i.path) for i in windowed.inputs] == files[2:]
    assert windowed.requests == sum(1 for r in ROWS if parse_instant("2026-11-29T12:00") <= r["timestamp_s"]
                                    < parse_instant("2026-11-30"))


def test_a_neighbour_partition_is_read_not_pruned(dataset) -> None:
    """2026-11-28 ends 12 h before the window's start only in UTC; in UTC−12 it reaches it, so it is read."""
    _, root, files = dataset
    windowed = _windowed(root, "2026-11-29T06:00", "2026-11-29T07:00")
    assert [Path(i.path) for i in windowed.inputs] == files[1:3]  # 28 (zone slack), 29; 30 starts after 14 h slack
    assert windowed.window is not None and windowed.window.pruned_files == 2


def test_since_inclusive_until_exclusive(tmp_path: Path) -> None:
    at = ROWS[150]["timestamp_s"]
    rows = [dict(ROWS[150]), dict(ROWS[151])]
    rows[0]["timestamp_s"] = at
    rows[1]["timestamp_s"] = at + 864
    path = _jsonl(tmp_path / "two.jsonl", rows)
    since = datetime.fromtimestamp(at, UTC).isoformat()
    until = datetime.fromtimestamp(at + 864, UTC).isoformat()
    got = profile_logs([str(path)], IngestOptions(window=Window.parse(since, until)))
    assert got.requests == 1 and got.window is not None and got.window.outside_rows == 1
    assert got.routes[0].output.observed.max == rows[0]["output_tokens"]
    # the same instant written with an offset
    shifted = (datetime.fromtimestamp(at, UTC) + timedelta(hours=5)).replace(
        tzinfo=None).isoformat() + "+05:00"
    assert parse_instant(shifted) == pytest.approx(at, abs=1e-6)
    # consecutive windows count every row once
    cut = "2026-11-29T08:00"
    counted = []
    for since_, until_ in ((None, cut), (cut, None)):
        try:
            counted.append(profile_logs([str(path)], IngestOptions(window=Window.parse(since_, until_))).requests)
        except InputError as exc:  # a window holding no row is an error, not an empty profile
            assert "no usable row: 2 rows outside --since/--until" in str(exc)
            counted.append(0)
    assert sum(counted) == 2


def test_rows_without_a_timestamp_are_skips_or_errors(tmp_path: Path) -> None:
    rows = [dict(r) for r in ROWS[200:210]]
    del rows[3]["timestamp_s"]
    path = _jsonl(tmp_path / "gap.jsonl", rows)
    got = profile_logs([str(path)], IngestOptions(window=Window.parse("2026-11-01", None)))
    assert got.requests == 9
    assert got.skipped == {NO_TIMESTAMP: 1}
    assert got.skip_examples[NO_TIMESTAMP].startswith(f"{path}:4: timestamp_s:")
    with pytest.raises(InputError, match=r"gap\.jsonl:4: timestamp_s: missing"):
        profile_logs([str(path)], IngestOptions(window=Window.parse("2026-11-01", None), on_error=OnError.FAIL))
    # no window: the row is fine
    assert profile_logs([str(path)], IngestOptions()).requests == 10


def test_cli_window_json_and_stderr(dataset) -> None:
    _, root, _ = dataset
    result = CliRunner().invoke(cli, ["profile", str(root), "--since", "2026-11-29T12:00", "--until",
                                      "2026-11-30", "--json", "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["window"] == {"since": "2026-11-29T12:00:00Z", "until": "2026-11-30T00:00:00Z",
                              "pruned_files": 2, "outside_rows": data["window"]["outside_rows"]}
    assert data["requests"] + data["window"]["outside_rows"] == 2 * PER_DAY
    text = CliRunner().invoke(cli, ["profile", str(root), "--since", "2026-11-29T12:00", "-q"])
    assert text.exit_code == 0
    assert "2 files pruned by partition date" in text.stderr


@pytest.mark.parametrize("bad", ["yesterday", "2026-11-31", "2026-13-01", "", "11/30/2026", "2026-11-30T25:00"])
@pytest.mark.parametrize("option", ["--since", "--until"])
def test_bad_window_values_are_usage_errors(tmp_path: Path, bad: str, option: str) -> None:
    path = _jsonl(tmp_path / "a.jsonl", ROWS[:5])
    result = CliRunner().invoke(cli, ["profile", str(path), option, bad, "-q"])
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.stderr
    assert "ISO date" in result.stderr


def test_empty_window_is_a_usage_error(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "a.jsonl", ROWS[:5])
    result = CliRunner().invoke(cli, ["profile", str(path), "--since", "2026-11-30", "--until", "2026-11-30", "-q"])
    assert result.exit_code == 2
    assert "'--until'" in result.stderr and "empty" in result.stderr


# ------------------------------------------------------------------ parser and filter properties

dates = st.dates(min_value=datetime(1971, 1, 1).date(), max_value=datetime(9998, 12, 30).date())


@given(day=dates, hour=st.none() | st.integers(0, 23), layout=st.sampled_from(["dt", "date", "day", "compact",
                                                                                 "nested"]),
       prefix=st.sampled_from(["", "/data/logs/", "s3://bucket/x=1/", "region=eu/"]))
@settings(max_examples=300, deadline=None)
def test_partition_parser_finds_the_date(day, hour, layout, prefix) -> None:
    if layout == "nested":
        segments = f"year={day.year}/month={day.month:02d}/day={day.day:02d}"
    elif layout == "compact":
        segments = f"dt={day:%Y%m%d}"
    else:
        segments = f"{layout}={day.isoformat()}"
    if hour is not None:
        segments += f"/hour={hour:02d}"
    path = f"{prefix}{segments}/part-00000.snappy.parquet"
    keys = partition_keys(path)
    assert "part-00000.snappy.parquet" not in "".join(keys.values())
    span = partition_span(keys)
    start = datetime(day.year, day.month, day.day) + timedelta(hours=hour or 0)
    assert span == (start, start + (timedelta(hours=1) if hour is not None else timedelta(days=1)))


@given(st.text(st.characters(codec="utf-8"), max_size=30))
def test_partition_parser_never_raises(text: str) -> None:
    keys = partition_keys(f"root/dt={text}/f.jsonl")
    partition_span(keys)  # a value that is not a date names no span; never an exception
    assert may_overlap(keys, Window(0.0, 1.0)) in (True, False)


@given(day=dates, offset_h=st.integers(-12, 14), second=st.integers(0, 86399),
       before=st.floats(0, 1e6), after=st.floats(1e-3, 1e6))
@settings(max_examples=300, deadline=None)
def test_pruning_never_drops_a_row_inside_the_window(day, offset_h, second, before, after) -> None:
    """A row written into its local day's partition, in any zone, is never pruned by a window holding it."""
    local = datetime(day.year, day.month, day.day) + timedelta(seconds=second)
    instant = (local - timedelta(hours=offset_h)).replace(tzinfo=UTC).timestamp()
    window = Window(instant - before, instant + after)
    path = Path(f"logs/dt={day.isoformat()}/p.jsonl")
    assert prune([path], window) == ([path], [])


@given(stamps=st.lists(st.floats(-1e12, 1e12) | st.just(math.nan), max_size=50),
       since=st.none() | st.floats(-1e12, 1e12), width=st.floats(1e-6, 1e12))
def test_window_filter_matches_its_definition(stamps, since, width) -> None:
    """inside() is exactly since <= t < until, NaN (a missing timestamp) never inside."""
    import numpy as np

    until = None if since is None else since + width
    assume(until is None or until > since)  # width lost in rounding: an empty window, refused
    window = Window(since, until)
    got = window.inside(np.array(stamps, dtype=np.float64)).tolist()
    want = [not math.isnan(t) and (since is None or t >= since) and (until is None or t < until) for t in stamps]
    assert got == want


def test_an_empty_window_is_refused_with_its_bounds() -> None:
    with pytest.raises(InputError, match="not before --until"):
        Window(5.0, 5.0)
    with pytest.raises(InputError, match="s is not before"):  # beyond year 9999: shown as seconds
        Window(1e15, 1e15)


def test_a_saved_profile_with_a_window_is_refused(tmp_path: Path) -> None:
    """A saved profile holds histograms, not rows: a window on it would be silently ignored."""
    path = _jsonl(tmp_path / "a.jsonl", ROWS[:5])
    saved = tmp_path / "p.json"
    assert CliRunner().invoke(cli, ["profile", str(path), "--save", str(saved), "-q"]).exit_code == 0
    for args in (["profile", "--merge", str(saved)], ["profile", str(saved)]):
        result = CliRunner().invoke(cli, [*args, "--since", "2026-11-29", "-q"])
        assert result.exit_code == 2
        assert f"{saved}: --since: --since/--until filter log rows" in result.stderr


def test_window_on_the_azure_csv_as_published() -> None:
    """The real trace as it is (CSV, naive 7-digit timestamps read as UTC): the window keeps the
    rows a plain reading of the file puts inside it, and counts the rest as outside."""
    since, until = "2023-11-16T18:16:00", "2023-11-16T18:17:00.5"
    with TRACE.open(newline="") as f:
        stamps = [r["TIMESTAMP"] for r in csv.DictReader(f)]
    lo, hi = parse_instant(since), parse_instant(until)
    inside = sum(lo <= parse_instant(t) < hi for t in stamps)
    assert 0 < inside < len(stamps)
    got = profile_logs([str(TRACE)], IngestOptions(window=Window(lo, hi)))
    assert got.requests == inside
    assert got.window is not None and got.window.outside_rows == len(stamps) - inside
    assert got.window.pruned_files == 0


def test_a_partitioned_dataset_by_url_is_pruned_as_locally(dataset) -> None:
    """The same dataset read through fsspec (a file:// URL, the path a remote store takes): the
    partitions come from the URL's path, the same files are pruned and the profile is the local one."""
    _, root, files = dataset
    for f in files[:2]:  # pruned below: never opened, so their damage never shows
        f.write_bytes(b"{not json\n\x00\xff")
    window = Window.parse("2026-11-29T12:00", "2026-11-30")
    local = profile_logs([str(root)], IngestOptions(window=window, on_error=OnError.FAIL))
    remote = profile_logs([root.as_uri()], IngestOptions(window=window, on_error=OnError.FAIL))
    assert remote.window == local.window and remote.window is not None and remote.window.pruned_files == 2
    assert remote.routes == local.routes and remote.requests == local.requests
    assert [i.path.rsplit("/", 3)[-3:] for i in remote.inputs] == [str(p).rsplit("/", 3)[-3:] for p in files[2:]]
