"""A 20-file Hive-partitioned log dataset for the parallel and Ray profile tests.

Lengths and arrival times are the Azure conversation trace's (the 400-row excerpt in
tests/data/traces, SOURCES.md), dealt out over four days (`dt=2026-11-20` … `dt=2026-11-23`,
five files each) in kvtune's flat rows: JSONL (files 0–9), CSV (10–14) and Parquet written in
row groups of 40 rows (15–19, so a file splits into runs of row groups). Three routes; one of
them, /v1/summarize, is cut at max_tokens = 128 (finish_reason length: censored). Planted bad
rows, each a counted skip (or the error with --on-error fail):
    file 3 (JSONL)    line 17: output_tokens -5
    file 11 (CSV)     line 9: output_tokens "many"
    file 17 (Parquet) row 93: output_tokens null (the third row group of five)
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TRACE = Path(__file__).parents[1] / "data" / "traces" / "AzureLLMInferenceTrace_conv.first-400.csv"
FILES = 20
ROWS_PER_FILE = 200
PARQUET_ROW_GROUP = 40
CAP = 128
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/summarize")
BAD = {3: 17, 11: 9, 17: 93}  # file -> line (JSONL, CSV: line in the file; Parquet: row number)
COLUMNS = ("route", "model", "prompt_tokens", "output_tokens", "max_tokens", "finish_reason", "timestamp_s",
           "latency_ms")


def _trace() -> list[tuple[float, int, int]]:
    rows = []
    with TRACE.open() as f:
        for r in csv.DictReader(f):
            stamp = dt.datetime.fromisoformat(r["TIMESTAMP"][:26]).replace(tzinfo=dt.UTC)
            rows.append((stamp.timestamp(), int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    return rows


def _rows(index: int, trace: list[tuple[float, int, int]]) -> list[dict]:
    day = dt.datetime(2026, 11, 20, tzinfo=dt.UTC) + dt.timedelta(days=index // 5)
    start = trace[0][0]
    rows = []
    for k in range(ROWS_PER_FILE):
        t, prompt, output = trace[(index * ROWS_PER_FILE + k) % len(trace)]
        route = ROUTES[(k * 7 + index) % 3]
        cut = route == "/v1/summarize" and output >= CAP
        rows.append({
            "route": route,
            "model": "llama-3.1-8b",
            "prompt_tokens": prompt,
            "output_tokens": CAP if cut else output,
            "max_tokens": CAP if route == "/v1/summarize" else 2048,
            "finish_reason": "length" if cut else "stop",
            "timestamp_s": day.timestamp() + (index % 5) * 3600 + (t - start) % 3600,
            "latency_ms": 20.0 + 11.5 * output,
        })
    return rows


def write_dataset(root: Path) -> list[Path]:
    """Write the 20 files under root (dt=…/part-NN.ext); returns them in the order kvtune lists them."""
    trace = _trace()
    paths = []
    for i in range(FILES):
        rows = _rows(i, trace)
        day = (dt.date(2026, 11, 20) + dt.timedelta(days=i // 5)).isoformat()
        folder = root / f"dt={day}"
        folder.mkdir(parents=True, exist_ok=True)
        if i < 10:
            path = folder / f"part-{i:02d}.jsonl"
            lines = [json.dumps(r) for r in rows]
            if i in BAD:
                lines[BAD[i] - 1] = json.dumps(rows[BAD[i] - 1] | {"output_tokens": -5})
            path.write_text("\n".join(lines) + "\n")
        elif i < 15:
            path = folder / f"part-{i:02d}.csv"
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS)
                w.writeheader()
                for n, r in enumerate(rows, start=2):  # line 1: the header
                    w.writerow(r | {"output_tokens": "many"} if BAD.get(i) == n else r)
        else:
            path = folder / f"part-{i:02d}.parquet"
            table = pa.Table.from_pylist(rows)
            if i in BAD:
                column = table.column("output_tokens").to_pylist()
                column[BAD[i] - 1] = None
                table = table.set_column(table.schema.get_field_index("output_tokens"), "output_tokens",
                                         pa.array(column, pa.int64()))
            pq.write_table(table, path, row_group_size=PARQUET_ROW_GROUP)
        paths.append(path)
    return paths
