"""Public request traces (reference doc §2.11): per-request token counts, no finish reasons.

Without finish reasons nothing is censored unless the user says where the cap was
(`IngestOptions.assume_cap`): the Azure conv and Mooncake conversation traces both show a point
mass at their maximum that looks like a generation cap.
"""

from __future__ import annotations

from kvtune.ingest.schemas._base import Adapter, Flat, has

AZURE = Adapter(
    name="azure",
    description="Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)",
    match=lambda r: has(r, "ContextTokens", "GeneratedTokens"),
    flat=Flat(
        columns={
            "timestamp_s": "TIMESTAMP",
            "prompt_tokens": "ContextTokens",
            "output_tokens": "GeneratedTokens",
        }
    ),
)

BURSTGPT = Adapter(
    name="burstgpt",
    description="BurstGPT CSV (Timestamp, Model, Request tokens, Response tokens, Elapsed time); "
    "rows with 0 response tokens are failed requests and skipped as such",
    match=lambda r: has(r, "Request tokens", "Response tokens"),
    flat=Flat(
        columns={
            "timestamp_s": "Timestamp",
            "model": "Model",
            "prompt_tokens": "Request tokens",
            "output_tokens": "Response tokens",
            "latency_ms": "Elapsed time",
        },
        latency_unit="s",
        zero_output_failed=True,
    ),
)

MOONCAKE = Adapter(
    name="mooncake",
    description="Mooncake trace JSONL (timestamp in ms, input_length, output_length, hash_ids)",
    match=lambda r: has(r, "input_length", "output_length"),
    flat=Flat(
        columns={
            "timestamp_s": "timestamp",
            "prompt_tokens": "input_length",
            "output_tokens": "output_length",
        },
        time_unit="ms",
    ),
)

SPLITWISE = Adapter(
    name="splitwise",
    description="Splitwise-sim request CSV (arrival_timestamp, prompt_size, token_size; "
    "application_id is the route)",
    match=lambda r: has(r, "prompt_size", "token_size"),
    flat=Flat(
        columns={
            "route": "application_id",
            "timestamp_s": "arrival_timestamp",
            "prompt_tokens": "prompt_size",
            "output_tokens": "token_size",
        }
    ),
)

VIDUR = Adapter(
    name="vidur",
    description="Vidur processed trace CSV (num_prefill_tokens, num_decode_tokens[, arrived_at])",
    match=lambda r: has(r, "num_prefill_tokens", "num_decode_tokens"),
    flat=Flat(
        columns={
            "timestamp_s": "arrived_at",
            "prompt_tokens": "num_prefill_tokens",
            "output_tokens": "num_decode_tokens",
        }
    ),
)
