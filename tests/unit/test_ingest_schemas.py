"""Every schema adapter on realistic records (tests/data/logs/), and auto-detection of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtune.ingest import COLUMNS, FORMATS, IngestOptions, read_logs

LOGS = Path(__file__).parents[1] / "data" / "logs"


def rows_of(*names: str, **opts):
    it, stats = read_logs([str(LOGS / n) for n in names], IngestOptions(**opts))
    rows = [r for batch in it for r in batch.to_pylist()]
    return rows, stats


@pytest.mark.parametrize(
    "name, fmt",
    [
        ("openai_chat.jsonl", "openai"),
        ("openai_pair.jsonl", "openai-pair"),
        ("openai_batch_input.jsonl", "openai-batch-input"),
        ("openai_batch_output.jsonl", "openai-batch"),
        ("openai_responses.jsonl", "openai-responses"),
        ("anthropic.jsonl", "anthropic"),
        ("litellm_payload.jsonl", "litellm-payload"),
        ("litellm_spend.csv", "litellm-spend"),
        ("langfuse_observations.json", "langfuse"),
        ("helicone.jsonl", "helicone"),
        ("otel_otlp.jsonl", "otel"),
        ("envoy_ai_gateway.jsonl", "otel"),
        ("azure_conv.csv", "azure"),
        ("burstgpt.csv", "burstgpt"),
        ("mooncake.jsonl", "mooncake"),
        ("splitwise.csv", "splitwise"),
        ("kvtune.jsonl", "kvtune"),
    ],
)
def test_detects_format(name, fmt):
    _, stats = rows_of(name)
    assert [f.format for f in stats.files] == [fmt]
    assert fmt in FORMATS
    assert stats.rows_read == stats.rows_ok + sum(stats.skipped.values())


def test_openai_chat():
    rows, stats = rows_of("openai_chat.jsonl")
    assert [r["output_tokens"] for r in rows] == [143, 512, 2]
    assert [r["prompt_tokens"] for r in rows] == [812, 95, 4]
    assert [r["finish_reason"] for r in rows] == ["stop", "length", "stop"]
    assert [r["censored"] for r in rows] == [False, True, False]
    assert rows[0]["timestamp_s"] == 1714000000.0
    assert {r["route"] for r in rows} == {"*"}  # a response body does not log its path
    assert list(rows[0]) == list(COLUMNS)


def test_openai_pair_takes_path_cap_and_timings():
    rows, _ = rows_of("openai_pair.jsonl")
    assert [r["route"] for r in rows] == ["/v1/chat/completions"] * 2
    assert [r["max_tokens"] for r in rows] == [256, 256]
    assert rows[0]["latency_ms"] == 1834.5 and rows[0]["ttft_ms"] == 212.0
    assert rows[0]["timestamp_s"] == pytest.approx(1717236000.25)
    assert [r["censored"] for r in rows] == [False, True]


def test_batch_output_joins_input_on_custom_id():
    rows, stats = rows_of("openai_batch_output.jsonl", "openai_batch_input.jsonl")
    assert [(r["route"], r["max_tokens"], r["output_tokens"]) for r in rows] == [
        ("/v1/chat/completions", 16, 1),
        ("/v1/chat/completions", 300, 300),
    ]
    assert rows[1]["censored"] is True
    assert stats.skipped == {"failed request": 1}  # req-3 failed with rate_limit_exceeded
    assert "rate_limit_exceeded" in stats.examples["failed request"]
    assert stats.ignored["Batch API input lines (joined by custom_id)"] == 3


def test_batch_input_lines_that_are_not_objects_are_counted_not_fatal(tmp_path):
    """A Batch API input file whose lines include JSON that is not an object (a string, a list, a
    number: found by the CLI fuzzer) still joins its good lines and counts the others."""
    text = (LOGS / "openai_batch_input.jsonl").read_text() + '"\\ud800"\n[1, 2]\n7\n'
    (tmp_path / "openai_batch_input.jsonl").write_text(text)
    it, stats = read_logs([str(LOGS / "openai_batch_output.jsonl"), str(tmp_path / "openai_batch_input.jsonl")],
                          IngestOptions())
    rows = [r for batch in it for r in batch.to_pylist()]
    assert [(r["route"], r["max_tokens"]) for r in rows] == [("/v1/chat/completions", 16), ("/v1/chat/completions", 300)]
    assert stats.ignored["Batch API input line not a JSON object"] == 3
    assert stats.ignored["Batch API input lines (joined by custom_id)"] == 3


def test_batch_output_alone_has_no_route():
    rows, _ = rows_of("openai_batch_output.jsonl")
    assert {r["route"] for r in rows} == {"*"} and rows[0]["max_tokens"] is None


def test_responses_incomplete_is_censored():
    rows, _ = rows_of("openai_responses.jsonl")
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in rows] == [(36, 87), (300, 1024)]
    assert [r["finish_reason"] for r in rows] == ["stop", "length"]
    assert [r["censored"] for r in rows] == [False, True]
    assert rows[1]["max_tokens"] == 1024


def test_anthropic_stop_reasons_and_cached_prompt():
    rows, _ = rows_of("anthropic.jsonl")
    assert [r["finish_reason"] for r in rows] == ["stop", "length", "tool_calls"]
    assert [r["censored"] for r in rows] == [False, True, False]
    assert rows[0]["prompt_tokens"] == 12 + 2048  # cache reads count as prompt (§2.4)


def test_litellm_payload():
    rows, stats = rows_of("litellm_payload.jsonl")
    assert [r["route"] for r in rows] == ["/chat/completions", "/v1/chat/completions"]
    assert [r["model"] for r in rows] == ["chat-small", "chat-small"]
    assert [r["max_tokens"] for r in rows] == [64, 1024]
    assert rows[0]["latency_ms"] == pytest.approx(1500.0)
    assert rows[0]["ttft_ms"] == pytest.approx(250.0)
    assert rows[1]["censored"] is True
    assert stats.skipped == {"failed request": 1}


def test_litellm_spend_csv_with_json_text_columns():
    rows, _ = rows_of("litellm_spend.csv")
    assert [r["output_tokens"] for r in rows] == [50, 1024]
    assert rows[0]["route"] == "/chat/completions" and rows[0]["max_tokens"] == 64
    assert rows[0]["finish_reason"] == "stop"
    assert rows[0]["latency_ms"] == 1500.0 and rows[0]["ttft_ms"] == pytest.approx(250.0)
    assert rows[1]["route"] == "*" and rows[1]["finish_reason"] is None


def test_langfuse_generations_only():
    rows, stats = rows_of("langfuse_observations.json")
    assert [r["output_tokens"] for r in rows] == [120, 512]
    assert [r["max_tokens"] for r in rows] == [512, 512]  # "512" as a string in modelParameters
    assert rows[0]["ttft_ms"] == pytest.approx(400.0, abs=0.01)
    assert rows[1]["censored"] is True
    assert stats.ignored == {"observation type SPAN": 1} and not stats.skipped


def test_helicone():
    rows, stats = rows_of("helicone.jsonl")
    assert [r["route"] for r in rows] == ["/v1/chat/completions"] * 2
    assert rows[0]["max_tokens"] == 100 and rows[0]["finish_reason"] == "stop"
    assert rows[0]["latency_ms"] == 1377.0 and rows[0]["ttft_ms"] == 240.0
    assert stats.skipped == {"failed request": 1}


def test_otlp_new_and_old_attribute_names():
    rows, stats = rows_of("otel_otlp.jsonl")
    new, old = rows
    assert (new["prompt_tokens"], new["output_tokens"], new["max_tokens"]) == (97, 52, 200)
    assert new["route"] == "/v1/chat/completions"  # from the HTTP parent span
    assert new["finish_reason"] == "stop" and new["latency_ms"] == pytest.approx(2000.0)
    assert (old["prompt_tokens"], old["output_tokens"]) == (30, 128)
    assert old["ttft_ms"] == pytest.approx(31.0)
    assert old["censored"] is True  # no finish reason, output reached max_tokens
    assert stats.ignored == {"span without gen_ai attributes": 1}


def test_envoy_flat_gen_ai_keys():
    rows, _ = rows_of("envoy_ai_gateway.jsonl")
    assert [(r["route"], r["prompt_tokens"], r["output_tokens"]) for r in rows] == [
        ("/v1/chat/completions", 120, 33),
        ("/v1/completions", 7, 16),
    ]


def test_public_trace_shapes():
    rows, _ = rows_of("azure_conv.csv")
    assert rows[0]["timestamp_s"] == pytest.approx(1700158546.68059, abs=1e-5)
    rows, stats = rows_of("burstgpt.csv")
    assert [r["model"] for r in rows] == ["ChatGPT", "GPT-4"]
    assert rows[0]["latency_ms"] == pytest.approx(1200.0)
    assert stats.skipped == {"failed request": 1}
    rows, _ = rows_of("mooncake.jsonl")
    assert rows[1]["timestamp_s"] == pytest.approx(27.482)
    rows, _ = rows_of("splitwise.csv")
    assert [r["route"] for r in rows] == ["0", "0", "1"]


def test_assume_cap_censors_the_trace_maximum():
    rows, _ = rows_of("azure_conv.csv", assume_cap=1000)
    assert [r["censored"] for r in rows] == [False, False, True]


def test_kvtune_native_censoring_without_reason():
    rows, _ = rows_of("kvtune.jsonl")
    assert [r["censored"] for r in rows] == [False, True, True]  # 256 of max 256, no reason


@pytest.mark.parametrize(
    "route_by, routes",
    [
        (None, ["chat", "chat", "summarize"]),
        ("model", ["llama-3.1-8b"] * 3),
        ("path", ["*"] * 3),
        ("finish_reason", ["stop", "length", "*"]),
    ],
)
def test_route_by(route_by, routes):
    rows, _ = rows_of("kvtune.jsonl", route_by=route_by)
    assert [r["route"] for r in rows] == routes


def test_route_by_nested_field_on_record_adapter():
    rows, _ = rows_of("litellm_payload.jsonl", route_by="metadata.user_api_key_request_route")
    assert [r["route"] for r in rows] == ["/chat/completions", "/v1/chat/completions"]


def test_field_mapping_overrides_detection():
    rows, _ = rows_of("openai_chat.jsonl", fields={"output_tokens": "usage.total_tokens"})
    assert [r["output_tokens"] for r in rows] == [955, 607, 6]


def test_forced_format():
    rows, stats = rows_of("mooncake.jsonl", format="mooncake")
    assert stats.files[0].format == "mooncake" and len(rows) == 2
