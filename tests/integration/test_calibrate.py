"""Calibration from a vLLM's /v1/models and /metrics: real captures, over real loopback HTTP.

The data files are byte-for-byte captures from vllm-cpu 0.32.0 serving the test bed's tiny model
with --kv-cache-memory-bytes 2097152 and --max-model-len 512 (tests/data/CAPACITY_SOURCES.md).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_vllm import FakeVllm

from kvtune.capacity.measured import (
    CapacitySource,
    MeasuredCapacity,
    ServedModel,
    calibrate,
    capacity_from_server,
    cross_check,
    fetch_capacity,
    parse_models,
    parse_vllm_log,
    read_capacity_file,
    write_capacity_file,
)
from kvtune.errors import CapacityError, EndpointError, KvtuneError

DATA = Path(__file__).parents[1] / "data"
METRICS = (DATA / "metrics-cpu-0.32-live.txt").read_bytes()
MODELS = (DATA / "v1-models-cpu-0.32.json").read_bytes()
LOG = DATA / "vllm-cpu-0.32-live-startup.log"
PROM = "text/plain; version=0.0.4; charset=utf-8"


def vllm_routes(models: bytes = MODELS, metrics: bytes = METRICS) -> dict:
    return {"/v1/models": (200, "application/json", models), "/metrics": (200, PROM, metrics)}


def serving(routes: dict, **steer) -> FakeVllm:
    """The fake vLLM answering the captures in `routes`, and 404 for any other path."""
    return FakeVllm(routes=routes, routes_only=True, **steer)


def test_capacity_from_the_real_captures():
    m = capacity_from_server(parse_models(json.loads(MODELS), origin="m"), METRICS.decode(), root="http://h:1")
    assert m == MeasuredCapacity(
        source=CapacitySource.METRICS, model="tiny", max_model_len=512, num_blocks=32, block_size=128,
        kv_cache_tokens=4096, max_concurrency=8.0, kv_cache_dtype="auto", enable_prefix_caching=True,
        gpu_memory_utilization=0.92, kv_cache_memory_bytes=2097152, num_gpu_blocks_override=None,
        origin="http://h:1",
    )


def test_servers_without_a_token_label_get_blocks_times_block_size():
    # V0-era cache_config_info: num_gpu_blocks and block_size, no kv_cache_size_tokens
    text = (DATA / "metrics-qwen3-32b-gpu.txt").read_text()
    m = capacity_from_server((ServedModel("qwen", 40960),), text, root="http://h")
    assert (m.num_blocks, m.block_size, m.kv_cache_tokens, m.max_model_len) == (573, 16, 573 * 16, 40960)


def test_the_model_named_by_metrics_is_chosen():
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="10",model_name="b"} 1.0\n'
    m = capacity_from_server((ServedModel("a", 100), ServedModel("b", 200)), text, root="http://h")
    assert (m.model, m.max_model_len) == ("b", 200)


@pytest.mark.parametrize(("data", "message"), [
    ([1], 'm: not an OpenAI-compatible /v1/models answer (no "data" list)'),
    ({"object": "list"}, 'm: not an OpenAI-compatible /v1/models answer (no "data" list)'),
    ({"data": []}, "m: the server lists no models"),
    ({"data": [{"object": "model"}]}, 'm: data[0].id: model entry without a string "id"'),
    ({"data": [{"id": "x", "max_model_len": "512"}]}, "m: data[0].max_model_len: expected a positive integer, found '512'"),
    ({"data": [{"id": "x", "max_model_len": True}]}, "m: data[0].max_model_len: expected a positive integer, found True"),
    ({"data": [{"id": "x", "max_model_len": 0}]}, "m: data[0].max_model_len: expected a positive integer, found 0"),
])
def test_parse_models_rejects_what_is_not_a_model_list(data, message):
    with pytest.raises(EndpointError) as info:
        parse_models(data, origin="m")
    assert str(info.value) == message


def test_parse_models_without_vllm_extension():
    assert parse_models({"data": [{"id": "gpt"}]}, origin="m") == (ServedModel("gpt", None),)


# --- cross-checking against a startup log ------------------------------------------------------


def _live() -> MeasuredCapacity:
    return capacity_from_server(parse_models(json.loads(MODELS), origin="m"), METRICS.decode(), root="http://h")


def test_the_servers_own_log_agrees():
    logged = parse_vllm_log(LOG.read_text(), path="vllm.log")
    assert (logged.kv_cache_tokens, logged.max_model_len, logged.device) == (4096, 512, "CPU")
    checked = cross_check(_live(), logged)
    assert checked.device == "CPU"
    assert checked == MeasuredCapacity(**{**_fields(_live()), "device": "CPU"})


def _fields(m: MeasuredCapacity) -> dict:
    return {**m.to_dict(), "source": m.source}


@pytest.mark.parametrize(("line", "message"), [
    ("CPU KV cache size: 8,192 tokens, Maximum concurrency for 512 tokens per request: 16.00x",
     "--vllm-log: the server reports kv_cache_tokens 4,096 but the log old.log:2 says 8,192; "
     "is the log from this server's latest start?"),
    ("CPU KV cache size: 4,096 tokens, Maximum concurrency for 1,024 tokens per request: 4.00x",
     "--vllm-log: the server reports max_model_len 512 but the log old.log:2 says 1,024; "
     "is the log from this server's latest start?"),
])
def test_a_log_that_disagrees_is_an_error(line, message):
    logged = parse_vllm_log(f"INFO starting\n{line}\n", path="old.log")
    with pytest.raises(CapacityError) as info:
        cross_check(_live(), logged)
    assert str(info.value) == message


def test_an_override_line_is_checked_as_blocks():
    logged = parse_vllm_log("Overriding num_gpu_blocks=32 with num_gpu_blocks_override=16\n", path="o.log")
    with pytest.raises(CapacityError, match="reports num_blocks 32 but the log o.log:1 says 16"):
        cross_check(_live(), logged)


# --- over real loopback HTTP -------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/", "/metrics"])
def test_fetch_over_http(suffix):
    with serving(vllm_routes()) as fake:
        base = fake.url
        m = asyncio.run(fetch_capacity(base + suffix))
    assert [c.path for c in fake.other] == ["/v1/models", "/metrics"]
    assert (m.model, m.max_model_len, m.num_blocks, m.block_size, m.kv_cache_tokens) == ("tiny", 512, 32, 128, 4096)
    assert m.origin == base and m.source is CapacitySource.METRICS


def test_calibration_round_trips_through_the_capacity_file(tmp_path):
    with serving(vllm_routes()) as fake:
        m = asyncio.run(calibrate(fake.url, vllm_log=str(LOG)))
    write_capacity_file(tmp_path / "cap.json", m)
    assert read_capacity_file(tmp_path / "cap.json") == m
    assert m.device == "CPU"


def test_unreachable():
    with serving({}) as fake:
        pass  # closed again: the port now refuses
    base = fake.url
    with pytest.raises(EndpointError) as info:
        asyncio.run(fetch_capacity(base, timeout_s=2))
    assert str(info.value).startswith(f"{base}/v1/models: cannot reach: ")


@pytest.mark.parametrize(("routes", "message"), [
    ({}, "{base}/v1/models: HTTP 404 Not Found"),
    ({"/v1/models": (200, "text/html", b"<html>hi</html>")},
     "{base}/v1/models: not an OpenAI-compatible server: /v1/models did not answer JSON"),
    ({"/v1/models": (200, "application/json", MODELS)}, "{base}/metrics: HTTP 404 Not Found"),
    ({"/v1/models": (200, "application/json", MODELS),
      "/metrics": (200, PROM, b"# TYPE up gauge\nup 1.0\n")},
     "{base}/metrics: no vllm:cache_config_info metric; is this a vLLM /metrics endpoint?"),
    ({"/v1/models": (200, "application/json", MODELS),
      "/metrics": (200, PROM, b'vllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1.0\n')},
     "{base}/metrics: vllm:cache_config_info has no num_gpu_blocks/block_size yet (the engine has not "
     "finished profiling); retry when the server is up"),
    ({"/v1/models": (500, "application/json", b"{}")}, "{base}/v1/models: HTTP 500 Internal Server Error"),
])
def test_endpoint_errors_are_one_line(routes, message):
    with serving(routes) as fake:
        with pytest.raises(EndpointError) as info:
            asyncio.run(fetch_capacity(fake.url))
    assert str(info.value) == message.format(base=fake.url)


def test_a_server_that_does_not_answer_in_time():
    with serving(vllm_routes(), delay_s=2.0) as fake:
        with pytest.raises(EndpointError) as info:
            asyncio.run(fetch_capacity(fake.url, timeout_s=0.3))
    assert str(info.value) == f"{fake.url}/v1/models: no complete answer within the timeout"


def test_calibrate_needs_a_url_or_a_log():
    with pytest.raises(KvtuneError) as info:
        asyncio.run(calibrate(None))
    assert str(info.value) == "url: give the server's URL, a startup log (`vllm_log` FILE), or both"


def test_calibrate_from_a_log_alone():
    m = asyncio.run(calibrate(None, vllm_log=str(LOG)))
    assert (m.source, m.kv_cache_tokens, m.max_model_len, m.num_blocks) == (CapacitySource.VLLM_LOG, 4096, 512, None)


def test_a_bad_max_model_len_is_quoted_briefly():
    with pytest.raises(EndpointError) as info:
        parse_models({"data": [{"id": "m", "max_model_len": [1] * 1_000_000}]}, origin="http://h/v1/models")
    assert str(info.value) == ("http://h/v1/models: data[0].max_model_len: expected a positive integer, "
                               "found [1, 1, 1, 1, ...]")


def test_startup_log_states_the_scheduler_limits():
    """`non-default args` and the chunked-prefill line give max_num_seqs / max_num_batched_tokens; a
    later start that does not set them is back on the defaults (None: not stated)."""
    from kvtune.capacity.measured import parse_vllm_log, scheduler_limits_from_log

    base = (DATA / "vllm-cpu-0.32-live-startup.log").read_text()
    assert scheduler_limits_from_log(base) == (None, None)
    given = base.replace("'kv_cache_memory_bytes': 2097152}",
                         "'kv_cache_memory_bytes': 2097152, 'max_num_seqs': 4, 'max_num_batched_tokens': 256}")
    m = parse_vllm_log(given)
    assert (m.max_num_seqs, m.max_num_batched_tokens) == (4, 256)
    assert scheduler_limits_from_log(given + "\n" + base) == (None, None)
    assert scheduler_limits_from_log("INFO Chunked prefill is enabled with max_num_batched_tokens=8192.") == (None, 8192)
