"""What a command imports to run, in a fresh interpreter: only what it needs (issue 31); its help
no stage at all, and a command only its own stage of kvtune.api (issue 28); and the row path's
arrays, built without pa.array (which imports pandas), are pa.array's. The time budget itself
(kvtune kv within 1.5× a bare `import click`) is benchmarks/startup_bench.py's: a timing has no
place in a test on a shared machine, the modules a command loads do."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys

import pyarrow as pa
import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.ingest.arrays import from_pylist

_RUN = """
import json, sys
from kvtune.cli import main
sys.argv = ["kvtune", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
sys.stderr.write("\\nMODULES " + json.dumps({"code": code, "modules": sorted(sys.modules)}) + "\\n")
"""


#: What no command's --help loads: the heavy libraries and the library's stages behind kvtune.api.
NOT_FOR_HELP = ("numpy", "pandas", "pyarrow", "aiohttp", "jinja2", "rich", "yaml", "kvtune.sim", "kvtune.simulation",
                "kvtune.policy", "kvtune.deploy", "kvtune.bench", "kvtune.gateway", "kvtune.planning",
                "kvtune.capacity.plan")

_HELPS = """
import json, sys
from kvtune.cli import COMMANDS, cli
loaded = {}
for command in ["", *COMMANDS]:
    before = set(sys.modules)
    try:
        cli.main([command, "--help"] if command else ["--help"], prog_name="kvtune")
    except SystemExit as exc:
        assert exc.code == 0, (command, exc.code)
    loaded[command or "--help"] = sorted(set(sys.modules) - before)
sys.stderr.write("\\nMODULES " + json.dumps(loaded) + "\\n")
"""


def _modules(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    data = json.loads(line.removeprefix("MODULES "))
    assert data["code"] in (0, None), proc.stderr
    return set(data["modules"])


def _doors(loaded: set[str]) -> set[str]:
    """The stages of kvtune.api a run loaded (kvtune/api/*.py)."""
    return {m for m in loaded if m.startswith("kvtune.api.")}


def test_help_loads_no_stage_nor_heavy_library():
    """`kvtune --help` and each command's --help, one after another in one interpreter (each
    charged with the modules it added): the options' help needs none of the stages' libraries."""
    proc = subprocess.run([sys.executable, "-c", _HELPS], capture_output=True, text=True, cwd=REPO, timeout=120)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    by_command = json.loads(line.removeprefix("MODULES "))
    assert set(by_command) > {"--help", "kv", "simulate", "recommend", "capacity", "profile"}
    for command, added in by_command.items():
        heavy = [m for m in added if any(m == p or m.startswith(p + ".") for p in NOT_FOR_HELP)]
        assert (command, heavy, sorted(_doors(set(added)))) == (command, [], [])


def test_kv_imports_no_numpy_rich_or_error_helpers():
    loaded = _modules("kv", "llama-3.1-8b", "--json")
    for module in ("numpy", "pyarrow", "rich", "difflib", "kvtune.controls", "kvtune.ingest", "kvtune.profile"):
        assert module not in loaded
    assert _doors(loaded) == {"kvtune.api.kv_cache"}  # through the door, and only its own


def test_capacity_loads_its_own_stage_only():
    """`kvtune capacity --json` plans the pool: no simulator, deploy files, logs reader or table."""
    loaded = _modules("capacity", "llama-3.1-8b", "--gpu", "H100-80GB", "--json")
    assert "kvtune.planning" in loaded and _doors(loaded) == {"kvtune.api.capacity"}
    for module in ("kvtune.sim", "kvtune.simulation", "kvtune.deploy", "kvtune.workload", "kvtune.profile.logs",
                   "pyarrow", "pandas", "jinja2", "rich"):
        assert module not in loaded


def test_the_doors_table_is_what_type_checkers_read():
    """kvtune.api hands each name out from the module its table names, the one its TYPE_CHECKING
    imports name (what mypy and the import walk read), and exports all of them."""
    from kvtune import api

    tree = ast.parse((REPO / "kvtune" / "api" / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    declared = {a.name: n.module for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert declared == api._HOME and sorted(declared) == sorted(api.__all__)
    assert all(getattr(api, name) is getattr(importlib.import_module(home), name) for name, home in declared.items())


def test_the_simulated_engines_the_options_offer_are_the_simulators():
    from kvtune.domain.simulated_server import SIMULATED_ENGINES
    from kvtune.sim.rules import ENGINE_NAMES

    assert SIMULATED_ENGINES == ENGINE_NAMES


@pytest.mark.parametrize("log", ["sample_logs/openai_chat_pairs.jsonl", "sample_logs/azure_style_trace.csv",
                                 "sample_logs/litellm_spend_logs.csv",
                                 "tests/data/traces/AzureLLMInferenceTrace_conv.csv", "tests/data/logs/otel_otlp.jsonl"])
def test_profile_imports_no_pandas_masked_arrays_or_subprocess(log):
    """pandas (pa.array on the row path asks whether a list is a pandas object: ~0.2 s where
    pandas is installed), numpy.ma (np.unique's plain path imports it, ~8 ms), subprocess
    (ctypes.util.find_library ran ldconfig to find the C library for the allocator, ~10 ms), rich
    (--json prints no table)."""
    loaded = _modules("profile", log, "--json", "-q")
    assert "numpy" in loaded and "kvtune.profile.build" in loaded  # it did profile
    assert _doors(loaded) == {"kvtune.api.profiling"}
    for module in ("pandas", "numpy.ma", "subprocess", "ctypes.util", "rich"):
        assert module not in loaded


_VALUES = {
    pa.int64(): st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**70), st.floats()),
    pa.float64(): st.one_of(st.none(), st.floats(), st.integers(-(2**60), 2**60)),
    pa.bool_(): st.one_of(st.none(), st.booleans()),
    pa.string(): st.one_of(st.none(), st.text(), st.integers()),
}


@pytest.mark.parametrize("typ", list(_VALUES), ids=str)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_rows_become_the_arrays_pa_array_builds(typ, data):
    """The row path's arrays (arrays.from_pylist) are pa.array's, buffer for buffer, or its error."""
    values = data.draw(st.lists(_VALUES[typ], max_size=40))

    def build(make):
        try:
            array = make(values, typ)
        except Exception as exc:  # the same error type either way
            return type(exc)
        return array.type, array.null_count, [None if b is None else b.to_pybytes() for b in array.buffers()]

    assert build(from_pylist) == build(pa.array)


def test_parquet_profile_imports_no_thread_pool_or_temp_files(tmp_path):
    """The JSONL scanner's thread pool (concurrent.futures, and logging with it) and the
    downloader's temporary files (tempfile) are imported where they are used, not by every read."""
    import pyarrow.parquet as pq

    path = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"route": ["/a", "/b"] * 50, "output_tokens": list(range(100))}), path)
    loaded = _modules("profile", str(path), "--json", "-q")
    assert "pyarrow.parquet" in loaded
    for module in ("concurrent.futures", "logging", "tempfile", "pandas", "numpy.ma"):
        assert module not in loaded
