"""Log inputs by URL (kvtune.ingest.remote): fsspec's memory and local filesystems, and a real
aiohttp server on loopback with Range support, give exactly the profile of the same files read
locally; store failures are one line naming the URL.

The equality is on `kvtune profile --json` text, with the one field that names the input (the
path in `inputs`, and in skip examples) written as the URL in the local run's output.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import zstandard
from click.testing import CliRunner
from conftest import REPO, TRACES
from http_files import FileServer, PlainFileServer

from kvtune.cli import cli
from kvtune.errors import InputError
from kvtune.ingest import expand_paths, jsonl
from kvtune.ingest.paths import is_log_name
from kvtune.ingest.remote import BLOCK_BYTES, RemoteFile, redact

SAMPLES = REPO / "sample_logs"
MOONCAKE = TRACES / "mooncake_conversation_trace.excerpt.jsonl"
AZURE_CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"


def profile(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["profile", *args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def local_json(path: Path, *extra: str) -> str:
    code, out = profile(str(path), "--json", *extra)
    assert code == 0, out
    return out


def as_url(local_out: str, path: Path, url: str) -> str:
    """The local run's JSON with its input named by `url` (the only field that differs)."""
    return local_out.replace(json.dumps(str(path))[1:-1], url)


# -- the inputs: real sample logs and trace excerpts, in every container ----------------------------


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    """One file per container: JSONL (a flat trace: the C scanner's ranged reads; and a nested
    OpenAI log: the line reader), JSONL.gz, JSONL.zst, CSV and Parquet."""
    root = tmp_path_factory.mktemp("logs")
    raw = MOONCAKE.read_bytes()
    (root / "mooncake.jsonl.gz").write_bytes(gzip.compress(raw))
    (root / "mooncake.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (root / "mooncake.jsonl").write_bytes(raw)
    (root / "openai_chat_pairs.jsonl").write_bytes((SAMPLES / "openai_chat_pairs.jsonl").read_bytes())
    (root / "azure_style_trace.csv").write_bytes((SAMPLES / "azure_style_trace.csv").read_bytes())
    table = pcsv.read_csv(AZURE_CONV)
    pq.write_table(table, root / "azure_conv.parquet", row_group_size=4000)
    return {p.name: p for p in sorted(root.iterdir())}


def _to_memory(path: Path) -> str:
    folder = f"kvtune-test-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("memory").pipe_file(f"/{folder}/{path.name}", path.read_bytes())
    return f"memory://{folder}/{path.name}"


NAMES = ["mooncake.jsonl", "mooncake.jsonl.gz", "mooncake.jsonl.zst", "openai_chat_pairs.jsonl",
         "azure_style_trace.csv", "azure_conv.parquet"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_url_profiles_exactly_as_the_local_file(logs, name, store):
    path = logs[name]
    url = _to_memory(path) if store == "memory" else path.as_uri()
    code, out = profile(url, "--json")
    assert code == 0, out
    assert out == as_url(local_json(path), path, url)
    assert json.loads(out)["inputs"][0]["path"] == url


def test_jsonl_read_in_many_ranged_blocks_is_the_same(logs, monkeypatch):
    """The C scanner's blocks are ranged reads of the object (read_at): cut small, so lines
    straddle block edges, the result is unchanged."""
    monkeypatch.setattr(jsonl, "SCAN_BLOCK_BYTES", 4096)
    url = _to_memory(logs["mooncake.jsonl"])
    code, out = profile(url, "--json")
    assert code == 0, out
    monkeypatch.undo()
    assert out == as_url(local_json(logs["mooncake.jsonl"]), logs["mooncake.jsonl"], url)


def test_directories_and_globs_in_a_store(logs):
    fs = fsspec.filesystem("memory")
    folder = f"/kvtune-dir-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{folder}/day=1/azure_style_trace.csv", logs["azure_style_trace.csv"].read_bytes())
    fs.pipe_file(f"{folder}/day=2/azure_conv.parquet", logs["azure_conv.parquet"].read_bytes())
    fs.pipe_file(f"{folder}/day=2/notes.txt", b"not a log")
    fs.pipe_file(f"{folder}/.hidden/mooncake.jsonl", logs["mooncake.jsonl"].read_bytes())
    listed = expand_paths([f"memory://{folder}"])
    assert [str(f) for f in listed] == [f"memory://{folder}/day=1/azure_style_trace.csv",
                                        f"memory://{folder}/day=2/azure_conv.parquet"]
    assert all(isinstance(f, RemoteFile) for f in listed)
    assert [f.size for f in listed] == [logs["azure_style_trace.csv"].stat().st_size,
                                        logs["azure_conv.parquet"].stat().st_size]
    globbed = expand_paths([f"memory://{folder}/*/*.parquet", f"memory://{folder}/day=2/"])
    assert [str(f) for f in globbed] == [f"memory://{folder}/day=2/azure_conv.parquet"]  # no duplicates

    code, out = profile(f"memory://{folder}", "--json")
    assert code == 0, out
    both = json.loads(local_json(logs["azure_style_trace.csv"], str(logs["azure_conv.parquet"])))
    remote = json.loads(out)
    assert [i["rows"] for i in remote["inputs"]] == [i["rows"] for i in both["inputs"]]
    remote.pop("inputs"), both.pop("inputs")
    assert remote == both


@pytest.mark.parametrize(("url", "message"), [
    ("memory://kvtune-none/x.jsonl", "memory://kvtune-none/x.jsonl: no such file or directory"),
    ("memory://kvtune-none/*.jsonl", "memory://kvtune-none/*.jsonl: no files match this pattern"),
    ("nosuchscheme://bucket/x.jsonl", "nosuchscheme://bucket/x.jsonl: unknown URL scheme nosuchscheme://"),
])
def test_a_url_that_names_nothing_is_one_line(url, message):
    code, out = profile(url, "--json")
    assert (code, out) == (2, f"Error: {message}\n")


def test_an_empty_store_directory_is_an_error():
    fs = fsspec.filesystem("memory")
    folder = f"/kvtune-empty-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(f"{folder}/readme.txt", b"no logs here")
    with pytest.raises(InputError, match="directory holds no log files"):
        expand_paths([f"memory://{folder}"])


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed here")
def test_a_store_without_its_package_names_the_package_to_install():
    code, out = profile("s3://kvtune-logs/2026/11/30/part-0.parquet", "--json")
    assert (code, out) == (2, "Error: s3://kvtune-logs/2026/11/30/part-0.parquet: reading s3:// needs s3fs: "
                              "pip install 'kvtune[remote]' (or pip install s3fs)\n")


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_gcs_without_gcsfs_names_it():
    code, out = profile("gs://kvtune-logs/*.jsonl")
    assert code == 2 and out.startswith("Error: gs://kvtune-logs/*.jsonl: reading gs:// needs gcsfs: ")


def test_a_bad_row_in_a_remote_jsonl_names_the_url_and_line(tmp_path):
    lines = MOONCAKE.read_text().splitlines()
    lines[40] = lines[40].replace('"output_length": ', '"output_length": -')
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(lines) + "\n")
    url = _to_memory(path)
    code, out = profile(url, "--strict")
    assert code == 2
    assert re.fullmatch(rf"Error: {re.escape(url)}:41: output_length: [^\n]+\n", out), out
    code, out = profile(url, "--json")  # skipped and counted, the example naming the URL
    assert code == 0
    examples = json.loads(out)["skipped"]["examples"]
    assert list(examples.values()) == [f"{url}:41: output_length: " + next(iter(examples.values())).split(": ", 2)[2]]


def test_credentials_in_a_url_are_never_shown():
    assert redact("https://alice:s3cret@logs.example.com/a.jsonl?X-Amz-Signature=abc&part=2") == (
        "https://alice:***@logs.example.com/a.jsonl?X-Amz-Signature=***&part=2")
    assert redact("memory:///a/b.jsonl") == "memory:///a/b.jsonl"
    assert is_log_name("part-0.parquet") and not is_log_name("_SUCCESS")


# -- a real HTTP server on loopback -----------------------------------------------------------------


@pytest.fixture(scope="module")
def big_parquet(tmp_path_factory) -> Path:
    """The Azure conversation trace as Parquet, with a wide column that no profile reads (a
    request body), so a reader that fetches only the columns it needs reads a small part of it."""
    table = pcsv.read_csv(AZURE_CONV)
    rng = np.random.default_rng(16)
    body = pa.array([rng.bytes(512).hex() for _ in range(table.num_rows)])
    path = tmp_path_factory.mktemp("http") / "azure_conv_bodies.parquet"
    pq.write_table(table.append_column("request_body", body), path, row_group_size=2000, compression="zstd")
    return path


@pytest.fixture
def server(logs, big_parquet) -> Iterator[FileServer]:
    root = big_parquet.parent
    for name, path in logs.items():
        (root / name).write_bytes(path.read_bytes())
    with FileServer(root) as srv:
        yield srv


def _ranges(log: list[tuple[str, str, str | None]], name: str, size: int) -> tuple[int, int, int]:
    """(GET requests for `name`, how many carried a Range header, bytes those ranges cover)."""
    gets = [r for m, p, r in log if m == "GET" and p == f"/{name}"]
    covered = 0
    for header in gets:
        if header is None:
            continue
        start, _, end = header.removeprefix("bytes=").partition("-")
        covered += min(int(end) if end else size - 1, size - 1) - int(start) + 1
    return len(gets), sum(r is not None for r in gets), covered


def test_parquet_over_http_reads_only_ranges_and_profiles_the_same(server, big_parquet):
    size = big_parquet.stat().st_size
    assert size > 8 << 20  # several fetch blocks, so reading it whole would show
    url = server.url(big_parquet.name)
    code, out = profile(url, "--json")
    assert code == 0, out
    assert out == as_url(local_json(big_parquet), big_parquet, url)
    gets, ranged, covered = _ranges(server.log, big_parquet.name, size)
    assert gets >= 2 and ranged == gets  # every GET asked for a range
    assert covered < size // 5, (covered, size)  # footer, first group (detection), two small columns


@pytest.mark.parametrize("name", ["mooncake.jsonl", "mooncake.jsonl.gz", "azure_style_trace.csv"])
def test_logs_over_http_profile_the_same(server, logs, name):
    url = server.url(name)
    code, out = profile(url, "--json")
    assert code == 0, out
    assert out == as_url(local_json(logs[name]), logs[name], url)


def test_a_bad_row_over_http_names_the_url_and_line(server):
    lines = MOONCAKE.read_text().splitlines()
    lines[7] = "{not json"
    (server.root / "bad.jsonl").write_text("\n".join(lines) + "\n")
    code, out = profile(server.url("bad.jsonl"), "--strict")
    assert code == 2 and out.startswith(f"Error: {server.url('bad.jsonl')}:8: "), out
    assert out.count("\n") == 1


def test_http_404_is_one_line_naming_the_url(server):
    url = server.url("missing.jsonl")
    code, out = profile(url, "--json")
    assert (code, out) == (2, f"Error: {url}: not found (HTTP 404)\n")


def test_a_refused_connection_is_one_line_without_the_password():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://reader:hunter2@127.0.0.1:{port}/logs/day.parquet"
    code, out = profile(url, "--json")
    assert code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"Error: http://reader:***@127.0.0.1:{port}/logs/day.parquet: cannot read: "
                          f"cannot connect to 127.0.0.1:{port}"), out
    assert "hunter2" not in out


def test_http_403_is_one_line_naming_the_url(server):
    url = server.url("private-2026-11-30.jsonl")
    code, out = profile(url, "--json")
    assert (code, out) == (2, f"Error: {url}: cannot read: HTTP 403 Forbidden\n")


@pytest.mark.parametrize(("name", "answered"), [("azure_conv_bodies.parquet", 4), ("mooncake.jsonl.gz", 1)])
def test_a_store_failing_mid_read_is_one_line_naming_the_url(server, name, answered):
    """The server answers the planning reads, then 503: an InputError from inside pyarrow's or
    the decompressor's reads, not a traceback and not a partial profile."""
    server.fail_after[name] = answered
    url = server.url(name)
    code, out = profile(url, "--json")
    assert code == 2 and out.startswith(f"Error: {url}: cannot read: HTTP 503 Service Unavailable"), out
    assert out.count("\n") == 1


def test_recommend_reads_logs_by_url_as_it_reads_them_locally(logs):
    path = logs["azure_style_trace.csv"]
    url = _to_memory(path)
    args = ["--model", "llama-3.1-8b", "--gpu", "H100-80GB", "--json"]
    local = CliRunner().invoke(cli, ["recommend", str(path), *args])
    remote = CliRunner().invoke(cli, ["recommend", url, *args])
    assert local.exit_code == remote.exit_code == 0, remote.output
    assert remote.stdout == as_url(local.stdout, path, url)


def test_an_http_index_page_is_walked_and_globbed_like_a_directory(server, logs):
    """A directory URL over HTTP is its index page: the log files it links are read (sizes by
    HEAD, as a listing has none), other links skipped; a glob matches the links."""
    base = f"http://127.0.0.1:{server.port}/dir/"
    listed = [str(f) for f in expand_paths([base])]
    assert listed == sorted(base + p.name for p in server.root.iterdir() if is_log_name(p.name))
    globbed = expand_paths([base + "*.csv"])
    assert [(str(f), f.size) for f in globbed] == [(base + "azure_style_trace.csv", logs["azure_style_trace.csv"].stat().st_size)]
    code, out = profile(base + "*.csv", "--json")
    path = logs["azure_style_trace.csv"]
    assert code == 0 and out == as_url(local_json(path), path, base + "azure_style_trace.csv"), out


# -- a web server that ignores Range headers (issue #26 item 9) -------------------------------------


@pytest.fixture
def plain_server(logs, big_parquet) -> Iterator[PlainFileServer]:
    """Python's http.server over the logs, the 10 MB Parquet file and a JSONL file of several
    fetch blocks (so reads past the first block would need a range)."""
    root = big_parquet.parent
    for name, path in logs.items():
        (root / name).write_bytes(path.read_bytes())
    (root / "mooncake_x120.jsonl").write_bytes(MOONCAKE.read_bytes() * 120)
    with PlainFileServer(root) as srv:
        yield srv


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("name", ["azure_conv_bodies.parquet", "mooncake_x120.jsonl", "mooncake.jsonl.gz",
                                  "azure_style_trace.csv", "azure_conv.parquet"])
def test_a_server_without_range_support_is_read_whole_once(plain_server, name, workers):
    local = plain_server.root / name
    assert local.stat().st_size > 2 * BLOCK_BYTES or name != "mooncake_x120.jsonl"  # several fetch blocks
    url = plain_server.url(name)
    code, out = profile(url, "--json", "--workers", workers)
    assert code == 0, out
    assert out == as_url(local_json(local, "--workers", workers), local, url)
    whole = [r for m, p, r in plain_server.log if m == "GET" and p == f"/{name}" and r is None]
    assert len(whole) == 1  # streamed once, then read from the local copy by every worker
