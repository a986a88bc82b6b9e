"""Issue 26 item 2 against a real vLLM on CPU: a request that forces its length is priced at what
it forces. A route whose logged answers are 4-16 tokens, statistical admission at epsilon 0.01,
and 24 concurrent chats that send min_tokens 448 (the route's cap): the histogram says each holds
one block, so the gateway admitted all 24 and vLLM, whose pool holds 7 of them at their length,
preempted. Priced at their cap, statistical admits what guaranteed admits, and vLLM's own
counter (vllm:num_preemptions_total) stays where it was."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAP = 448
CONCURRENT = 24


def _preemptions(metrics_text: str) -> float:
    match = re.search(r"^vllm:num_preemptions_total(?:\{[^}]*\})? (\S+)$", metrics_text, re.MULTILINE)
    assert match, "vLLM exports vllm:num_preemptions_total"
    return float(match.group(1))


def _gateway(engine, model_dir, admission: dict):
    from enforcers import PyGateway

    config = {"version": 1, "upstream": engine.url, "block_size": engine.block_size,
              "block_budget": engine.num_blocks - 1, "max_model_len": engine.max_model_len,
              "listen": {"port": 0}, "admission": admission,
              "prompt_tokens": {"method": "tokenizer", "tokenizer": str(model_dir)},
              "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": CAP,
                          "output_histogram": {"lengths": [4, 8, 16], "counts": [50, 30, 20]}}]}
    return PyGateway(yaml.safe_dump(config)).start()


def _burst(gateway, engine, extra: dict) -> tuple[list[int], list[int], int]:
    """24 chats at once; the statuses, the completion tokens of each one answered, and the most
    blocks the ledger held at worst case at once."""
    from vllm_server import synth_prompt

    body = {"model": engine.model, "messages": [{"role": "user", "content": synth_prompt(20)}],
            "max_tokens": CAP, **extra}
    # warm the gateway's tokenizer and connections first, then send all 24 at one instant: each
    # takes over a second to generate its 448 tokens, so all arrive while the first ones run
    assert gateway.request("/v1/chat/completions", {**body, "max_tokens": 1, "min_tokens": 0}, timeout=60)[0] == 200
    gateway.wait_ledger(0)
    barrier = threading.Barrier(CONCURRENT)

    def one(_: int) -> tuple[int, dict, bytes]:
        barrier.wait(30)
        return gateway.request("/v1/chat/completions", body, timeout=600)

    peak, done = [0], threading.Event()

    def sample() -> None:  # the ledger's reserved blocks (worst cases) every 10 ms
        while not done.is_set():
            # a generous timeout: 24 chats and the engine share 2 cores, the ledger may answer late
            status, _, raw = gateway.request("/kvtune/ledger", method="GET", timeout=30)
            assert status == 200, raw
            peak[0] = max(peak[0], json.loads(raw)["reserved"])
            done.wait(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(CONCURRENT) as pool:
            answers = list(pool.map(one, range(CONCURRENT)))
    finally:
        done.set()
        sampler.join()
    statuses = [status for status, _, _ in answers]
    lengths = [json.loads(raw)["usage"]["completion_tokens"] for status, _, raw in answers if status == 200]
    return statuses, lengths, peak[0]


def test_min_tokens_past_the_histogram_is_priced_at_its_cap_and_vllm_never_preempts(vllm_server, vllm_model_dir):
    from vllm_server import chat_prompt_tokens, synth_prompt

    engine = vllm_server
    prompt = chat_prompt_tokens([{"role": "user", "content": synth_prompt(20)}])
    blocks_each = -(-(prompt + CAP) // engine.block_size)  # 24 + 448 tokens: 4 blocks of 128
    guaranteed_admits = (engine.num_blocks - 1) // blocks_each
    assert guaranteed_admits == 7
    budget = engine.num_blocks - 1
    seen = {}
    for name, admission in (("guaranteed", {"policy": "guaranteed"}),
                            ("statistical", {"policy": "statistical", "epsilon": 0.01})):
        gateway = _gateway(engine, vllm_model_dir, admission)
        before = _preemptions(engine.metrics_text())
        try:
            statuses, lengths, peak = _burst(gateway, engine, {"min_tokens": CAP})
            assert gateway.wait_ledger(0, timeout=30)["reserved"] == 0
        finally:
            gateway.stop()
        assert lengths == [CAP] * len(lengths)  # min_tokens made every answer run to its cap
        seen[name] = (statuses.count(200), peak, _preemptions(engine.metrics_text()) - before)
    # statistical holds what guaranteed holds: never more worst cases than the budget (7 of these
    # at once; a few more over the burst as the first ones finish), where the histogram's price
    # admitted all 24 at once (96 blocks)
    # (admitted, peak worst-case blocks held, vLLM's preemptions during the burst) per policy
    for name, (admitted, peak, preempted) in seen.items():
        assert peak <= budget and peak // blocks_each <= guaranteed_admits, (name, seen)
        assert guaranteed_admits <= admitted < CONCURRENT, (name, seen)
        assert preempted == 0, (name, seen)
