"""The load generator's HTTP side: one streamed OpenAI-style request, timed as it arrives.

Why this shape: a benchmark client must not be the bottleneck, so the hot path is a byte-level
SSE splitter and one JSON parse per event; and it must never lose a request, so every attempt's
outcome is recorded in `finally`, cancellation included, before the exception travels on.

Timings are `time.perf_counter()` seconds taken when a chunk is read off the socket:
TTFT = first chunk carrying text − first send; ITL = gaps between text-carrying chunks;
TPOT = (e2e − TTFT) / (output tokens − 1), with output tokens from the server's usage.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from kvtune.domain.retry_policy import RetryPolicy
from kvtune.workload.requests import Outcome, RequestResult, RequestSpec

_loads: Callable[[bytes | str], Any]
try:  # optional: a faster parser when present; the stdlib is the baseline
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

__all__ = [
    "SSEDecoder",
    "Target",
    "send_request",
    "build_body",
    "parse_retry_after",
]


#: No retries: what send_request does unless told otherwise.
NO_RETRY = RetryPolicy()


class SSEDecoder:
    """Incremental server-sent-events splitter: feed raw bytes, get each event's data payload.

    Chunks may split a line or hold many events; lines end in LF or CRLF; `data:` lines of one
    event are joined with LF; comments and other fields are ignored.
    """

    __slots__ = ("_tail", "_data")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = (self._tail + chunk).split(b"\n") if self._tail else chunk.split(b"\n")
        self._tail = lines.pop()
        events: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data is not None:
                    events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = None
            elif line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                if self._data is None:
                    self._data = [value]
                else:
                    self._data.append(value)
        return events

    def close(self) -> list[bytes]:
        """Events left at end of stream: a final event without its blank line still counts."""
        events = self.feed(b"\n\n") if (self._tail or self._data is not None) else []
        return events


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send: base URL, endpoint kind, served model name, extra headers."""

    base_url: str  # no trailing slash
    model: str
    endpoint: str = "chat"  # "chat" → /v1/chat/completions, "completions" → /v1/completions
    ignore_eos: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    # "max-tokens": max_tokens = L (+ ignore_eos); "min-tokens": no max_tokens, min_tokens = L - 1
    # and a +100 logit_bias on eos_token_id, so EOS (counted as the L-th token) comes right after
    length_control: str = "max-tokens"
    eos_token_id: int | None = None

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url + path


# vLLM adds logit_bias to the logits; +100 makes EOS all but certain the moment min_tokens lifts
# its suppression, at any temperature.
EOS_LOGIT_BIAS = 100


def build_body(target: Target, spec: RequestSpec) -> bytes:
    """The JSON request body, streaming with usage. The output length is forced one of two ways:
    max-tokens sends max_tokens = L (and ignore_eos unless told not); min-tokens declares no
    max_tokens, as clients that leave it unset, and gets exactly L tokens from vLLM with
    min_tokens = L - 1 plus a strong logit_bias on EOS, which vLLM counts as the L-th token."""
    body: dict[str, Any] = {"model": target.model}
    if target.length_control == "min-tokens":
        if target.eos_token_id is None:
            raise ValueError("min-tokens length control needs the model's EOS token id")
        body["min_tokens"] = spec.output_tokens - 1
        body["logit_bias"] = {str(target.eos_token_id): EOS_LOGIT_BIAS}
    else:
        body["max_tokens"] = spec.output_tokens
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if target.ignore_eos and target.length_control != "min-tokens":
        body["ignore_eos"] = True
    return json.dumps(body, separators=(",", ":")).encode()


def parse_retry_after(value: str | None, default_s: float) -> float:
    """Retry-After as seconds (a number or an HTTP date); `default_s` when absent or unreadable."""
    if not value:
        return default_s
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default_s
    if when is None:
        return default_s
    import datetime as _dt

    now = _dt.datetime.now(when.tzinfo or _dt.UTC)
    return max(0.0, (when - now).total_seconds())


def _status_outcome(status: int) -> Outcome:
    if status == 429:
        return Outcome.HTTP_429
    if status == 503:
        return Outcome.HTTP_503
    return Outcome.HTTP_5XX if status >= 500 else Outcome.HTTP_4XX


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:200]
        return str(err)[:200]
    return str(payload)[:200]


async def send_request(
    session: Any,  # aiohttp.ClientSession
    target: Target,
    spec: RequestSpec,
    *,
    timeout_s: float,
    retry: RetryPolicy = NO_RETRY,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RequestResult:
    """Send one streamed request (retrying 429 if asked), record its timings and outcome.

    Never raises for a failed request: the failure is its outcome. `on_done` runs in `finally`,
    so an interrupted run still sees this request (outcome `cancelled`) before cancellation
    propagates.
    """
    import aiohttp

    body = build_body(target, spec)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **dict(target.headers)}
    clock = time.perf_counter
    result = RequestResult(spec.index, spec.route, spec.prompt_tokens, spec.output_tokens, clock())
    try:
        while True:
            result.attempts += 1
            retry_after = await _attempt(session, target.url, body, headers, result, timeout_s, clock, aiohttp)
            if retry_after is None or not retry.enabled or result.attempts > retry.max_retries:
                break
            wait_s = min(parse_retry_after(retry_after, retry.default_wait_s), retry.max_wait_s)
            result.retry_wait_s += wait_s
            await asyncio.sleep(wait_s)
    finally:
        if on_done is not None:
            on_done(result)
    return result


async def _attempt(session, url, body, headers, result: RequestResult, timeout_s, clock, aiohttp) -> str | None:
    """One HTTP attempt. Returns a Retry-After value ('' if none) when the answer is retryable."""
    # a fresh attempt starts clean; the timing origin stays the first send
    result.outcome, result.status, result.error = Outcome.CANCELLED, None, None
    result.ttft_ms = result.e2e_ms = result.finish_reason = None
    result.output_tokens = result.prompt_tokens = None
    result.itl_ms = []
    result.text_chunks = 0
    start = result.start_s
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=body, headers=headers) as resp:
                result.status = resp.status
                if resp.status != 200:
                    result.outcome = _status_outcome(resp.status)
                    raw = await resp.read()
                    try:
                        result.error = _error_text(_loads(raw))
                    except ValueError:
                        result.error = raw[:200].decode("utf-8", "replace")
                    if resp.status == 429:
                        return resp.headers.get("Retry-After", "")
                    if resp.status == 503 and "Retry-After" in resp.headers:
                        return resp.headers["Retry-After"]
                    return None
                await _read_stream(resp, result, start, clock)
    except TimeoutError:
        result.outcome, result.error = Outcome.TIMEOUT, f"no complete answer within {timeout_s:g} s"
    except aiohttp.ClientConnectorError as exc:
        result.outcome, result.error = Outcome.CONNECT, str(exc)[:200]
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
            aiohttp.ClientResponseError, ConnectionError) as exc:
        result.outcome, result.error = Outcome.DISCONNECT, f"{type(exc).__name__}: {exc}"[:200]
    except aiohttp.ClientError as exc:
        result.outcome, result.error = Outcome.DISCONNECT, f"{type(exc).__name__}: {exc}"[:200]
    return None


async def _read_stream(resp, result: RequestResult, start: float, clock) -> None:
    """Consume the SSE body, timing each chunk that carries text; settle the outcome."""
    decoder = SSEDecoder()
    last_token: float | None = None
    itl = result.itl_ms
    done = False
    async for chunk in resp.content.iter_any():
        now = clock()
        for data in decoder.feed(chunk):
            if data == b"[DONE]":
                done = True
                continue
            last_token = _on_event(data, result, start, now, last_token, itl)
            if result.outcome is Outcome.STREAM_ERROR:
                return
    now = clock()
    for data in decoder.close():
        if data == b"[DONE]":
            done = True
        else:
            last_token = _on_event(data, result, start, now, last_token, itl)
    if result.outcome is Outcome.STREAM_ERROR:
        return
    result.e2e_ms = (now - start) * 1000
    if done:
        result.outcome = Outcome.OK
    else:
        result.outcome, result.error = Outcome.DISCONNECT, "stream ended before [DONE]"


def _on_event(data: bytes, result: RequestResult, start: float, now: float,
              last_token: float | None, itl: list[float]) -> float | None:
    try:
        event = _loads(data)
    except ValueError:
        result.outcome, result.error = Outcome.STREAM_ERROR, f"unreadable event: {data[:80]!r}"
        return last_token
    if not isinstance(event, dict):
        return last_token
    if "error" in event or event.get("object") == "error":
        result.outcome, result.error = Outcome.STREAM_ERROR, _error_text(event)
        return last_token
    choices = event.get("choices")
    if choices:
        choice = choices[0]
        delta = choice.get("delta")
        text = (delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")) \
            if delta is not None else choice.get("text")
        if text:
            result.text_chunks += 1
            if last_token is None:
                result.ttft_ms = (now - start) * 1000
            else:
                itl.append((now - last_token) * 1000)
            last_token = now
        reason = choice.get("finish_reason")
        if reason is not None:
            result.finish_reason = reason
            if last_token is None:
                # every token so far decoded to no text (servers send no empty deltas): the
                # finishing chunk is the first sign of generated output
                result.ttft_ms = (now - start) * 1000
                last_token = now
    usage = event.get("usage")
    if usage:
        result.output_tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
    return last_token
