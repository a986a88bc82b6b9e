"""Readers: real traces against pandas, compression, Parquet/CSV/JSONL paths, bad input, fuzzing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import TRACES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.errors import InputError, KvtuneError, UnknownNameError
from kvtune.ingest import (
    COLUMNS,
    IngestOptions,
    OnError,
    columns,
    expand_paths,
    flatscan,
    jsonl,
    parse_on_error,
    read_logs,
    readers,
    tabular,
)

LOGS = Path(__file__).parents[1] / "data" / "logs"


def read(paths, **opts):
    it, stats = read_logs([str(p) for p in paths], IngestOptions(**opts))
    batches = list(it)
    assert all(b.schema == columns.SCHEMA for b in batches)
    table = pa.Table.from_batches(batches, schema=columns.SCHEMA)
    # route is dictionary-encoded per batch; compare tables on its values
    table = table.set_column(0, "route", table.column("route").cast(pa.string()))
    return table.combine_chunks(), stats


@pytest.mark.parametrize(
    "name, out_col, in_col, reader",
    [
        ("AzureLLMInferenceTrace_conv.csv", "GeneratedTokens", "ContextTokens", pd.read_csv),
        ("AzureLLMInferenceTrace_code.csv", "GeneratedTokens", "ContextTokens", pd.read_csv),
        ("mooncake_conversation_trace.excerpt.jsonl", "output_length", "input_length", None),
        ("mooncake_synthetic_trace.excerpt.jsonl", "output_length", "input_length", None),
        (
            "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.excerpt.csv",
            "num_decode_tokens",
            "num_prefill_tokens",
            pd.read_csv,
        ),
    ],
)
def test_real_traces_match_pandas(name, out_col, in_col, reader):
    path = TRACES / name
    frame = reader(path) if reader else pd.read_json(path, lines=True)
    table, stats = read([path])
    assert table.num_rows == len(frame) == stats.rows_ok == stats.rows_read
    assert not stats.skipped
    assert table.column("output_tokens").to_numpy().sum() == frame[out_col].sum()
    assert table.column("prompt_tokens").to_numpy().sum() == frame[in_col].sum()
    assert table.schema.names == list(COLUMNS)


def test_azure_timestamps_and_mooncake_ms():
    table, _ = read([TRACES / "AzureLLMInferenceTrace_code.first-200.csv"])
    expected = pd.to_datetime(pd.read_csv(TRACES / "AzureLLMInferenceTrace_code.first-200.csv")["TIMESTAMP"])
    got = table.column("timestamp_s").to_numpy()
    assert len(got) == 200 and abs(got - expected.astype("int64").to_numpy() / 1e9).max() < 1e-6
    table, _ = read([TRACES / "mooncake_synthetic_trace.excerpt.jsonl"])
    frame = pd.read_json(TRACES / "mooncake_synthetic_trace.excerpt.jsonl", lines=True)
    assert table.column("timestamp_s").to_numpy()[-1] == frame["timestamp"].iloc[-1] / 1000


def _native_table(n=5000, seed=1):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = rng.integers(1, 600, n)
    return pa.table(
        {
            "route": rng.choice(["chat", "code", "/v1/completions"], n),
            "prompt_tokens": rng.integers(1, 5000, n),
            "output_tokens": out,
            "max_tokens": np.full(n, 512),
            "finish_reason": np.where(out >= 512, "length", "stop"),
            "timestamp_s": np.arange(n) * 0.25,
        }
    )


def _write_jsonl(table, path, opener=open):
    with opener(path, "wt") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row) + "\n")


def test_native_formats_agree(tmp_path):
    src = _native_table()
    pq.write_table(src, tmp_path / "a.parquet", row_group_size=1000)
    _write_jsonl(src, tmp_path / "a.jsonl")
    src.to_pandas().to_csv(tmp_path / "a.csv", index=False)
    tables = [read([tmp_path / f"a.{ext}"])[0] for ext in ("parquet", "jsonl", "csv")]
    for t in tables:
        assert t.num_rows == src.num_rows
        assert t.column("output_tokens").to_pylist() == src.column("output_tokens").to_pylist()
        assert t.column("route").to_pylist() == src.column("route").to_pylist()
        assert t.column("censored").to_pylist() == [o >= 512 for o in src.column("output_tokens").to_pylist()]
    assert tables[0].equals(tables[1]) and tables[1].equals(tables[2])


def test_gzip_and_zstd_round_trips(tmp_path):
    src = _native_table(3000)
    plain = tmp_path / "p.jsonl"
    _write_jsonl(src, plain)
    data = plain.read_bytes()
    (tmp_path / "g.jsonl.gz").write_bytes(gzip.compress(data[:50000]) + gzip.compress(data[50000:]))
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    src.to_pandas().to_csv(tmp_path / "c.csv.gz", index=False, compression="gzip")
    expected = read([plain])[0]
    for name in ("g.jsonl.gz", "z.jsonl.zst", "c.csv.gz"):
        table, stats = read([tmp_path / name])
        assert table.equals(expected), name
        assert stats.files[0].rows == 3000


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_truncated_compression_is_a_file_error(tmp_path, codec):
    data = b"".join(json.dumps(r).encode() + b"\n" for r in _native_table(3000).to_pylist())
    packed = gzip.compress(data) if codec == "gzip" else zstandard.ZstdCompressor().compress(data)
    path = tmp_path / ("t.jsonl.gz" if codec == "gzip" else "t.jsonl.zst")
    path.write_bytes(packed[: len(packed) * 2 // 3])
    with pytest.raises(InputError, match=f"truncated {codec}"):
        read([path])


def test_malformed_lines_counted_with_exact_line_numbers(tmp_path):
    lines = [json.dumps({"route": "a", "output_tokens": i}) for i in range(1, 301)]
    lines[16] = '{"route": "a", "output_tokens": "abc"}'  # line 17
    lines[40] = '{"route": "a", "output_tokens": 5'  # line 41: cut JSON
    lines[99] = '{"route": "a", "output_tokens": -3}'  # line 100
    lines[150] = '{"route": "a"}'  # line 151
    lines[200] = "[1, 2]"  # line 201
    lines[250] = '{"route": "a", "output_tokens": 7.5}'  # line 251
    path = tmp_path / "logs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    table, stats = read([path])
    assert stats.rows_read == 300 and stats.rows_ok == 294 == table.num_rows
    assert stats.skipped == {
        "token count not an integer": 2,
        "malformed JSON": 1,
        "negative token count": 1,
        "missing output token count": 1,
        "not a JSON object": 1,
    }
    assert stats.examples["token count not an integer"] == f'{path}:17: output_tokens: not an integer: "abc"'
    assert stats.examples["malformed JSON"].startswith(f"{path}:41: malformed JSON")
    assert stats.examples["negative token count"] == f"{path}:100: output_tokens: negative count: -3"
    assert stats.examples["missing output token count"] == f"{path}:151: output_tokens: missing"


def test_on_error_fail_and_strict_raise_at_the_first_bad_line(tmp_path):
    path = tmp_path / "logs.jsonl"
    good = [json.dumps({"route": "a", "output_tokens": 3})] * 100
    path.write_text("\n".join(good[:16] + ['{"route": "a", "output_tokens": "abc"}'] + good) + "\n")
    for opts in ({"on_error": OnError.FAIL}, {"strict": True}):
        with pytest.raises(InputError) as exc:
            read([path], **opts)
        assert str(exc.value) == f'{path}:17: output_tokens: not an integer: "abc"'


def test_on_error_words_are_parsed_at_the_edges_and_only_the_enum_reaches_ingest(tmp_path):
    assert parse_on_error("skip") is OnError.SKIP and parse_on_error("fail") is OnError.FAIL
    with pytest.raises(UnknownNameError, match="^on_error: unknown on_error 'stop'; use skip or fail$"):
        parse_on_error("stop")
    path = tmp_path / "logs.jsonl"
    path.write_text('{"route": "a", "output_tokens": 3}\n')
    # a word where the enum belongs would otherwise read as "skip": refused before any file is read
    refused = r"^--on-error: on_error must be OnError.SKIP or OnError.FAIL, not 'fail'"
    with pytest.raises(UnknownNameError, match=refused):
        read([path], on_error="fail")


def test_negative_count_in_fast_path_fails_with_line(tmp_path):
    path = tmp_path / "n.jsonl"
    rows = [{"route": "a", "output_tokens": 1}] * 10 + [{"route": "a", "output_tokens": -1}]
    path.write_text("\n\n".join(json.dumps(r) for r in rows))  # blank lines between records
    with pytest.raises(InputError, match=r"n.jsonl:21: output_tokens: negative count: -1"):
        read([path], on_error=OnError.FAIL)


def test_nested_schema_bad_field_names_its_path(tmp_path):
    record = json.loads((LOGS / "openai_chat.jsonl").read_text().splitlines()[0])
    record["usage"]["completion_tokens"] = "abc"
    path = tmp_path / "chat.jsonl"
    path.write_text((LOGS / "openai_chat.jsonl").read_text() + json.dumps(record) + "\n")
    with pytest.raises(InputError) as exc:
        read([path], on_error=OnError.FAIL)
    assert str(exc.value) == f'{path}:4: usage.completion_tokens: not an integer: "abc"'


def test_csv_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="no known log schema"):
        read([bad])
    mapped = tmp_path / "m.csv"
    mapped.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="no column 'out'"):
        read([mapped], fields={"output_tokens": "out"})
    header = tmp_path / "h.csv"
    header.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(InputError, match="no data rows"):
        read([header])


def test_csv_bad_value_falls_back_to_rows(tmp_path):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:46.68,{i},{i}" for i in range(1, 2001)]
    lines[1500] = "2023-11-16 18:15:46.68,10,abc"
    lines[1700] = "2023-11-16 18:15:46.68,10"
    path = tmp_path / "azure.csv"
    path.write_text("\n".join(lines) + "\n")
    table, stats = read([path])
    assert stats.rows_read == 2000 and table.num_rows == 1998
    assert stats.examples["token count not an integer"] == f'{path}:1501: GeneratedTokens: not an integer: "abc"'
    assert stats.examples["malformed CSV row"].startswith(f"{path}:1701:")


def test_file_level_errors(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match="empty file"):
        read([empty])
    blank = tmp_path / "b.jsonl.gz"
    blank.write_bytes(gzip.compress(b"\n\n"))
    with pytest.raises(InputError, match="empty file"):
        read([blank])
    unknown = tmp_path / "u.jsonl"
    unknown.write_text('{"foo": 1}\n')
    with pytest.raises(InputError, match=r"no known log schema \(keys seen: foo\)"):
        read([unknown])
    with pytest.raises(UnknownNameError, match="unknown format 'nope'"):
        read([LOGS / "kvtune.jsonl"], format="nope")
    with pytest.raises(UnknownNameError, match="unknown field target"):
        read([LOGS / "kvtune.jsonl"], fields={"outputs": "x"})
    with pytest.raises(InputError, match="is read from JSON, not CSV"):
        read([LOGS / "azure_conv.csv"], format="openai")
    notpq = tmp_path / "x.parquet"
    notpq.write_text("hello")
    with pytest.raises(InputError, match="not a Parquet file"):
        read([notpq])


def test_expand_paths(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/a.jsonl", "d/sub/b.csv.gz", "d/sub/notes.txt", "d/.hidden.jsonl"):
        (tmp_path / name).write_text("x")
    found = expand_paths([str(tmp_path / "d")])
    assert [p.name for p in found] == ["a.jsonl", "b.csv.gz"]
    assert [p.name for p in expand_paths([str(tmp_path / "d" / "**" / "*.gz")])] == ["b.csv.gz"]
    with pytest.raises(InputError, match="no files match"):
        expand_paths([str(tmp_path / "*.parquet")])
    with pytest.raises(InputError, match="no such file"):
        expand_paths([str(tmp_path / "missing.jsonl")])


def test_parquet_with_field_mapping_and_dictionary_routes(tmp_path):
    table = pa.table(
        {
            "endpoint": pa.array(["a", "b", "a"]).dictionary_encode(),
            "gen": pa.array([1, 2, 3], pa.int32()),
            "stop": ["stop", "MAX_TOKENS", None],
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    out, stats = read(
        [tmp_path / "m.parquet"],
        format="fields",
        fields={"output_tokens": "gen", "route": "endpoint", "finish_reason": "stop"},
    )
    assert out.column("route").to_pylist() == ["a", "b", "a"]
    assert out.column("finish_reason").to_pylist() == ["stop", "length", None]
    assert out.column("censored").to_pylist() == [False, True, False]
    assert stats.files[0].format == "fields"


def test_parquet_float_counts_go_row_by_row(tmp_path):
    pq.write_table(pa.table({"route": ["a", "b"], "output_tokens": [3.0, 2.5]}), tmp_path / "f.parquet")
    out, stats = read([tmp_path / "f.parquet"])
    assert out.column("output_tokens").to_pylist() == [3]
    assert stats.examples["token count not an integer"] == f"{tmp_path / 'f.parquet'}:2: output_tokens: not an integer: 2.5"


@pytest.mark.parametrize("group_rows", [300_000, 1_000])
def test_parquet_batches_are_bounded_in_rows_whatever_the_row_groups(tmp_path, group_rows):
    """Rows per batch stay within 2^17 (a small row group is a batch of its own), so the memory a
    batch holds does not follow a writer's row groups: a big row group is read in pieces, the rows
    in their order."""
    rows = 300_000
    table = pa.table({"route": ["/a", "/b", "/c"] * (rows // 3), "output_tokens": list(range(rows))})
    pq.write_table(table, tmp_path / "g.parquet", row_group_size=group_rows)
    it, stats = read_logs([str(tmp_path / "g.parquet")], IngestOptions())
    sizes, outputs = [], []
    for batch in it:
        sizes.append(batch.num_rows)
        outputs.extend(batch.column("output_tokens").to_pylist())
    assert max(sizes) == min(group_rows, 1 << 17) and sum(sizes) == rows
    assert outputs == list(range(rows)) and stats.rows_ok == rows


def test_progress_reaches_total(tmp_path):
    src = _native_table(2000)
    _write_jsonl(src, tmp_path / "a.jsonl")
    seen = []
    it, _ = read_logs([str(tmp_path / "a.jsonl")], IngestOptions(), progress=lambda d, t: seen.append((d, t)))
    list(it)
    assert seen and seen[-1][0] == seen[-1][1] == (tmp_path / "a.jsonl").stat().st_size


def test_tokenizer_counts_text_without_usage(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    record = {
        "request": {"model": "m", "messages": [{"role": "user", "content": "hello hello world"}]},
        "response": {
            "object": "chat.completion",
            "model": "m",
            "choices": [{"message": {"content": "hello world again"}, "finish_reason": "stop"}],
        },
    }
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    _, stats = read([path])
    assert stats.skipped == {"no token counts (use --tokenizer)": 1}
    out, _ = read([path], tokenizer=str(tmp_path))
    assert out.column("output_tokens").to_pylist() == [3]
    assert out.column("prompt_tokens").to_pylist() == [3]
    with pytest.raises(InputError, match="no such tokenizer file"):
        read([path], tokenizer=str(tmp_path / "nowhere" / "x"))
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(InputError, match="has no tokenizer.json"):
        read([path], tokenizer=str(tmp_path / "empty-model"))


@pytest.mark.parametrize("scanner", [True, False])
def test_fast_and_row_paths_agree(tmp_path, monkeypatch, scanner):
    """A block that fails to parse is bisected and read row by row; rows are the same, whether
    the blocks around it were scanned (C scanner) or parsed by pyarrow."""
    src = _native_table(3000)
    path = tmp_path / "a.jsonl"
    _write_jsonl(src, path)
    fast, _ = read([path])
    text = path.read_text().splitlines()
    text[1234] = text[1234].replace('"route": ', '"route": 7, "x": ')  # pyarrow rejects, rows accept
    path.write_text("\n".join(text) + "\n")
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 20000)
    monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 20000)
    if not scanner:
        monkeypatch.setattr(flatscan, "available", lambda: False)
        monkeypatch.setattr(readers._Reader, "_json_duckdb", lambda self, plan: self._json_fast(plan))
    calls = []
    monkeypatch.setattr(jsonl, "_parse_block", lambda *a, _f=jsonl._parse_block: calls.append(1) or _f(*a))
    mixed, stats = read([path])
    assert (len(calls) > 10) != scanner  # many 20 kB pyarrow blocks without the scanner, none with it
    assert mixed.num_rows == 3000 and not stats.skipped
    assert mixed.column("output_tokens").to_pylist() == fast.column("output_tokens").to_pylist()
    assert mixed.column("route").to_pylist()[1234] == "7"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_keys = st.sampled_from(
    ["route", "output_tokens", "prompt_tokens", "max_tokens", "finish_reason", "timestamp_s",
     "latency_ms", "censored", "model", "usage", "object", "choices", "type", "stop_reason",
     "resourceSpans", "custom_id", "response", "error", "input_length", "output_length"]
)
_records = st.dictionaries(_keys | st.text(max_size=5), _json_values, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.one_of(
            _records.map(json.dumps),
            _json_values.map(json.dumps),
            st.text(max_size=30),
            st.binary(max_size=30).map(lambda b: b.decode("latin-1")),
        ),
        min_size=1,
        max_size=6,
    ),
    fmt=st.sampled_from([None, "kvtune", "openai", "otel", "anthropic", "openai-batch", "langfuse", "helicone", "litellm-payload", "openai-responses", "openai-pair", "mooncake"]),
)
def test_fuzzed_lines_give_kvtune_errors_or_counted_skips(tmp_path, lines, fmt):
    good = json.dumps({"route": "r", "output_tokens": 5})
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join([good, *(ln.replace("\n", " ") for ln in lines)]) + "\n", encoding="utf-8")
    for on_error in (OnError.SKIP, OnError.FAIL):
        try:
            table, stats = read([path], format=fmt, on_error=on_error)
        except KvtuneError:
            continue
        assert stats.rows_read == stats.rows_ok + sum(stats.skipped.values())
        assert table.num_rows == stats.rows_ok
        assert table.schema.names == list(COLUMNS)
        assert all(v >= 0 for v in table.column("output_tokens").to_pylist())


# values DuckDB would convert leniently (12.5 → 12, true → 1, numbers and objects → text), lines
# it rejects, and checks that fail: each must give exactly what the block reader gives
_TRICKY = [
    '{"route": "a", "output_tokens": 12.5}', '{"route": "a", "output_tokens": 12.0}',
    '{"route": "a", "output_tokens": "12"}', '{"route": "a", "output_tokens": true}', "null", "[1]",
    '{"route": 7, "output_tokens": 3}', '{"route": 1.5, "output_tokens": 3}', '{"route": {"x": 1}, "output_tokens": 3}',
    '{"route": "", "output_tokens": 3}', '{"output_tokens": -1}', '{"route": "b"}', '{"route": "b", "output_tokens": 3',
    "", "   ", '{"route": "b", "output_tokens": 3, "output_tokens": 4}',
    '{"route": "b\\u00e9\\/", "output_tokens": 3, "finish_reason": "max_tokens"}',
    '{"route": "a", "output_tokens": 99999999999999999999}', '{"route": "a", "output_tokens": 5, "latency_ms": 1e400}',
    '{"route": "a", "output_tokens": 5, "timestamp_s": "2024-01-01T00:00:00Z"}', '{"route": "a", "output_tokens": 5, "censored": 1}',
    '{"route": "a", "output_tokens": 5, "finish_reason": 3}', '{"Route": "a", "output_tokens": 5}',
]


def _through_blocks(monkeypatch, paths, **opts):
    with monkeypatch.context() as m:
        m.setattr(flatscan, "available", lambda: False)
        m.setattr(readers._Reader, "_json_duckdb", lambda self, plan: self._json_fast(plan))
        return read(paths, **opts)


@pytest.mark.parametrize("position", [None, 0, 4000, 11999])
@pytest.mark.parametrize("codec", ["", ".gz", ".zst"])
@pytest.mark.parametrize("fast", ["scan", "duckdb"])
def test_fast_jsonl_paths_equal_block_reader(tmp_path, monkeypatch, position, codec, fast):
    """The C scanner (blocks it declines go to pyarrow) and the DuckDB path (used without the
    scanner) give exactly what the block reader gives, tricky lines anywhere included."""
    if fast == "scan":
        if not flatscan.available():
            pytest.skip("kvtune.ingest._flatscan is not built (test_flatscan checks that it is)")
        monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 64 << 10)  # many blocks: scanned and declined ones mix
    else:
        pytest.importorskip("duckdb")
        monkeypatch.setattr(flatscan, "available", lambda: False)
    import random

    rng = random.Random(position)
    rows = [
        {"route": rng.choice(["/v1/chat", "/v1/code"]), "output_tokens": rng.randint(1, 900),
         "prompt_tokens": rng.randint(1, 5000), "finish_reason": rng.choice(["stop", "length"]),
         "latency_ms": rng.random() * 1000, "timestamp_s": 1.7e9 + i * 0.37}
        for i in range(12000)
    ]
    lines = [json.dumps(r) for r in rows]
    if position is not None:  # a few tricky lines from there on: DuckDB hands over mid-file
        for k, bad in enumerate(rng.sample(_TRICKY, 3)):
            lines.insert(position + 7 * k, bad)
    data = ("\n".join(lines) + "\n").encode()
    packed = {"": data, ".gz": gzip.compress(data), ".zst": zstandard.ZstdCompressor().compress(data)}[codec]
    path = tmp_path / f"t.jsonl{codec}"
    path.write_bytes(packed)
    for opts in ({}, {"assume_cap": 800}):
        table, stats = read([path], **opts)
        expected, expected_stats = _through_blocks(monkeypatch, [path], **opts)
        assert table.equals(expected)
        assert dict(stats.skipped) == dict(expected_stats.skipped)
        assert stats.examples == expected_stats.examples
        assert (stats.rows_read, stats.rows_ok) == (expected_stats.rows_read, expected_stats.rows_ok)


def test_skip_records_finds_the_next_line(tmp_path):
    import io

    data = b'{"a": 1}\n\n  \n{"a": 2}\r\n{"a": 3}\n\n{"a": 4}'
    assert jsonl._skip_records(io.BytesIO(data), 1) == (b'\n  \n{"a": 2}\r\n{"a": 3}\n\n{"a": 4}', 2)
    assert jsonl._skip_records(io.BytesIO(data), 2) == (b'{"a": 3}\n\n{"a": 4}', 5)
    assert jsonl._skip_records(io.BytesIO(data), 3) == (b'\n{"a": 4}', 6)
    assert jsonl._skip_records(io.BytesIO(data), 4) == (b"", 8)


@pytest.mark.parametrize("line", [
    '{"resourceSpans": true}',
    '{"resourceSpans": [{"scopeSpans": 7}]}',
    '{"resourceSpans": [{"scopeSpans": [{"spans": "x"}]}]}',
])
def test_mistyped_otlp_arrays_are_counted_skips(tmp_path, line):
    """Found by the fuzz test: an OTLP array of the wrong type skips the record, naming the field."""
    path = tmp_path / "spans.jsonl"
    path.write_text(line + "\n")
    table, stats = read([path], format="otel")
    assert table.num_rows == 0
    assert stats.skipped == {"malformed record structure": 1}
    with pytest.raises(KvtuneError, match="expected a list"):
        read([path], format="otel", on_error=OnError.FAIL)


# -- a log that changes under the reader (logrotate's copytruncate) -----------------------------


def _truncate_after_first_batch(paths, cut, **opts):
    """Read until the first batch, truncate the file to `cut` bytes, read on."""
    it, stats = read_logs([str(p) for p in paths], IngestOptions(**opts))
    first = next(it)
    assert first.num_rows
    with open(paths[0], "r+b") as f:
        f.truncate(cut)
    return list(it), stats


@pytest.mark.parametrize("path_kind", ["scan", "duckdb", "blocks", "records", "csv"])
@pytest.mark.parametrize("cut", [0, 123_457])
def test_truncated_while_read_is_one_input_error(tmp_path, monkeypatch, path_kind, cut):
    """A file that shrinks mid-read ends the read with an InputError naming it, on every path
    (the C scanner's once mapped the file and died of SIGBUS), never a partial profile."""
    src = _native_table(200_000 if path_kind == "csv" else 40_000)  # pyarrow reads CSV far ahead
    path = tmp_path / ("t.csv" if path_kind == "csv" else "t.jsonl")
    if path_kind == "csv":
        src.to_pandas().to_csv(path, index=False)
    else:
        _write_jsonl(src, path)
    monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 64 << 10)
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 64 << 10)
    monkeypatch.setattr(readers, "SINK_ROWS", 1000)
    monkeypatch.setattr(tabular, "CSV_BLOCK_BYTES", 64 << 10)
    if path_kind == "scan" and not flatscan.available():
        pytest.skip("kvtune.ingest._flatscan is not built")
    if path_kind in ("duckdb", "blocks"):
        monkeypatch.setattr(flatscan, "available", lambda: False)
    if path_kind == "duckdb":
        pytest.importorskip("duckdb")
        monkeypatch.setattr(jsonl, "DUCKDB_BATCH_ROWS", 2048)
    if path_kind == "blocks":
        monkeypatch.setattr(readers._Reader, "_json_duckdb", lambda self, plan: self._json_fast(plan))
    opts = {"format": "openai"} if path_kind == "records" else {}
    if path_kind == "records":  # the slow path: one record at a time, here in OpenAI's shape
        lines = [json.dumps({"object": "chat.completion", "model": "m", "usage": {"prompt_tokens": 3,
                 "completion_tokens": i % 500 + 1}, "choices": [{"finish_reason": "stop"}]}) for i in range(40_000)]
        path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size > 1 << 20
    with pytest.raises(InputError, match="truncated while being read") as caught:
        _truncate_after_first_batch([path], cut, **opts)
    assert caught.value.path == str(path) and "\n" not in str(caught.value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.sampled_from([b"a", b"bc", b"\n", b"{}", b"\n\n", b"x" * 300]), max_size=60).map(b"".join),
       block=st.integers(1, 700), past=st.integers(1, 100))
def test_line_ranges_read_whole_lines_that_tile_the_file(tmp_path, monkeypatch, data, block, past):
    """Workers read their blocks independently (pread): the blocks are whole lines, in order,
    and together exactly the file, wherever the ranges cut and however long the lines."""
    from kvtune.ingest.compression import open_bytes

    monkeypatch.setattr(jsonl, "READ_PAST_BYTES", past)  # lines longer than that: read on
    path = tmp_path / "lines.jsonl"
    path.write_bytes(data)
    _, raw = open_bytes(path)
    with raw:
        blocks = [bytes(jsonl._read_lines(raw.raw, *r)) for r in jsonl._line_ranges(len(data), block)]
    assert b"".join(blocks) == data
    starts = {0} | {i + 1 for i, c in enumerate(data) if c == 10}
    offset = 0
    for b in blocks:
        assert not b or offset in starts
        assert not b or b.endswith(b"\n") or offset + len(b) == len(data)
        offset += len(b)


# -- hostile values: each a counted skip (or one InputError), on every path ---------------------

_READERS = ["scan", "duckdb", "blocks"]


def _use_reader(monkeypatch, reader):
    if reader == "scan" and not flatscan.available():
        pytest.skip("kvtune.ingest._flatscan is not built")
    if reader != "scan":
        monkeypatch.setattr(flatscan, "available", lambda: False)
    if reader == "blocks":
        monkeypatch.setattr(readers._Reader, "_json_duckdb", lambda self, plan: self._json_fast(plan))


def _jsonl_with(tmp_path, bad: bytes, clean=200):
    """`clean` good rows, then one line holding `bad`, then the good rows again."""
    good = b"".join(json.dumps({"route": f"/r{i % 3}", "output_tokens": i + 1, "prompt_tokens": 7,
                                "timestamp_s": 1.7e9 + i}).encode() + b"\n" for i in range(clean))
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(good + bad + b"\n" + good)
    return path


@pytest.mark.parametrize("reader", _READERS)
@pytest.mark.parametrize("bad", [
    b'{"route": "a\\ud800", "output_tokens": 5}',  # a lone surrogate, escaped
    b'{"route": "\\udfff\\ud800b", "output_tokens": 5}',
    b'{"model": "m\\ud800", "route": "a", "output_tokens": 5}',
    b'{"route": "a", "output_tokens": 5, "finish_reason": "\\ud83d"}',
    b'{"route": "a\xff\xfe", "output_tokens": 5}',  # invalid UTF-8
    b'{"route": "a\xed\xa0\x80", "output_tokens": 5}',  # an encoded surrogate
    b'{"route": "\xc3", "output_tokens": 5}',  # a cut sequence
])
def test_invalid_text_is_a_counted_skip_on_every_path(tmp_path, monkeypatch, reader, bad):
    _use_reader(monkeypatch, reader)
    path = _jsonl_with(tmp_path, bad)
    table, stats = read([path])
    assert table.num_rows == stats.rows_ok == 400
    assert dict(stats.skipped) in ({"invalid text field": 1}, {"malformed JSON": 1})
    assert next(iter(stats.examples.values())).startswith(f"{path}:201: ")
    with pytest.raises(InputError, match=f"^{path}:201: "):
        read([path], strict=True)


@pytest.mark.parametrize("reader", _READERS)
@pytest.mark.parametrize("bad, reason", [
    (b'{"route": "a", "output_tokens": 5, "prompt_tokens": 9223372036854775000}', "token count too large"),
    (b'{"route": "a", "output_tokens": 4611686018427387904, "prompt_tokens": 4611686018427387904}', "token count too large"),
    (b'{"route": "a", "output_tokens": 9007199254740993}', "token count too large"),
    (b'{"route": "a", "output_tokens": 9223372036854775808}', "token count not an integer"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": 1e308}', "invalid timestamp"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": -1e308}', "invalid timestamp"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": -5}', "invalid timestamp"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": 1e19}', "invalid timestamp"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": 100000000000000000000000000000}', "invalid timestamp"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": NaN}', "invalid number"),
    (b'{"route": "a", "output_tokens": 5, "timestamp_s": -Infinity}', "invalid number"),
    (b'{"route": "a", "output_tokens": 5, "latency_ms": 100000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000}', "invalid number"),
])
def test_extreme_numbers_are_counted_skips_and_profile_exactly(tmp_path, monkeypatch, reader, bad, reason):
    """Counts whose sum overflows int64 (prompt + output ≥ 2^63), counts past 2^53, times that
    are no time (1e308, negative, NaN, inf): each row is skipped and counted; the rest profile."""
    from kvtune.profile.logs import profile_logs

    _use_reader(monkeypatch, reader)
    path = _jsonl_with(tmp_path, bad)
    table, stats = read([path])
    assert table.num_rows == 400 and dict(stats.skipped) == {reason: 1}
    profile = profile_logs([str(path)], IngestOptions())
    assert profile.requests == 400 and profile.skipped == {reason: 1}
    assert profile.route("/r0").arrival.requests == sum(1 for i in range(200) if i % 3 == 0) * 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.integers(0, 2**63 - 1), output=st.integers(0, 2**63 - 1),
       stamp=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**70), 2**70))
def test_any_count_or_time_profiles_or_is_skipped(tmp_path, prompt, output, stamp):
    """The class: any int64 counts and any JSON number as a time give a profile or a counted skip."""
    from kvtune.profile.logs import profile_logs

    path = tmp_path / "one.jsonl"
    row = {"route": "a", "output_tokens": output, "prompt_tokens": prompt, "timestamp_s": stamp}
    path.write_text(json.dumps({"route": "a", "output_tokens": 1}) + "\n" + json.dumps(row) + "\n")
    profile = profile_logs([str(path)], IngestOptions())
    assert profile.requests + profile.skipped_rows == 2
    if profile.requests == 2:  # the first row logs no prompt: the total is the second row's
        total = profile.route("a").total
        assert total.total == 1 and total.observed.max == prompt + output
        assert profile.route("a").arrival.requests == 1


@pytest.mark.parametrize("unit", ["ms", "us", "ns"])  # Parquet stores seconds as ms
def test_parquet_times_beyond_datetime_are_counted_skips(tmp_path, unit):
    """Timestamps that Python's datetime cannot hold (and ns cannot reach) are invalid times."""
    path = tmp_path / "t.parquet"
    stamps = [1_700_000_000 * 10 ** {"ms": 3, "us": 6, "ns": 9}[unit], 2**63 - 1, -(2**63) + 1, None]
    pq.write_table(pa.table({"route": ["a"] * 4, "output_tokens": [1, 2, 3, 4],
                             "timestamp_s": pa.array(stamps, pa.timestamp(unit))}), path)
    table, stats = read([path])
    late = unit == "ns"  # 2^63 - 1 ns is in 2262: a time; 2^63 - 1 µs or ms are far past 9999
    assert table.column("output_tokens").to_pylist() == ([1, 2, 4] if late else [1, 4])
    assert dict(stats.skipped) == {"invalid timestamp": 1 if late else 2}


def test_damaged_parquet_strings_are_counted_skips(tmp_path):
    """A Parquet page whose string bytes are not UTF-8 (found by fuzzing) skips those rows."""
    path = tmp_path / "t.parquet"
    route = pa.array([b"ok", b"bad\xff", b"ok"], pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"route": route, "output_tokens": [1, 2, 3]}), path)
    table, stats = read([path])
    assert table.column("output_tokens").to_pylist() == [1, 3]
    assert dict(stats.skipped) == {"invalid text field": 1}


@pytest.mark.parametrize("data, message", [
    (bytes(range(256)) * 8, "not CSV text: the file holds NUL bytes"),
    (b"\x89PNG\r\n\x1a\n" + bytes(200), "not CSV text: the file holds NUL bytes"),
    (b'route,output_tokens\na,5\n"b\r\rc,6\n', None),
    (b"\xff\xfe r\x00o\x00", "not CSV text"),
])
def test_binary_named_csv_is_one_input_error(tmp_path, data, message):
    path = tmp_path / "logs.csv"
    path.write_bytes(data)
    if message is None:  # a bad quote: rows before it are read, the rest counted
        table, stats = read([path])
        assert table.column("output_tokens").to_pylist() == [5] and sum(stats.skipped.values()) >= 1
        return
    with pytest.raises(InputError, match=message) as caught:
        read([path])
    assert caught.value.path == str(path)


def test_links_fifos_and_devices_are_input_errors(tmp_path):
    """A symlink loop inside a directory, a dangling link, a FIFO (whose open would block) or a
    device given as a log: one InputError naming it, never a RuntimeError or a hang."""
    import os

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "good.jsonl").write_text('{"route": "a", "output_tokens": 1}\n')
    os.symlink("b.jsonl", logs / "a.jsonl")
    os.symlink("a.jsonl", logs / "b.jsonl")
    with pytest.raises(InputError, match="Too many levels of symbolic links") as caught:
        read([logs])
    assert caught.value.path == str(logs / "a.jsonl")
    with pytest.raises(InputError, match="a symbolic link to nothing"):
        read([logs / "b.jsonl"])
    (logs / "a.jsonl").unlink()
    (logs / "b.jsonl").unlink()
    os.mkfifo(logs / "pipe.jsonl")
    with pytest.raises(InputError, match="not a log file but a FIFO") as caught:
        read([logs])
    assert caught.value.path == str(logs / "pipe.jsonl")
    with pytest.raises(InputError, match="not a log file but a character device"):
        read(["/dev/zero"])
    (logs / "pipe.jsonl").unlink()
    os.symlink(logs, logs / "loop")  # a directory link back up: not followed, not a loop
    assert read([logs])[0].num_rows == 1
