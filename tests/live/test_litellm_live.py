"""kvtune's hook inside a real LiteLLM proxy in front of a real vLLM on CPU (32 blocks of 128
tokens, the default live server): the budget is the engine's own pool, so under a load that would
overfill it vLLM never preempts, the hook answers 429s instead, and the ledger drains to 0; and
what LiteLLM forwards is what vLLM runs: a cap smuggled in extra_body (with ignore_eos, so the
model runs to whatever cap it is given) generates the route's cap, not the client's.

Run under `flock /tmp/kvtune-vllm.lock` (one vLLM on the machine at a time)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
from collections import Counter

import aiohttp
import pytest
from litellm_proxy import LitellmProxy
from vllm_server import synth_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("litellm") is None:  # not imported here: outside the proxy it fetches a cost map
    pytest.fail("the litellm extra is required for this test: pip install 'kvtune[litellm]'")

CAP = 200
REQUESTS, CONCURRENCY = 40, 16


def _preemptions(metrics_text: str) -> float:
    return sum(float(v) for v in re.findall(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", metrics_text, re.M))


def test_the_hook_keeps_a_real_vllm_from_preempting_and_caps_what_litellm_forwards(vllm_server, tmp_path):
    server = vllm_server
    doc = {"version": 1, "upstream": server.url, "block_size": server.block_size,
           "block_budget": server.num_blocks, "max_model_len": server.max_model_len,
           "routes": [{"name": "chat", "match": {"path": "/v1/chat/completions"}, "max_new_tokens": CAP}]}
    before = _preemptions(server.metrics_text())
    with LitellmProxy(tmp_path, doc, server.url, model=server.model) as proxy:
        async def run() -> tuple[Counter, dict]:
            tally: Counter = Counter()
            rng = random.Random(7)
            limit = asyncio.Semaphore(CONCURRENCY)
            async with aiohttp.ClientSession(headers=proxy.headers) as session:
                async def one() -> None:
                    body = {"model": server.model, "stream": rng.random() < 0.5,
                            "messages": [{"role": "user", "content": synth_prompt(rng.randint(10, 250))}],
                            "extra_body": {"max_tokens": 400, "ignore_eos": True}}
                    async with limit, session.post(f"{proxy.url}/v1/chat/completions", json=body) as response:
                        tally[response.status] += 1
                        await response.read()

                async with asyncio.TaskGroup() as group:
                    for _ in range(REQUESTS):
                        group.create_task(one())
                smuggled = {"model": server.model, "messages": [{"role": "user", "content": synth_prompt(20)}],
                            "max_tokens": 5, "extra_body": {"max_tokens": 400, "ignore_eos": True}}
                async with session.post(f"{proxy.url}/v1/chat/completions", json=smuggled) as response:
                    assert response.status == 200, await response.text()
                    answer = json.loads(await response.read())
            return tally, answer

        tally, answer = asyncio.run(run())
        ledger = proxy.wait_drained(30)
        metrics = proxy.metrics()
    peak = int(float(re.search(r"^kvtune_gateway_reserved_blocks_peak (\S+)$", metrics, re.M).group(1)))
    preempted = _preemptions(server.metrics_text()) - before
    print(f"\nLiteLLM hook on vLLM (CPU): {REQUESTS} requests, {dict(tally)}; peak reserved {peak} of "
          f"{server.num_blocks} blocks; preemptions {preempted:g}; final reserved {ledger['reserved']}")
    assert answer["usage"]["completion_tokens"] == CAP  # extra_body's 400 was forwarded as the cap
    assert ledger["reserved"] == 0 and ledger["inflight"] == 0, ledger
    assert peak <= server.num_blocks and preempted == 0
    assert tally[429] > 0 and tally[200] > 0, tally  # the budget filled, and the rest ran
