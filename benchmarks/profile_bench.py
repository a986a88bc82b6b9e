"""Benchmark `kvtune profile` against DuckDB and pandas computing the same per-route quantiles.

Generates (seeded, once, into --data-dir) a Parquet file and a JSONL file of flat rows
(route, prompt_tokens, output_tokens, finish_reason), then for each file times, in the same run:
    kvtune   `python -m kvtune profile FILE --json` as a subprocess
    kvtune-wN  the same with --workers N (the map step in N processes; kvtune-wauto: the default)
    duckdb   quantile_disc at .5/.9/.95/.99/.999, max and mean of output and prompt, GROUP BY route,
             as a subprocess (`python` importing only duckdb), so both CLIs pay interpreter startup
    duckdb-full  the statistics kvtune's profile computes: that, plus total (prompt + output)
             tokens, the censored count, finish reasons and the joint (prompt bin, output bin)
             counts on kvtune's bin edges, over the rows read once into a table
    pandas   read, then groupby(route) with np.percentile(method="inverted_cdf") per group
Each measurement runs in its own child process (this script re-invoked with `_measure`), which
reports its wall time and peak RSS (ru_maxrss of itself, or of its one child for kvtune and duckdb). Prints
the median of --repeat runs, the ratios kvtune/duckdb and kvtune/pandas, and whether all three
agree. kvtune is byte-compiled first (`compileall`), as pip does on install: an editable checkout
under PYTHONDONTWRITEBYTECODE=1 would otherwise recompile its modules on every run (~0.1 s), which
no installed kvtune pays. With --small-rows it also profiles a smaller file, to show kvtune's memory does not grow
with rows. Outputs here are uncensored (finish_reason only stop), so kvtune's Kaplan–Meier
percentiles are the plain nearest-rank ones that DuckDB and pandas compute.

    python benchmarks/profile_bench.py --rows 10000000 --small-rows 1000000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QS = (0.5, 0.9, 0.95, 0.99, 0.999)
KEYS = ("p50", "p90", "p95", "p99", "p999")
# route -> (share, output ln-mean, ln-sd, prompt ln-mean, ln-sd): lognormal fits of the real traces
ROUTES = {
    "/v1/chat/completions": (0.5, 5.019, 0.859, 6.633, 0.985),  # Azure conv
    "/v1/code/completions": (0.3, 2.788, 0.847, 6.999, 1.360),  # Azure code
    "/v1/summarize": (0.15, 5.187, 0.796, 7.717, 0.755),  # vidur arXiv
    "/v1/embeddings-ish": (0.05, 1.0, 0.5, 5.0, 1.0),
}
CHUNK_ROWS = 1_000_000


# --------------------------------------------------------------------------------------------
# data


def _paths(rows: int, data_dir: Path) -> tuple[Path, Path]:
    return data_dir / f"flat-{rows}.parquet", data_dir / f"flat-{rows}.jsonl"


def generate(rows: int, data_dir: Path, seed: int = 7) -> tuple[Path, Path]:
    """Write flat-ROWS.parquet and flat-ROWS.jsonl (skipped when already there)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data_dir.mkdir(parents=True, exist_ok=True)
    parquet, jsonl = _paths(rows, data_dir)
    if not parquet.exists():
        rng = np.random.default_rng(seed)
        names = np.array(list(ROUTES))
        shares = np.array([v[0] for v in ROUTES.values()])
        tmp = parquet.with_suffix(".tmp")
        with pq.ParquetWriter(tmp, pa.schema([("route", pa.string()), ("prompt_tokens", pa.int64()),
                                              ("output_tokens", pa.int64()), ("finish_reason", pa.string())])) as w:
            for start in range(0, rows, CHUNK_ROWS):
                n = min(CHUNK_ROWS, rows - start)
                idx = rng.choice(len(names), n, p=shares)
                params = np.array([v[1:] for v in ROUTES.values()])[idx]
                out = np.clip(np.round(rng.lognormal(params[:, 0], params[:, 1])), 1, 16384).astype(np.int64)
                prompt = np.clip(np.round(rng.lognormal(params[:, 2], params[:, 3])), 1, 131072).astype(np.int64)
                w.write_table(pa.table({"route": names[idx], "prompt_tokens": prompt, "output_tokens": out,
                                        "finish_reason": np.full(n, "stop")}))
        tmp.rename(parquet)
    if not jsonl.exists():
        import duckdb

        tmp = jsonl.with_suffix(".tmp")
        duckdb.connect().execute(f"COPY (SELECT * FROM read_parquet('{parquet}')) TO '{tmp}' (FORMAT JSON)")
        tmp.rename(jsonl)
    return parquet, jsonl


# --------------------------------------------------------------------------------------------
# the three tools, each returning {route: {"output": [...5 q, max, mean], "prompt": [...]}}


def run_kvtune(path: str, workers: str = "1") -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvtune", "profile", path, "--json", "--quiet", "--workers", workers],
                          capture_output=True, text=True, check=True)
    data = json.loads(proc.stdout)
    out = {}
    for r in data["routes"]:
        out[r["route"]] = {
            kind: [r[f"{kind}_tokens"][k] for k in KEYS] + [r[f"{kind}_tokens"]["max"], r[f"{kind}_tokens"]["mean"]]
            for kind in ("output", "prompt", "total")
        }
        out[r["route"]]["censored"] = r["censored"]["count"]
    return out


def run_duckdb(path: str) -> dict:
    """The DuckDB query in a fresh interpreter (this script's `_duckdb` mode, which imports only
    duckdb), timed from spawn to exit like the kvtune CLI."""
    proc = subprocess.run([sys.executable, __file__, "_duckdb", path], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def duckdb_query(path: str) -> dict:
    import duckdb

    source = _duckdb_source(path)
    qs = "[" + ", ".join(map(str, QS)) + "]"
    rows = duckdb.connect().execute(
        f"SELECT route, quantile_disc(output_tokens, {qs}), max(output_tokens), avg(output_tokens), "
        f"quantile_disc(prompt_tokens, {qs}), max(prompt_tokens), avg(prompt_tokens) "
        f"FROM {source} GROUP BY route ORDER BY route"
    ).fetchall()
    return {r[0]: {"output": [*r[1], r[2], r[3]], "prompt": [*r[4], r[5], r[6]]} for r in rows}


def duckdb_full(path: str, edges: list[int]) -> dict:
    """The statistics kvtune's profile computes, in DuckDB: per route the percentiles, max and mean
    of output, prompt and total (prompt + output) tokens, the censored count (finish_reason
    length), finish reasons, and the joint (prompt bin, output bin) counts on kvtune's log bins
    (the same edges, joined on the distinct values). The rows are read once into a table."""
    import duckdb

    bins = ", ".join(f"({i}, {lo}, {hi})" for i, (lo, hi) in enumerate(zip(edges, [*edges[1:], 2**62], strict=True)))
    con = duckdb.connect()
    con.execute(f"CREATE TEMP TABLE t AS SELECT route, prompt_tokens AS p, output_tokens AS o, finish_reason AS f "
                f"FROM {_duckdb_source(path)}")
    qs = "[" + ", ".join(map(str, QS)) + "]"
    stats = con.execute(
        f"SELECT route, quantile_disc(o, {qs}), max(o), avg(o), quantile_disc(p, {qs}), max(p), avg(p), "
        f"quantile_disc(p + o, {qs}), max(p + o), avg(p + o), count(*) FILTER (WHERE f = 'length') "
        f"FROM t GROUP BY route ORDER BY route").fetchall()
    finish = con.execute("SELECT route, f, count(*) FROM t GROUP BY ALL").fetchall()
    joint = con.execute(
        f"WITH e(bin, lo, hi) AS (VALUES {bins}), "
        "v AS (SELECT DISTINCT x FROM (SELECT p AS x FROM t UNION ALL SELECT o FROM t)), "
        "b AS (SELECT x, bin FROM v JOIN e ON x >= lo AND x < hi) "
        "SELECT route, pb.bin, ob.bin, count(*) FROM t JOIN b pb ON t.p = pb.x JOIN b ob ON t.o = ob.x "
        "GROUP BY ALL").fetchall()
    out = {r[0]: {"output": [*r[1], r[2], r[3]], "prompt": [*r[4], r[5], r[6]], "total": [*r[7], r[8], r[9]],
                  "censored": r[10]} for r in stats}
    for route, reason, n in finish:
        out[route].setdefault("finish_reasons", {})[reason] = n
    for route, pb, ob, n in joint:
        out[route].setdefault("joint", {})[f"{pb},{ob}"] = n
    return out


def _duckdb_source(path: str) -> str:
    return (f"read_parquet('{path}')" if path.endswith(".parquet") else
            f"read_json('{path}', format='newline_delimited', columns={{route: 'VARCHAR', "
            f"prompt_tokens: 'BIGINT', output_tokens: 'BIGINT', finish_reason: 'VARCHAR'}})")


def run_duckdb_full(path: str) -> dict:
    """In a fresh interpreter that imports only duckdb: kvtune's bin edges come on its command line."""
    from kvtune.profile.histogram import JOINT_EDGES

    edges = json.dumps([int(e) for e in JOINT_EDGES])
    proc = subprocess.run([sys.executable, __file__, "_duckdb_full", path, edges], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout)


def run_pandas(path: str) -> dict:
    import numpy as np
    import pandas as pd

    cols = ["route", "prompt_tokens", "output_tokens"]
    if path.endswith(".parquet"):
        df = pd.read_parquet(path, columns=cols)
    else:
        df = pd.read_json(path, lines=True, engine="pyarrow")[cols]
    percents = [100 * q for q in QS]
    out = {}
    for route, g in df.groupby("route", sort=True):
        out[route] = {
            kind: [int(v) for v in np.percentile(g[f"{kind}_tokens"].to_numpy(), percents, method="inverted_cdf")]
            + [int(g[f"{kind}_tokens"].max()), float(g[f"{kind}_tokens"].mean())]
            for kind in ("output", "prompt")
        }
    return out


TOOLS = {"kvtune": run_kvtune, "duckdb": run_duckdb, "duckdb-full": run_duckdb_full, "pandas": run_pandas}


def _tool(name: str):
    """A tool by name; kvtune-wN is kvtune with --workers N (kvtune-wauto: the default)."""
    if name.startswith("kvtune-w"):
        workers = name.removeprefix("kvtune-w")
        return lambda path: run_kvtune(path, workers)
    return TOOLS[name]


def measure_child(tool: str, path: str) -> None:
    """Runs in a fresh process: do the work, print wall time, peak RSS and the result.

    Peak RSS is this process's own, or its one child's for kvtune. Linux carries a process's
    ru_maxrss across fork and exec, so the parent starts these through /usr/bin/time (a small
    C program) where it exists, and prefers the %M it reports.
    """
    start = time.perf_counter()
    result = _tool(tool)(path)
    wall = time.perf_counter() - start
    who = resource.RUSAGE_SELF if tool == "pandas" else resource.RUSAGE_CHILDREN
    print(json.dumps({"wall_s": wall, "peak_rss_mib": resource.getrusage(who).ru_maxrss / 1024, "result": result}))


def measure(tool: str, path: Path, repeat: int) -> dict:
    runs = []
    timer = ["/usr/bin/time", "-f", "%M"] if Path("/usr/bin/time").exists() else []
    for _ in range(repeat):
        proc = subprocess.run([*timer, sys.executable, __file__, "_measure", tool, str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{tool} failed on {path}:\n{proc.stderr[-2000:]}")
        run = json.loads(proc.stdout)
        if timer:  # max RSS (KiB) of the measuring process and everything it waited for
            run["peak_rss_mib"] = int(proc.stderr.strip().splitlines()[-1]) / 1024
        runs.append(run)
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
        "result": runs[0]["result"],
    }


def compare(a: dict, b: dict) -> list[str]:
    """Differences between two tools' results, as readable lines."""
    diffs = []
    for route in sorted(set(a) | set(b)):
        x, y = a.get(route, {}), b.get(route, {})
        if "censored" in x and "censored" in y and x["censored"] != y["censored"]:
            diffs.append(f"{route} censored: {a[route]['censored']} vs {b[route]['censored']}")
        kinds = ("output", "prompt", "total") if "total" in a.get(route, {}) and "total" in b.get(route, {}) \
            else ("output", "prompt")
        for kind in kinds:
            x, y = a.get(route, {}).get(kind), b.get(route, {}).get(kind)
            if x is None or y is None:
                diffs.append(f"{route} {kind}: missing")
                continue
            names = [*KEYS, "max", "mean"]
            for name, u, v in zip(names, x, y, strict=True):
                if (abs(u - v) > 0.0006) if name == "mean" else (u != v):  # kvtune rounds means to 3 places
                    diffs.append(f"{route} {kind} {name}: {u} vs {v}")
    return diffs


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        measure_child(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_duckdb":
        print(json.dumps(duckdb_query(sys.argv[2])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_duckdb_full":
        print(json.dumps(duckdb_full(sys.argv[2], json.loads(sys.argv[3]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_generate":
        generate(int(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--small-rows", type=int, default=1_000_000,
                        help="also profile this many rows with kvtune (memory vs rows); 0 = skip")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtune-bench")
    parser.add_argument("--formats", default="parquet,jsonl")
    parser.add_argument("--tools", default="kvtune,kvtune-w2,duckdb,duckdb-full,pandas",
                        help="kvtune, kvtune-wN (--workers N; kvtune-wauto), duckdb (quantile_disc only), "
                             "duckdb-full (the profile's statistics), pandas")
    args = parser.parse_args()

    if "kvtune" in args.tools.split(","):
        import importlib.util

        spec = importlib.util.find_spec("kvtune")
        if spec is not None and spec.submodule_search_locations:
            subprocess.run([sys.executable, "-m", "compileall", "-q", *spec.submodule_search_locations], check=True)
    t = time.perf_counter()
    # generate in a child so this process stays small (children inherit its peak RSS)
    for rows in {args.rows, args.small_rows} - {0}:
        subprocess.run([sys.executable, __file__, "_generate", str(rows), str(args.data_dir)], check=True)
    parquet, jsonl = _paths(args.rows, args.data_dir)
    mib = {p: p.stat().st_size / 2**20 for p in (parquet, jsonl)}
    print(f"data: {parquet} ({mib[parquet]:,.0f} MiB), {jsonl} ({mib[jsonl]:,.0f} MiB), {args.rows:,} rows, "
          f"ready in {time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs; median of {args.repeat}")
    files = {"parquet": parquet, "jsonl": jsonl}
    tools = args.tools.split(",")
    ok = True
    for fmt in args.formats.split(","):
        results = {tool: measure(tool, files[fmt], args.repeat) for tool in tools}
        print(f"\n{fmt}, {args.rows:,} rows")
        print(f"  {'tool':<12} {'wall s':>8} {'peak RSS MiB':>13}")
        for tool, r in results.items():
            print(f"  {tool:<12} {r['wall_s']:>8.2f} {r['peak_rss_mib']:>13,.0f}")
        for mine in (t for t in tools if t.startswith("kvtune")):
            for peer in ("duckdb", "duckdb-full", "pandas"):
                if peer in results:
                    k, p = results[mine], results[peer]
                    print(f"  {mine}/{peer}: time {k['wall_s'] / p['wall_s']:.2f}×, "
                          f"memory {k['peak_rss_mib'] / p['peak_rss_mib']:.2f}×")
        base = tools[0]
        for tool in tools[1:]:
            diffs = compare(results[base]["result"], results[tool]["result"])
            ok &= not diffs
            found = f"{len(diffs)} differences: " + "; ".join(diffs[:6])
            print(f"  {base} vs {tool}: " + (found if diffs else "identical percentiles, max and mean"))
    if args.small_rows and "kvtune" in tools:
        small_parquet, small_jsonl = _paths(args.small_rows, args.data_dir)
        print(f"\nkvtune memory vs rows (peak RSS MiB, median of {args.repeat})")
        for fmt, small in (("parquet", small_parquet), ("jsonl", small_jsonl)):
            if fmt in args.formats.split(","):
                a = measure("kvtune", small, args.repeat)
                b = measure("kvtune", files[fmt], args.repeat)
                print(f"  {fmt:<8} {args.small_rows:>12,} rows: {a['peak_rss_mib']:>7,.0f} MiB {a['wall_s']:>7.2f} s   "
                      f"{args.rows:>12,} rows: {b['peak_rss_mib']:>7,.0f} MiB {b['wall_s']:>7.2f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
