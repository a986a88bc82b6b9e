"""What `kvtune bench` sends to and holds the run to: the live server and how each request is
sent (`BenchTarget`), and the objectives and recommendation its verdict checks (`Expectations`);
values kvtune.api.bench takes whole, as the CLI builds them from its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtune.domain.retry_policy import RetryPolicy
from kvtune.domain.slo import Slo
from kvtune.errors import OptionError

__all__ = ["BenchTarget", "Expectations"]

LENGTH_CONTROLS = ("max-tokens", "min-tokens")


@dataclass(frozen=True, slots=True)
class BenchTarget:
    """The server at `url` (its root or any path under it) and each request: its `model` field
    (None: the first of /v1/models), the `endpoint` ("chat" or "completions"), a limit of
    `timeout_s` from first byte to [DONE], `retry` on 429. Each output is held to its drawn
    length by max_tokens (`length_control` "max-tokens") or, without declaring max_tokens, by
    min_tokens and a logit bias on `eos_token_id` ("min-tokens"), with `ignore_eos`. /metrics
    (`metrics_url`, default URL/metrics) is sampled every `scrape_interval_s`; `tokenizer` counts
    prompts for a server without /tokenize."""

    url: str
    model: str | None = None
    endpoint: str = "chat"
    timeout_s: float = 300.0
    retry: RetryPolicy = RetryPolicy()
    ignore_eos: bool = True
    length_control: str = "max-tokens"
    eos_token_id: int | None = None
    metrics_url: str | None = None
    scrape_interval_s: float = 1.0
    max_connections: int | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: never in a repr
    tokenizer: str | None = None

    def check(self) -> None:
        if self.length_control not in LENGTH_CONTROLS:
            raise OptionError(f"{self.length_control!r} is not one of {', '.join(LENGTH_CONTROLS)}",
                              field="length_control")
        if self.length_control == "min-tokens" and self.eos_token_id is None:
            raise OptionError("--length-control min-tokens needs the model's EOS token id", field="--eos-token-id")


@dataclass(frozen=True, slots=True)
class Expectations:
    """What a benchmark's verdict checks: `slo` met by at least `slo_attainment` of the requests,
    and the recommendation.json at `expect` (preemptions, KV peak, admitted concurrency,
    truncation). Neither: no verdict."""

    slo: Slo | None = None
    slo_attainment: float = 0.99
    expect: str | None = None
