"""What a command imports to run, in a fresh interpreter: only what it needs (issue 31); and the
row path's arrays, built without pa.array (which imports pandas), are pa.array's. The time
budget itself (kvtune kv within 1.5× a bare `import click`) is benchmarks/startup_bench.py's: a
timing has no place in a test on a shared machine, the modules a command loads do."""

from __future__ import annotations

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


def _modules(*args: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    data = json.loads(line.removeprefix("MODULES "))
    assert data["code"] in (0, None), proc.stderr
    return set(data["modules"])


def test_kv_imports_no_numpy_rich_or_error_helpers():
    loaded = _modules("kv", "llama-3.1-8b", "--json")
    for module in ("numpy", "pyarrow", "rich", "difflib", "kvtune.controls", "kvtune.ingest", "kvtune.profile"):
        assert module not in loaded


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
