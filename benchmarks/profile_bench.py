"""Benchmark `kvtune profile` against DuckDB and pandas computing the same per-route quantiles,
each timed as a whole process, as a user runs it.

Generates (seeded, once, into --data-dir) a Parquet file of --rows flat rows and a JSONL file of
--jsonl-rows (route, prompt_tokens, output_tokens, finish_reason), then for each file times, in
the same run and interleaved (one run of each tool in turn, --repeat rounds):
    kvtune   `python -m kvtune profile FILE --json --quiet`
    kvtune-wN  the same with --workers N (the map step in N processes; kvtune-wauto: the default)
    duckdb   the one-liner `python -c "import duckdb; ... quantile_disc(...) ... GROUP BY route"`:
             quantile_disc at .5/.9/.95/.99/.999, max and mean of output and prompt per route
    duckdb-full  the statistics kvtune's profile computes: that, plus total (prompt + output)
             tokens, the censored count, finish reasons and the joint (prompt bin, output bin)
             counts on kvtune's bin edges, over the rows read once into a table
    pandas   read, then groupby(route) with np.percentile(method="inverted_cdf") per group
Each run is one child process started here and reaped with wait4: its wall time (spawn to exit),
its CPU time (user + system: how many cores it kept busy) and its peak RSS. Prints the medians,
the ratios kvtune/peer, the load average around each file's runs, the versions it ran against
(Python, kvtune and its commit, numpy, pyarrow, duckdb, pandas; whether kvtune's C extension is
built) and whether the tools agree.

Wall-time ratios mean something only on a quiet machine: on a busy one DuckDB cannot use its
second core and the ratio drifts towards the ratio of CPU times (the closing note of the
object-store issue, 0.90-1.10x, was measured that way; quiet runs gave 1.8-2x). The CPU times
and the load average are printed beside it so a figure can be read for what it is.

kvtune is byte-compiled first (`compileall`), as pip does on install: an editable checkout under
PYTHONDONTWRITEBYTECODE=1 would otherwise recompile its modules on every run (~0.1 s), which no
installed kvtune pays. With --small-rows it also profiles a smaller file, to show kvtune's memory
does not grow with rows; the format parquet-1rg is the Parquet file rewritten as one row group,
where neither tool can give each core row groups of its own. Outputs here are uncensored
(finish_reason only stop), so kvtune's Kaplan–Meier percentiles are the plain nearest-rank ones
that DuckDB and pandas compute.

    python benchmarks/profile_bench.py                          # 10M Parquet, 3M JSONL, medians of 5
    python benchmarks/profile_bench.py --tools kvtune,duckdb --formats parquet --repeat 9
    python benchmarks/profile_bench.py --formats parquet,parquet-1rg --small-rows 10000   # + one row group, 10k rows
"""

from __future__ import annotations

import argparse
import json
import os
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


def _one_group_path(rows: int, data_dir: Path) -> Path:
    return data_dir / f"flat-{rows}-one-group.parquet"


def one_group(rows: int, data_dir: Path) -> Path:
    """flat-ROWS.parquet rewritten as a single row group (skipped when already there): the case
    where neither kvtune nor DuckDB can give each core its own row groups."""
    import pyarrow.parquet as pq

    path = _one_group_path(rows, data_dir)
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        pq.write_table(pq.read_table(_paths(rows, data_dir)[0]), tmp, row_group_size=rows)
        tmp.rename(path)
    return path


def generate(rows: int, data_dir: Path, seed: int = 7, jsonl: bool = True) -> tuple[Path, Path]:
    """Write flat-ROWS.parquet and (jsonl) flat-ROWS.jsonl (each skipped when already there)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data_dir.mkdir(parents=True, exist_ok=True)
    parquet, jsonl_path = _paths(rows, data_dir)
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
    if jsonl and not jsonl_path.exists():
        import duckdb

        tmp = jsonl_path.with_suffix(".tmp")
        duckdb.connect().execute(f"COPY (SELECT * FROM read_parquet('{parquet}')) TO '{tmp}' (FORMAT JSON)")
        tmp.rename(jsonl_path)
    return parquet, jsonl_path


# --------------------------------------------------------------------------------------------
# the tools: each one command line, run as a whole process; its stdout read into
# {route: {"output": [...5 q, max, mean], "prompt": [...], ...}}

#: The DuckDB one-liner as a user would type it (argv[1]: the file), printing JSON.
DUCKDB_ONE_LINER = (
    "import duckdb, json, sys; p = sys.argv[1]; "
    "src = f\"read_parquet('{p}')\" if p.endswith('.parquet') else "
    "f\"read_json('{p}', format='newline_delimited', columns={{route: 'VARCHAR', prompt_tokens: 'BIGINT', "
    "output_tokens: 'BIGINT', finish_reason: 'VARCHAR'}})\"; "
    "q = '[0.5, 0.9, 0.95, 0.99, 0.999]'; "
    "print(json.dumps(duckdb.sql(f'SELECT route, quantile_disc(output_tokens, {q}), max(output_tokens), "
    "avg(output_tokens), quantile_disc(prompt_tokens, {q}), max(prompt_tokens), avg(prompt_tokens) "
    "FROM {src} GROUP BY route ORDER BY route').fetchall()))"
)


def command(tool: str, path: str) -> list[str]:
    """The command line that runs `tool` on `path`: kvtune as a user types it (--workers left at
    its default, auto: one process below 256 MiB); kvtune-wN is kvtune with --workers N."""
    if tool == "kvtune":
        return [sys.executable, "-m", "kvtune", "profile", path, "--json", "--quiet"]
    if tool.startswith("kvtune-w"):
        workers = tool.removeprefix("kvtune-w")
        return [sys.executable, "-m", "kvtune", "profile", path, "--json", "--quiet", "--workers", workers]
    if tool == "duckdb":
        return [sys.executable, "-c", DUCKDB_ONE_LINER, path]
    if tool == "duckdb-full":
        from kvtune.profile.histogram import JOINT_EDGES

        return [sys.executable, __file__, "_duckdb_full", path, json.dumps([int(e) for e in JOINT_EDGES])]
    if tool == "pandas":
        return [sys.executable, __file__, "_pandas", path]
    raise SystemExit(f"unknown tool {tool!r}")


def parse(tool: str, stdout: str) -> dict:
    if tool == "duckdb":  # its progress bar (a query past 2 s) writes to stdout before the result
        stdout = stdout.rstrip("\n").rsplit("\n", 1)[-1]
    try:
        data = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{tool} printed no JSON ({exc}): {stdout[:300]!r}") from None
    if tool == "duckdb":
        return {r[0]: {"output": [*r[1], r[2], r[3]], "prompt": [*r[4], r[5], r[6]]} for r in data}
    if not tool.startswith("kvtune"):
        return data
    out = {}
    for r in data["routes"]:
        out[r["route"]] = {
            kind: [r[f"{kind}_tokens"][k] for k in KEYS] + [r[f"{kind}_tokens"]["max"], r[f"{kind}_tokens"]["mean"]]
            for kind in ("output", "prompt", "total")
        }
        out[r["route"]]["censored"] = r["censored"]["count"]
    return out


def duckdb_query(path: str) -> dict:
    """The one-liner's query, in this process (for checks; the timed run is DUCKDB_ONE_LINER)."""
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


def pandas_query(path: str) -> dict:
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


def run_once(tool: str, path: Path) -> dict:
    """One whole-process run: wall (spawn to exit), CPU (user + system) and peak RSS from wait4."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command(tool, str(path)), stdout=subprocess.PIPE, stderr=err)
        assert proc.stdout is not None
        stdout = proc.stdout.read()  # to EOF; then reap the child here, with wait4, for its rusage
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.stdout.close()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{tool} failed on {path}:\n{err.read().decode()[-2000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024,
            "result": parse(tool, stdout.decode())}


def measure_all(tools: list[str], path: Path, repeat: int) -> dict[str, dict]:
    """Medians of `repeat` runs of each tool, interleaved (a round runs each tool once), so a
    change in the machine's load falls on every tool alike."""
    runs: dict[str, list[dict]] = {tool: [] for tool in tools}
    for _ in range(repeat):
        for tool in tools:
            runs[tool].append(run_once(tool, path))
    return {tool: {key: statistics.median(r[key] for r in rs) for key in ("wall_s", "cpu_s", "peak_rss_mib")}
            | {"result": rs[0]["result"], "walls": [r["wall_s"] for r in rs]} for tool, rs in runs.items()}


def versions() -> str:
    """What this run ran against: the interpreter, kvtune (and its commit), the libraries."""
    from importlib.metadata import PackageNotFoundError, version

    import kvtune
    from kvtune.ingest import flatscan

    parts = [f"Python {sys.version.split()[0]}"]
    commit = subprocess.run(["git", "-C", str(Path(kvtune.__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(Path(kvtune.__file__).parent), "status", "--porcelain", "--", "."],
                           capture_output=True, text=True).stdout.strip()
    parts.append(f"kvtune {kvtune.__version__}" + (f" ({commit}{', modified' if dirty else ''})" if commit else "")
                 + f", C extension {'built' if flatscan.available() else 'NOT built'}")
    for name in ("numpy", "pyarrow", "duckdb", "pandas", "click"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    return ", ".join(parts)


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


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
    if len(sys.argv) > 1 and sys.argv[1] == "_duckdb_full":
        print(json.dumps(duckdb_full(sys.argv[2], json.loads(sys.argv[3]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_pandas":
        print(json.dumps(pandas_query(sys.argv[2])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_generate":
        generate(int(sys.argv[2]), Path(sys.argv[3]), jsonl=sys.argv[4] == "jsonl")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_one_group":
        one_group(int(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows of the Parquet file")
    parser.add_argument("--jsonl-rows", type=int, default=3_000_000, help="rows of the JSONL file")
    parser.add_argument("--small-rows", type=int, default=0,
                        help="also profile this many rows with kvtune (memory vs rows); 0 = skip")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvtune-bench")
    parser.add_argument("--formats", default="parquet,jsonl",
                        help="parquet, jsonl, parquet-1rg (the Parquet rows as one row group)")
    parser.add_argument("--tools", default="kvtune,duckdb,duckdb-full,pandas",
                        help="kvtune, kvtune-wN (--workers N; kvtune-wauto), duckdb (the quantile_disc one-liner), "
                             "duckdb-full (the profile's statistics), pandas")
    args = parser.parse_args()
    formats, tools = args.formats.split(","), args.tools.split(",")

    if any(t.startswith("kvtune") for t in tools):
        import importlib.util

        spec = importlib.util.find_spec("kvtune")
        if spec is not None and spec.submodule_search_locations:
            subprocess.run([sys.executable, "-m", "compileall", "-q", *spec.submodule_search_locations], check=True)
    t = time.perf_counter()
    # generate in a child so this process stays small
    jobs: dict[int, bool] = {}  # rows -> whether a JSONL file of them is needed
    if "parquet" in formats or "parquet-1rg" in formats:
        jobs[args.rows] = jobs.get(args.rows, False)
    if "jsonl" in formats:
        jobs[args.jsonl_rows] = True
    if args.small_rows:
        jobs[args.small_rows] = jobs.get(args.small_rows, False) or "jsonl" in formats
    for rows, jsonl in jobs.items():
        subprocess.run([sys.executable, __file__, "_generate", str(rows), str(args.data_dir),
                        "jsonl" if jsonl else "parquet"], check=True)
    if "parquet-1rg" in formats:
        subprocess.run([sys.executable, __file__, "_one_group", str(args.rows), str(args.data_dir)], check=True)
    files = {"parquet": _paths(args.rows, args.data_dir)[0], "jsonl": _paths(args.jsonl_rows, args.data_dir)[1],
             "parquet-1rg": _one_group_path(args.rows, args.data_dir)}
    rows_of = {"parquet": args.rows, "jsonl": args.jsonl_rows, "parquet-1rg": args.rows}
    print(versions())
    print(f"{os.cpu_count()} CPUs; data ready in {time.perf_counter() - t:.1f} s; medians of {args.repeat} "
          f"interleaved runs, each a whole process; {_load()}")
    ok = True
    for fmt in formats:
        path = files[fmt]
        before = _load()
        results = measure_all(tools, path, args.repeat)
        print(f"\n{fmt}: {path} ({path.stat().st_size / 2**20:,.0f} MiB, {rows_of[fmt]:,} rows); "
              f"{before} before, {_load()} after")
        print(f"  {'tool':<12} {'wall s':>8} {'CPU s':>7} {'cores':>6} {'peak RSS MiB':>13}   walls")
        for tool, r in results.items():
            print(f"  {tool:<12} {r['wall_s']:>8.2f} {r['cpu_s']:>7.2f} {r['cpu_s'] / r['wall_s']:>6.2f} "
                  f"{r['peak_rss_mib']:>13,.0f}   " + " ".join(f"{w:.2f}" for w in r["walls"]))
        for mine in (t for t in tools if t.startswith("kvtune")):
            for peer in ("duckdb", "duckdb-full", "pandas"):
                if peer in results:
                    k, p = results[mine], results[peer]
                    print(f"  {mine}/{peer}: wall {k['wall_s'] / p['wall_s']:.2f}×, "
                          f"CPU {k['cpu_s'] / p['cpu_s']:.2f}×, memory {k['peak_rss_mib'] / p['peak_rss_mib']:.2f}×")
        base = tools[0]
        for tool in tools[1:]:
            diffs = compare(results[base]["result"], results[tool]["result"])
            ok &= not diffs
            found = f"{len(diffs)} differences: " + "; ".join(diffs[:6])
            print(f"  {base} vs {tool}: " + (found if diffs else "identical percentiles, max and mean"))
    if args.small_rows and "kvtune" in tools:
        print(f"\nkvtune memory vs rows (peak RSS MiB, median of {args.repeat})")
        for fmt in formats:
            if fmt == "parquet-1rg":
                continue
            small = _paths(args.small_rows, args.data_dir)[0 if fmt == "parquet" else 1]
            a = measure_all(["kvtune"], small, args.repeat)["kvtune"]
            b = measure_all(["kvtune"], files[fmt], args.repeat)["kvtune"]
            print(f"  {fmt:<8} {args.small_rows:>12,} rows: {a['peak_rss_mib']:>7,.0f} MiB {a['wall_s']:>7.2f} s   "
                  f"{rows_of[fmt]:>12,} rows: {b['peak_rss_mib']:>7,.0f} MiB {b['wall_s']:>7.2f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
