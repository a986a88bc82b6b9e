"""Start-up of kvtune's commands against a bare `import click`, each a whole process.

The budget (issue 31): `kvtune kv MODEL --json` within 1.5× the time of `python -c "import click"`
(the CLI framework alone); a command should import only what it needs (issue 28: kvtune.api loads
a stage's module on first use, so each command pays for its own stage, and --help for none). Also
shown: the bare interpreter, `kvtune --help`, `kvtune capacity --json` (the memory plan: numpy is
its floor, through the step-time fit kvtune.capacity.timing), `simulate --help` and `recommend
--help` (the longest option lists, no stage), and `kvtune profile` on the smallest sample log
(numpy and pyarrow are its floor). Runs are interleaved (one of each command per round) and the medians of --repeat
rounds are printed with the load average and the versions, since a shared machine's noise falls
on every command alike only when they take turns.

kvtune is byte-compiled first, as pip does on install: under PYTHONDONTWRITEBYTECODE=1 an
editable checkout would recompile every module it imports on every run (kv: ~70 ms instead of
~55 ms here), a cost no installed kvtune pays. An editable install also imports pathlib and
friends in `site` (its path finder) before either command runs, which flatters the ratio less
than it seems: kvtune imports pathlib anyway.

    python benchmarks/startup_bench.py            # exit 1 when kv is past the budget
    python benchmarks/startup_bench.py --repeat 41
    git worktree add /tmp/kvtune-main main && python benchmarks/startup_bench.py --baseline /tmp/kvtune-main

--baseline DIR times DIR's kvtune (another checkout, on PYTHONPATH) in the same rounds, each of
its commands beside this one's, so a before/after on a busy machine compares like with like.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET = 1.5  # kvtune kv / import click

COMMANDS = {
    "python": ["-c", "pass"],
    "import click": ["-c", "import click"],
    "kvtune kv": ["-m", "kvtune", "kv", "llama-3.1-8b", "--json"],
    "kvtune --help": ["-m", "kvtune", "--help"],
    "kvtune capacity": ["-m", "kvtune", "capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--json"],
    "simulate --help": ["-m", "kvtune", "simulate", "--help"],
    "recommend --help": ["-m", "kvtune", "recommend", "--help"],
    "kvtune profile": ["-m", "kvtune", "profile", str(REPO / "sample_logs" / "azure_style_trace.csv"), "--json", "-q"],
}


def _time(argv: list[str], kvtune_dir: str | None = None) -> float:
    """One whole process; `kvtune_dir` put first on PYTHONPATH and run in (`-m` puts the working
    directory first: another checkout's kvtune)."""
    env = None if kvtune_dir is None else {**os.environ, "PYTHONPATH": kvtune_dir}
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   env=env, cwd=kvtune_dir)
    return time.perf_counter() - start


def _compile(kvtune_dir: str | None) -> None:
    """Byte-compile the kvtune that `kvtune_dir` (None: this interpreter's) puts first, as pip does."""
    if kvtune_dir is not None:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(kvtune_dir) / "kvtune")], check=True,
                       stdout=subprocess.DEVNULL)
        return
    spec = importlib.util.find_spec("kvtune")
    if spec is not None and spec.submodule_search_locations:
        subprocess.run([sys.executable, "-m", "compileall", "-q", *spec.submodule_search_locations], check=True,
                       stdout=subprocess.DEVNULL)


def _versions() -> str:
    from importlib.metadata import version

    import kvtune

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return (f"Python {sys.version.split()[0]}, kvtune {kvtune.__version__} ({commit or 'no git'}) from "
            f"{Path(kvtune.__file__).parent}, click {version('click')}, numpy {version('numpy')}, "
            f"pyarrow {version('pyarrow')}; {os.cpu_count()} CPUs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--baseline", metavar="DIR", help="another kvtune checkout to time in the same rounds")
    args = parser.parse_args()
    _compile(None)
    runs = [(name, argv, None) for name, argv in COMMANDS.items()]
    if args.baseline:
        _compile(args.baseline)
        runs += [(f"{name} @baseline", argv, args.baseline) for name, argv in COMMANDS.items() if "kvtune" in argv]
    for _, argv, kvtune_dir in runs:  # warm the page cache
        _time(argv, kvtune_dir)
    before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(args.repeat):
        for name, argv, kvtune_dir in runs:
            times[name].append(_time(argv, kvtune_dir))
    after = os.getloadavg()
    print(_versions())
    if args.baseline:
        print(f"baseline: {args.baseline}")
    print(f"medians of {args.repeat} interleaved runs; load average {before[0]:.2f} before, {after[0]:.2f} after")
    median = {name: statistics.median(t) for name, t in times.items()}
    click_s = median["import click"]
    for name in COMMANDS:
        m = median[name]
        line = f"  {name:<16} {m * 1000:>7.1f} ms  {m / click_s:>5.2f}× import click"
        if f"{name} @baseline" in median:
            b = median[f"{name} @baseline"]
            line += f"   baseline {b * 1000:>7.1f} ms  {b / click_s:>5.2f}×"
        print(line)
    ratio = median["kvtune kv"] / click_s
    verdict = "within" if ratio <= BUDGET else "PAST"
    print(f"budget: kvtune kv ≤ {BUDGET}× import click: {ratio:.2f}×, {verdict} the budget")
    sys.exit(0 if ratio <= BUDGET else 1)


if __name__ == "__main__":
    main()
