"""The one fake OpenAI/vLLM upstream of the suite: aiohttp on 127.0.0.1 port 0, reading the port
back. Every test that needs an engine-shaped server uses it, so two tests differ only in what
they steer, never in which fake they happen to meet.

    async with FakeVllm(...) as fake:   on the test's own event loop (in-loop async tests)
    with FakeVllm(...) as fake:         on a loop in a thread (sync tests, nginx, CLIs that run
                                        asyncio themselves)
    fake.url, fake.port                 once started; after the block the port refuses, and
                                        entering again serves on the same port (an engine
                                        restarted; what arrived and the tallies carry over)

Endpoints, shaped as vLLM 0.32 answers them:
  POST /tokenize {"prompt"} | {"messages"}      {"count", "max_model_len", "tokens"}
  POST /v1/messages/count_tokens                {"input_tokens"}
        counted by `tokens` (Tokens: one token per whitespace word of the messages, their
        documents and an Anthropic system, or of the prompt, plus fixed overheads); a
        Content-Type other than application/json is 400, as vLLM.
        `tokenize_status` (≠ 200: that status) and `tokenize_answer` (any JSON) inject answers;
        each call is recorded as a Call in `count_calls` (parsed bodies: `tokenize_calls`), the
        most at once (delay_s included) in `tokenize_peak`.
  POST `engine_paths` (vLLM's generating and pooling paths)   engine calls: each recorded as a
        Call (method, raw path and query, case-insensitive headers, raw body, parsed body) in
        `engine_calls`, with the views `seen` (parsed bodies), `raw`, `paths`, `headers`;
        answered as below.
  GET /v1/models                                {"data": [{"id": model, "max_model_len"}]}
  GET /metrics                                  vLLM's names for what it is serving and served
  GET /health                                   empty, `health_status` (200); recorded in
        `other` and counted in `health_calls`
  anything else                                 recorded in `other` and echoed: 207, b"echo",
        X-Upstream: yes, Keep-Alive (a hop-by-hop header to drop), Set-Cookie on /v1/login
  `routes` {path: (status, content type, body)} answers those paths verbatim (real captures);
  with `routes_only` every other path is 404 (a server that is not vLLM, or lacks an endpoint);
  `missing` paths answer 404 before anything else; all three recorded in `other` and changeable
  while it runs. `delay_s` holds every answer back. A body it cannot read is 400, never 500.
  release()/hold() are thread-safe; every other knob is a plain attribute a test may set.

An engine call does what body["x_mode"] says, else the next entry of `script`, else "ok":
  "ok"               answers: a pooling path an embedding and usage; a generation one JSON
                     answer (the tokens' text, `finish_reason`, usage), or when body["stream"] an
                     SSE stream: for chat first ROLE_EVENT, then one event per token (" w0",
                     " w1", …), the last with `finish_reason`, a usage event (unless `no_usage`),
                     then DONE_EVENT
  "429", "500", …    that status, {"error": {"message": "status N"}}; 429 with `retry_after`;
                     `engine_status` (e.g. 500), while set, answers every engine call so, before
                     anything else, while /health still answers `health_status` (a broken replica)
  "hold"             nothing until release() (hold() re-arms it); never released, a hang
  "hold_stream"      the stream's first event, then waits for release()
                     (body["x_hold_after"] = k: the first k token events, then waits)
  "die"              closes the connection half-way through the tokens
  "error_mid_stream" an error event half-way through the tokens, then ends
Tokens answered: body["x_chunks"], else the request's cap (max_tokens, max_completion_tokens,
max_output_tokens), else min_tokens + 1 under a logit_bias (vLLM counts the biased-in EOS), else
16; less `short_by`. Each token after body["x_delay"] s, else `ttft_s` then `itl_s`. Stream shapes:
`split_lines` (each event in two writes), `batch_events` (all in one write), `silent_tokens` (as
vLLM for tokens that decode to nothing: only the finishing event).

Tallies: `active`/`peak_active` engine calls, `cancelled` (cut by the client), `running_blocks`/
`peak_running_blocks` (what the running calls' KV could grow to: sequences ×
ceil((prompt + cap) / block_size)), `generation_tokens`, `preemptions` (+ `preempt_per_request`
per call), `last_chunk_sent_at[str(x_id)]` (monotonic time of the last token).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

# vLLM 0.32's generating and pooling endpoints (vllm/entrypoints/, router by router).
GENERATE_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/invocations",
    "/inference/v1/generate", "/v1/chat/completions/batch",
})
POOL_PATHS = frozenset({
    "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
    "/v2/rerank", "/v2/embed",
})
ENGINE_PATHS = GENERATE_PATHS | POOL_PATHS
COUNT_PATHS = frozenset({"/tokenize", "/v1/messages/count_tokens"})
ROLE_EVENT = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Tokens:
    """How the fake's tokenizer counts: one token per whitespace word of text, plus `prompt` for a
    raw prompt (a BOS), `chat` once per chat and `per_message` for each message (template
    tokens). Tokens() is the plain word count the enforcer tests reason in."""

    prompt: int = 0
    chat: int = 0
    per_message: int = 0


# vLLM's chat template and BOS as the bench tests reason in: <s> + 2 per message + the reply prompt.
TEMPLATED = Tokens(prompt=1, chat=2, per_message=2)


@dataclass(frozen=True)
class Call:
    """One request as it reached the fake."""

    method: str
    path: str  # raw path and query, as sent
    headers: CIMultiDict
    body: bytes
    parsed: Any = None  # the JSON body, or None when it was not JSON


def _words(value: Any) -> int:
    """Whitespace words in text, or in the text parts of a content list; 0 for anything else."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(len(p["text"].split()) for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _count(value: Any) -> int | None:
    """A request's integer field, or None (absent, bool, negative or not an integer)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeVllm:
    """aiohttp playing vLLM on loopback (see the module docstring)."""

    def __init__(self, *, tokens: Tokens = Tokens(), model: str = "fake", max_model_len: int = 4096,
                 block_size: int = 16, num_blocks: int = 100, engine_paths: Iterable[str] = ENGINE_PATHS,
                 routes: Mapping[str, tuple[int, str, bytes]] | None = None, routes_only: bool = False,
                 missing: Iterable[str] = (),
                 delay_s: float = 0.0, script: Iterable[str] = (), retry_after: str | None = "0",
                 ttft_s: float = 0.0, itl_s: float = 0.0, finish_reason: str = "length", short_by: int = 0,
                 no_usage: bool = False, split_lines: bool = False, batch_events: bool = False,
                 silent_tokens: bool = False, preempt_per_request: int = 0, host: str = "127.0.0.1") -> None:
        self.tokens, self.model, self.max_model_len = tokens, model, max_model_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.engine_paths = frozenset(engine_paths)
        self.routes = dict(routes or {})
        self.routes_only = routes_only
        self.missing = set(missing)
        self.delay_s = delay_s
        self.script = deque(script)
        self.retry_after = retry_after
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.finish_reason, self.short_by, self.no_usage = finish_reason, short_by, no_usage
        self.split_lines, self.batch_events, self.silent_tokens = split_lines, batch_events, silent_tokens
        self.preempt_per_request = preempt_per_request
        self.host = host
        self.tokenize_status = 200
        self.health_status = 200
        self.health_calls = 0
        self.engine_status: int | None = None
        self.tokenize_answer: Any = None
        # what arrived
        self.engine_calls: list[Call] = []
        self.other: list[Call] = []
        self.count_calls: list[Call] = []
        # tallies
        self.active = self.peak_active = self.cancelled = 0
        self.running_blocks = self.peak_running_blocks = 0
        self.tokenize_active = self.tokenize_peak = 0
        self.generation_tokens = self.preemptions = 0
        self.last_chunk_sent_at: dict[str, float] = {}
        self.port = 0
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._release: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # --- views of what arrived ---------------------------------------------------------------

    @property
    def tokenize_calls(self) -> list[Any]:
        return [c.parsed for c in self.count_calls]

    @property
    def seen(self) -> list[Any]:
        return [c.parsed for c in self.engine_calls]

    @property
    def raw(self) -> list[bytes]:
        return [c.body for c in self.engine_calls]

    @property
    def paths(self) -> list[str]:
        return [c.path for c in self.engine_calls]

    @property
    def headers(self) -> list[CIMultiDict]:
        return [c.headers for c in self.engine_calls]

    def reached(self) -> list[str]:
        """Every path that reached the fake, engine calls and others (counting calls aside)."""
        return [*self.paths, *(c.path for c in self.other)]

    # --- steering ------------------------------------------------------------------------------

    def release(self) -> None:
        """Let every held call go on (thread-safe)."""
        assert self._loop is not None and self._release is not None, "not started"
        self._loop.call_soon_threadsafe(self._release.set)

    def hold(self) -> None:
        """Hold the next "hold" calls again until the next release() (thread-safe)."""
        assert self._loop is not None and self._release is not None, "not started"
        self._loop.call_soon_threadsafe(self._release.clear)

    @property
    def released(self) -> bool:
        return self._release is not None and self._release.is_set()

    # --- counting ------------------------------------------------------------------------------

    def prompt_tokens(self, body: Any) -> int:
        """The fake tokenizer's count of a request's prompt (chat, Anthropic, raw or responses)."""
        if not isinstance(body, dict):
            return 0
        t = self.tokens
        messages = body.get("messages")
        if isinstance(messages, list):
            n = t.chat + sum(t.per_message + _words(m.get("content")) for m in messages if isinstance(m, dict))
            kwargs = body.get("chat_template_kwargs")
            documents = kwargs.get("documents") if isinstance(kwargs, dict) else None
            if isinstance(documents, list):
                n += sum(_words(d.get("text")) for d in documents if isinstance(d, dict))
            return n + _words(body.get("system"))
        if isinstance(body.get("prompt"), str):
            return t.prompt + _words(body["prompt"])
        return _words(body.get("input")) + _words(body.get("instructions"))

    def _output_tokens(self, body: dict) -> int:
        n = _count(body.get("x_chunks"))
        if n is None:
            n = next((c for key in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                      if (c := _count(body.get(key))) is not None), None)
        if n is None:
            n = (_count(body.get("min_tokens")) or 0) + 1 if body.get("logit_bias") else 16
        return max(0, min(n, self.max_model_len) - self.short_by)

    def _blocks(self, body: dict) -> int:
        cap = next((c for key in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                    if (c := _count(body.get(key))) is not None), 0)
        sequences = max(_count(body.get("n")) or 1, _count(body.get("best_of")) or 1)
        return sequences * -(-(self.prompt_tokens(body) + cap) // self.block_size)

    # --- the server ----------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        """A body the real server cannot validate is its 400, never its 500."""
        path = request.path
        counting = request.method == "POST" and path in COUNT_PATHS
        if counting:
            self.tokenize_active += 1
            self.tokenize_peak = max(self.tokenize_peak, self.tokenize_active)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if path in self.routes and path not in self.missing:
                return await self._route(request)
            if path in self.missing or self.routes_only:
                await self._record_other(request)
                return web.Response(status=404, text="Not Found")
            if counting:
                return await self._tokenize(request)
            if request.method == "POST" and path in self.engine_paths:
                return await self._engine(request)
            if request.method == "GET" and path == "/v1/models":
                await self._record_other(request)
                return web.json_response({"object": "list", "data": [
                    {"id": self.model, "object": "model", "max_model_len": self.max_model_len}]})
            if request.method == "GET" and path == "/health":
                await self._record_other(request)
                self.health_calls += 1
                return web.Response(status=self.health_status)
            if request.method == "GET" and path == "/metrics":
                await self._record_other(request)
                return web.Response(text=self.metrics_text(), content_type="text/plain")
            return await self._echo(request)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return web.json_response({"error": {"message": "invalid request"}}, status=400)
        finally:
            if counting:
                self.tokenize_active -= 1

    async def _record_other(self, request: web.Request) -> Call:
        call = Call(request.method, request.raw_path, CIMultiDict(request.headers), await request.read())
        self.other.append(call)
        return call

    async def _route(self, request: web.Request) -> web.Response:
        await self._record_other(request)
        status, content_type, body = self.routes[request.path]
        return web.Response(status=status, body=body, headers={"Content-Type": content_type})

    async def _echo(self, request: web.Request) -> web.Response:
        await self._record_other(request)
        headers = {"X-Upstream": "yes", "Keep-Alive": "timeout=5"}
        if request.path == "/v1/login":
            headers["Set-Cookie"] = "sid=secret; Path=/"
        return web.Response(status=207, body=b"echo", headers=headers)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokenize_status != 200:
            answer = self.tokenize_answer if self.tokenize_answer is not None else {"error": {"message": "down"}}
            return web.json_response(answer, status=self.tokenize_status)
        if request.content_type != "application/json":  # as vLLM: 400 Unsupported Media Type
            return web.json_response({"error": {"message": "Only 'application/json' is allowed"}}, status=400)
        raw = await request.read()
        body = json.loads(raw)
        self.count_calls.append(Call(request.method, request.raw_path, CIMultiDict(request.headers), raw, body))
        if self.tokenize_answer is not None:
            return web.json_response(self.tokenize_answer)
        n = self.prompt_tokens(body)
        if request.path == "/v1/messages/count_tokens":
            return web.json_response({"input_tokens": n})
        return web.json_response({"count": n, "max_model_len": self.max_model_len, "tokens": [5] * n})

    async def _engine(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.engine_calls.append(Call(request.method, request.raw_path, CIMultiDict(request.headers), raw, body))
        if not isinstance(body, dict):
            raise TypeError("not a JSON object")
        mode = body.get("x_mode")
        action = mode if isinstance(mode, str) else self.script.popleft() if self.script else "ok"
        if self.engine_status is not None:
            action = str(self.engine_status)
        blocks = self._blocks(body)
        self.preemptions += self.preempt_per_request
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        self.running_blocks += blocks
        self.peak_running_blocks = max(self.peak_running_blocks, self.running_blocks)
        try:
            if action.isdigit():
                headers = {"Retry-After": self.retry_after} if action == "429" and self.retry_after is not None else {}
                return web.json_response({"error": {"message": f"status {action}"}}, status=int(action),
                                         headers=headers)
            if action == "hold":
                await self._release.wait()
            if request.path in POOL_PATHS:
                n = self.prompt_tokens(body)
                return web.json_response({"object": "list", "data": [{"index": 0, "embedding": [0.0]}],
                                          "usage": {"prompt_tokens": n, "total_tokens": n}})
            if body.get("stream"):
                return await self._stream(request, body, action)
            return self._whole(body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
            self.running_blocks -= blocks

    def _usage(self, body: dict, n: int) -> dict:
        prompt = self.prompt_tokens(body)
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    def _whole(self, body: dict) -> web.Response:
        n = self._output_tokens(body)
        text = "" if self.silent_tokens else "".join(f" w{i}" for i in range(n))
        if isinstance(body.get("messages"), list):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        self.generation_tokens += n
        return web.json_response({"choices": [{**choice, "finish_reason": self.finish_reason}],
                                  "usage": self._usage(body, n)})

    async def _stream(self, request: web.Request, body: dict, action: str) -> web.StreamResponse:
        chat = isinstance(body.get("messages"), list)
        n = self._output_tokens(body)
        delay = body.get("x_delay")
        ttft, itl = (float(delay), float(delay)) if delay is not None else (self.ttft_s, self.itl_s)
        events = []
        for i in range(n):
            if self.silent_tokens and i < n - 1:
                continue
            text = "" if self.silent_tokens else f" w{i}"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = self.finish_reason if i == n - 1 else None
            events.append(_event({"choices": [choice]}))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        hold_after_first = action == "hold_stream" and body.get("x_hold_after") is None
        hold_after = _count(body.get("x_hold_after")) if action == "hold_stream" else None

        async def write(data: bytes, split: bool = False) -> None:
            nonlocal hold_after_first
            if split:
                await resp.write(data[: len(data) // 2])
                await asyncio.sleep(0.001)
                await resp.write(data[len(data) // 2:])
            else:
                await resp.write(data)
            if hold_after_first:  # the first event is out: wait for release()
                hold_after_first = False
                await self._release.wait()

        if chat:
            await write(ROLE_EVENT)
        if self.batch_events:
            await asyncio.sleep(ttft)
            await write(b"".join(events))
            self.generation_tokens += n
        else:
            for i, event in enumerate(events):
                await asyncio.sleep(ttft if i == 0 else itl)
                if action == "die" and i == n // 2:
                    request.transport.close()
                    return resp
                if action == "error_mid_stream" and i == n // 2:
                    await resp.write(_event({"error": {"message": "engine died", "code": 500}}))
                    return resp
                await write(event, split=self.split_lines)
                self.generation_tokens += 1
                if hold_after is not None and i + 1 == hold_after:
                    await self._release.wait()
        self.last_chunk_sent_at[str(body.get("x_id"))] = time.monotonic()
        tail = b"" if self.no_usage else _event({"choices": [], "usage": self._usage(body, n)})
        await resp.write(tail + DONE_EVENT)
        await resp.write_eof()
        return resp

    def metrics_text(self) -> str:
        """/metrics with vLLM's names: running calls, KV usage by them, preemptions, tokens, cache."""
        usage = min(1.0, self.active * 4 / self.num_blocks)
        labels = f'engine="0",model_name="{self.model}"'
        return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{labels}}} {float(self.active)}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{labels}}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{labels}}} {usage}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{labels}}} {float(self.preemptions)}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",engine="0",num_gpu_blocks="{self.num_blocks}"}} 1.0
"""

    # --- running it ----------------------------------------------------------------------------

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._release = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # handler_cancellation as aiohttp's TestServer: a client that goes away cancels its call
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()  # 0 the first time
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

    async def _stop(self) -> None:
        if self._release is not None:
            self._release.set()  # held calls end instead of waiting out the shutdown timeout
        if self._runner is not None:
            server = self._runner.server
            await self._runner.cleanup()
            self._runner = None
            if server is not None:  # connections accepted as the socket closed, under load: on a
                # loaded host one can register after a first shutdown, so until none is left
                for _ in range(20):
                    await asyncio.sleep(0.05)
                    await server.shutdown(0.1)
                    if not server.connections:
                        break

    async def _stop_own_loop(self) -> None:
        """Stop, then cancel and await what is still pending on the fake's own loop (an accept half
        done as it closed), so that no socket outlives the loop to be found unclosed later."""
        await self._stop()
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=1.0)

    async def __aenter__(self) -> FakeVllm:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    def __enter__(self) -> FakeVllm:
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), loop).result(10)
        except BaseException:
            self._close_thread(loop)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        try:
            asyncio.run_coroutine_threadsafe(self._stop_own_loop(), loop).result(15)
        finally:
            self._close_thread(loop)

    def _close_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the fake's loop did not stop"
        loop.close()
