"""The whole server, not only the forward pass (issue 27 item 2): an uncalibrated `simulate` puts
vLLM's API server in front of the engine (kvtune.sim.frontend.VLLM_API_SERVER, measured on vLLM's
own OpenAI server by benchmarks/ttft_shape.py and host_overheads.py) and names where that figure
came from."""

from __future__ import annotations

import json
from pathlib import Path

from sim_cli import simulate_json as simulate
from sim_cli import uniform_log

BURST = 200
REQUEST_S = 0.00249  # the measured ingress work per chat request (kvtune/sim/frontend.py)
TOKEN_S = 0.0000126  # the measured API-server work per streamed token (benchmarks/host_overheads.py)


def burst_log(tmp_path: Path, requests: int = BURST) -> str:
    """`requests` short chat requests all sent at t = 0, one output token each."""
    return uniform_log(tmp_path / "burst.jsonl", requests, 16, 1, finish_reason="length")


def test_a_burst_queues_behind_vllms_api_server(tmp_path):
    """200 requests at once: the engine prefills their 3,200 tokens in one step or two (tens of ms),
    but vLLM's API server prepares them on one process, and the first tokens it streams wait for
    that work: the first tokens come after 200 requests' ingress work (0.50 s); on the forward
    pass alone every TTFT was under 0.1 s."""
    data = simulate(burst_log(tmp_path))
    timing = data["simulation"]["timing"]
    assert timing["source"] == "silicon"
    assert timing["frontend"] == {"request_s": REQUEST_S, "token_s": TOKEN_S}
    assert "vLLM 0.32.0's OpenAI API server" in timing["frontend_from"]
    ttft = data["latency_ms"]["ttft"]
    assert ttft["p50"] >= BURST * REQUEST_S * 1000


def test_a_burst_of_512_gets_its_first_tokens_together_as_on_vllm(tmp_path):
    """512 chat requests sent at once, 2 tokens each (benchmarks/ttft_shape.py's burst): on vLLM's
    own server, idle but for the burst, no request had a first token before 0.43-0.52 s, and the
    median came at 0.78-0.88 s (p99 ÷ median TTFT 1.05-1.24). The API server shares its one
    process among the requests in it, so all 512 reach the engine together after 512 × 2.49 ms
    and run in one batch; the FIFO
    server kvtune had handed them on one by one, 2.69 ms apart, to an engine that never ran more
    than 6 at once (its first tokens queued behind the rest of the burst's ingress, so the TTFTs
    bunched there too: p99 ÷ median 1.005 at 1.38 s)."""
    data = simulate(uniform_log(tmp_path / "burst.jsonl", 512, 16, 2))
    ttft = data["latency_ms"]["ttft"]
    assert ttft["p50"] >= 512 * REQUEST_S * 1000
    assert ttft["p99"] / ttft["p50"] < 1.5
    assert data["server"]["running_peak"] == 512


def test_streaming_costs_each_token_its_serial_work_and_no_more(tmp_path):
    """500 requests decoding 200 tokens each, all sent at once: every token costs vLLM's API server
    12.6 µs of serial work (output processor, detokenizer), so no more than ~79,000 tokens/s leave
    it; an H100 decoding Llama-3.1-8B at that batch makes ~25,000, which the server keeps up with:
    the output rate is the engine's, not a streaming limit (the SSE chunk's own cost merges tokens
    under load in vLLM, so it is not charged per token). (500, not the 600 it was: a decode batch
    above vLLM's largest CUDA graph, 512, runs eagerly at ~10,000 tokens/s, which says nothing of
    the server.)"""
    path = tmp_path / "streams.jsonl"
    row = {"route": "/v1/chat/completions", "prompt_tokens": 16, "output_tokens": 200, "finish_reason": "stop",
           "timestamp_s": 0.0}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(500)))
    data = simulate(str(path))
    assert data["simulation"]["timing"]["frontend"]["token_s"] == TOKEN_S
    assert data["server"]["running_peak"] == 500
    assert 0.2 / TOKEN_S <= data["throughput"]["output_tokens_per_s"] <= 0.5 / TOKEN_S


def test_another_engines_server_is_not_priced_as_vllms(tmp_path):
    """SGLang's server was not measured: no front end, and the output says why."""
    timing = simulate(burst_log(tmp_path, 20), "--engine", "sglang", "--num-gpu-blocks", "20000")["simulation"]["timing"]
    assert timing["frontend"] is None
    assert timing["frontend_from"].startswith("none: sglang's API server not measured")


def test_vllm_0_11_0_parses_the_template_on_every_request_and_is_priced_by_its_own_server(tmp_path):
    """0.11.0 alone parses the chat template per request (kvtune/sim/frontend.py): its burst reaches
    the engine after B × 16.55 ms, its lone request 22.33 ms after its send; the releases beside it
    (0.11.1 caches the parse, 0.10.2 has none) keep 0.32.0's figures."""
    from kvtune.sim.frontend import VLLM_0_11_0_API_SERVER, VLLM_API_SERVER, vllm_api_server

    assert vllm_api_server((0, 11, 0)).model == VLLM_0_11_0_API_SERVER == vllm_api_server((0, 11)).model
    for other in [(0, 11, 1), (0, 10, 2), (0, 9, 2), (0, 32, 0), None]:
        assert vllm_api_server(other).model == VLLM_API_SERVER
    burst = simulate(burst_log(tmp_path), "--engine-version", "0.11.0")
    timing = burst["simulation"]["timing"]
    assert timing["frontend"] == VLLM_0_11_0_API_SERVER.to_dict()
    assert "vLLM 0.11.0's OpenAI API server" in timing["frontend_from"]
    assert burst["latency_ms"]["ttft"]["p50"] >= BURST * VLLM_0_11_0_API_SERVER.request_s * 1000
    newer = simulate(burst_log(tmp_path), "--engine-version", "0.11.1")["latency_ms"]["ttft"]["p50"]
    assert newer < BURST * VLLM_0_11_0_API_SERVER.request_s * 1000 / 2
    lone = simulate(burst_log(tmp_path, 1), "--engine-version", "0.11.0")
    assert lone["simulation"]["timing"]["http_overhead_s"] == 0.02233
    assert lone["latency_ms"]["ttft"]["p50"] >= 22.33
