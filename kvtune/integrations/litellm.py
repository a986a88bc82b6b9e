"""kvtune's admission inside a LiteLLM proxy: a `CustomLogger` that enforces gateway.yaml.

In LiteLLM's config.yaml (`recommend --out` writes one, litellm-config.yaml):

    litellm_settings:
      callbacks: kvtune.integrations.litellm.proxy_handler

with KVTUNE_GATEWAY_CONFIG naming the gateway.yaml kvtune's own gateway reads. Every request runs
kvtune's admission (kvtune.gateway.admission: the same reader, routes, cap, count, ledger and gate)
on the body LiteLLM will forward (kvtune.integrations.litellm_forward), in LiteLLM's hooks:

  async_pre_call_hook        read, route, clamp, count, reserve; the admitted body (caps written)
                             goes back into the request; a refusal is LiteLLM's ProxyException with
                             the gateway's status, message and Retry-After, which LiteLLM answers as is
  async_pre_call_deployment_hook   after LiteLLM merged the deployment's litellm_params: the
                             admitted members written again, so a deployment default cannot
                             raise a cap; with several engines in gateway.yaml, api_base set to
                             the one the blocks are held on (LiteLLM's own pick would not be)
  the release, exactly once per request: a whole answer's success hook, the failure hook, a
  stream's iterator `finally` (its end, a cut upstream, a client that left: Starlette cancels the
  stream). LiteLLM takes litellm_call_id from the client's x-litellm-call-id header, so a hold is
  keyed by it but released only by the request record that carries its hold token (written in the
  call's metadata), and a second call under the id of one in flight is refused

Routes match as in the gateway (path, the client's model name, headers); a route header named
`x-litellm-team` matches the team of the caller's LiteLLM key (team_alias, else team_id), never a
header the client sends. The same metric names as the gateway's, and its /kvtune/ledger, are
served on gateway.yaml's listen address: LiteLLM's own /metrics belongs to its `prometheus`
callback (configured separately, its names its own), not to kvtune.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import ProxyException
from prometheus_client import Gauge

from kvtune.domain.route import Route
from kvtune.gateway.admin import Admin
from kvtune.gateway.admission import Admission
from kvtune.gateway.config import CountingMethod, GatewayConfig, load_gateway_config
from kvtune.gateway.counting import LocalTokenizerCounter, PromptCounter, make_counter
from kvtune.gateway.endpoints import Endpoint, PathClass, classify
from kvtune.gateway.flow import FlowGate, flow_of
from kvtune.gateway.intake import Incoming
from kvtune.gateway.ledger import Reservation
from kvtune.gateway.metrics import GatewayMetrics
from kvtune.gateway.pool import UpstreamPool
from kvtune.gateway.refusals import ErrorType, Reason, RefusalLog, Refused, Rejection
from kvtune.gateway.relay import events_seen_tokens
from kvtune.gateway.shared import SharedLedger
from kvtune.gateway.upstream import UpstreamClient
from kvtune.integrations.litellm_forward import apply, forwarded_body

log = logging.getLogger("kvtune.gateway")

#: The environment variable naming the gateway.yaml the proxy's hook enforces.
CONFIG_ENV = "KVTUNE_GATEWAY_CONFIG"
#: A route header matched on the LiteLLM key's team, never on a header the client sends.
TEAM_HEADER = "x-litellm-team"
#: LiteLLM's call types, by the engine path kvtune reads them as; any other is refused (501).
CALL_PATHS = {
    "acompletion": "/v1/chat/completions", "completion": "/v1/chat/completions",
    "atext_completion": "/v1/completions", "text_completion": "/v1/completions",
    "aembedding": "/v1/embeddings", "embeddings": "/v1/embeddings",
}
#: Where the admitted cap is noted in the call's metadata (LiteLLM's own, never forwarded), for
#: the X-Kvtune-Max-Tokens answer header: the call is released before its headers are written.
CAP_METADATA = "kvtune_max_tokens"
#: Where the call's hold token is noted in its metadata (see KvtuneAdmission.release).
HOLD_METADATA = "kvtune_hold"
#: Idle connections to the engine (the prompt counts) close before vLLM's 5 s keep-alive.
UPSTREAM_KEEPALIVE_S = 4.0


@dataclass(frozen=True, slots=True)
class Held:
    """An admitted call: its reservation, the body it was admitted with, and its route."""

    reservation: Reservation
    body: dict[str, Any]
    cap: int | None
    route: str
    upstream: str  # the engine its blocks are held on
    token: str  # written in the call's metadata: only its own request record releases it


class KvtuneAdmission(CustomLogger):
    """kvtune's admission for one gateway.yaml inside a LiteLLM proxy (see the module docstring)."""

    def __init__(self, config: GatewayConfig, *, counter: PromptCounter | None = None) -> None:
        super().__init__()
        self.config = config
        self.pool = UpstreamPool(config)
        self.admission = Admission(config, self.pool, GatewayMetrics(self.pool, lambda: self.admission.waiting))
        self.metrics = self.admission.metrics
        self.shared = SharedLedger(config, self.pool) if config.ledger.shared else None
        self.admission.shared = self.shared
        self.metrics.add_ledger_gauges(self.shared)
        # gateway.yaml `flow:`: the flow-control queue (bands, fair shares) in place of the FIFO
        gate = self.admission.queue.gate
        self.flow_gate = gate if isinstance(gate, FlowGate) else None
        if self.flow_gate is not None:
            self.metrics.add_flow(self.flow_gate)
        self.reserved_peak = 0
        Gauge("kvtune_gateway_reserved_blocks_peak", "The most KV blocks reserved at once since the hook started.",
              registry=self.metrics.registry).set_function(lambda: self.reserved_peak)
        self.rejected = 0
        self.refusals = RefusalLog()
        self.admin = Admin(config, self.pool, self.metrics, rejected=lambda: self.rejected,
                           waiting=lambda: self.admission.waiting, shared=self.shared, flow=self.flow_gate)
        self._fixed_counter = counter
        self._local: LocalTokenizerCounter | None = None
        tokenizer = config.prompt_tokens.tokenizer
        if counter is None and config.prompt_tokens.method is CountingMethod.TOKENIZER and tokenizer is not None:
            self._local = LocalTokenizerCounter.load(tokenizer)  # a bad tokenizer fails at start
        self._held: dict[str, Held] = {}  # by litellm_call_id
        self._admitting: set[str] = set()  # call ids being counted or queued now
        # LiteLLM's own api_base is left alone only when gateway.yaml names that one engine alone
        self._pinned = len(self.pool.replicas) > 1 or any(r.upstream for r in config.routes)
        self._clients: list[UpstreamClient] = []
        self._runner: web.AppRunner | None = None
        self._started: asyncio.Task[None] | None = None
        self.address: str | None = None

    # ---------------------------------------------------------------- lifecycle

    def start_soon(self) -> None:
        """Start on the running loop when there is one (the proxy's startup loads callbacks on
        it), else at the first request."""
        with suppress(RuntimeError):
            self._started = asyncio.get_running_loop().create_task(self._start())

    async def _ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        """The engine clients and prompt counters, the shared ledger, and the admin endpoints on
        gateway.yaml's listen address (port 0: an ephemeral one, logged)."""
        cfg = self.config
        counters: dict[str, PromptCounter] = {}
        for url in {*(u.url for u in cfg.upstreams), *(r.upstream for r in cfg.routes if r.upstream)}:
            client = UpstreamClient(url, connect_timeout_s=cfg.upstream_connect_timeout_s,
                                    read_timeout_s=cfg.upstream_read_timeout_s, keepalive_s=UPSTREAM_KEEPALIVE_S)
            self._clients.append(client)
            counters[url] = self._fixed_counter or make_counter(cfg.prompt_tokens, client=client, local=self._local)
        self.admission.counters = counters
        if self.shared is not None:
            await self.shared.start()
        app = web.Application()
        self.admin.add_routes(app.router)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await site.start()
        self.address = ", ".join(f"http://{host}:{port}" for host, port, *_ in self._runner.addresses)
        log.warning("kvtune admission: gateway.yaml's ledger and metrics on %s", self.address)

    async def close(self) -> None:
        """Stop the admin endpoints and the engine clients; the shared ledger gives back what is held."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for client in self._clients:
            await client.close()
        self._clients.clear()
        if self.shared is not None:
            await self.shared.close()

    # ---------------------------------------------------------------- admission

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict, call_type: Any) -> dict:
        """Admit the call or raise its refusal; the admitted body (caps written) replaces the
        members LiteLLM forwards."""
        await self._ensure_started()
        call_id = str(data.get("litellm_call_id"))
        metadata = data.get("metadata")
        try:
            if call_id in self._held or call_id in self._admitting:
                # LiteLLM takes the call id from the client's x-litellm-call-id header: a second call
                # under the id of one in flight must neither replace nor release that one's hold
                raise Rejection(400, Reason.INVALID_REQUEST, "x-litellm-call-id names a call already in flight")
            path = CALL_PATHS.get(str(call_type))
            if path is None:
                raise Rejection(501, Reason.UNCOUNTABLE_ENDPOINT, f"LiteLLM's {call_type} calls are not served "
                                "through kvtune's admission: their prompt cannot be counted")
            if not isinstance(metadata, dict):  # the proxy gives every governed call one
                raise Rejection(400, Reason.INVALID_REQUEST, "metadata must be an object")
            body = forwarded_body(data)
            try:
                raw = orjson.dumps(body)
            except TypeError as exc:
                raise Rejection(400, Reason.INVALID_BODY, f"the request cannot be forwarded as JSON ({exc})") from None
            incoming = self.incoming(path, data, user_api_key_dict)
            self._admitting.add(call_id)
            try:
                admitted = await self.admission.admit(incoming, raw)
            finally:
                self._admitting.discard(call_id)
        except Rejection as rejection:
            raise self._refuse(None, rejection) from None
        except Refused as refused:
            raise self._refuse(refused.route, refused.rejection) from None
        route = admitted.route.name if admitted.route else ""
        doc = orjson.loads(admitted.body)
        upstream = admitted.upstream or self.pool.replica_of(admitted.reservation).url
        token = secrets.token_hex(16)
        self._held[call_id] = Held(admitted.reservation, doc, admitted.cap, route, upstream, token)
        self.reserved_peak = max(self.reserved_peak, self.pool.reserved_blocks)
        self.metrics.count_admitted(route, admitted.blocks)
        apply(data, doc)
        metadata[HOLD_METADATA] = token  # the call's own record (never forwarded): what proves a release is its own
        metadata.pop(CAP_METADATA, None)  # what a client sent there is no cap of kvtune's
        if admitted.cap is not None:
            metadata[CAP_METADATA] = admitted.cap
        return data

    def incoming(self, path: str, data: Mapping[str, Any], key: Any) -> Incoming:
        """The call as kvtune's intake would see it: its path's class and the route headers."""
        cfg = self.config
        first = cfg.route_paths().get(path)
        endpoint = Endpoint(PathClass.GENERATE, first.api) if first is not None else classify(path, cfg.passthrough)
        groups: dict[str, str] = {}
        request = data.get("proxy_server_request")
        headers = request.get("headers") if isinstance(request, Mapping) else None
        sent = {str(k).lower(): str(v) for k, v in headers.items()} if isinstance(headers, Mapping) else {}
        for name in cfg.route_headers:
            if name.lower() == TEAM_HEADER:
                team = getattr(key, "team_alias", None) or getattr(key, "team_id", None)
                value = team if isinstance(team, str) else None
            else:
                value = sent.get(name.lower())
            if value:
                groups[name] = value
        route = cfg.path_route(path, groups) if first is not None else None
        flow = cfg.flow
        if flow is None:
            return Incoming(path, endpoint, route, path, None, groups)
        # flow control: the band header's value, and the flow (its header, else the key's hash)
        return Incoming(path, endpoint, route, path, None, groups, sent.get(flow.band_header.lower()),
                        flow_of(sent.get(flow.flow_header.lower()), sent.get("authorization")))

    def _refuse(self, route: Route | None, rejection: Rejection) -> ProxyException:
        """The gateway's refusal as LiteLLM answers it: the status, the message a client without
        ledger access sees, Retry-After and Allow. LiteLLM's own ProxyException, not FastAPI's
        HTTPException: its /v1/completions wraps any other exception anew and drops its headers
        (Retry-After with them), while every endpoint passes a ProxyException through whole."""
        self.rejected += 1
        name = route.name if route else ""
        self.metrics.count_rejected(name, rejection.reason)
        for line in self.refusals.record(name, rejection, time.monotonic()):
            log.warning("%s", line)
        headers = {}
        if rejection.retry_after_s is not None:
            headers["Retry-After"] = str(rejection.retry_after_s)
        if rejection.allow is not None:
            headers["Allow"] = rejection.allow
        headers["X-Kvtune-Refused"] = rejection.code
        return ProxyException(rejection.message_for(False), ErrorType.of(rejection.status).value, None,
                              code=rejection.status, headers=headers, openai_code=rejection.code)

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> dict[str, Any]:
        """After LiteLLM merged the deployment's litellm_params into the call: the admitted
        members again, so what is forwarded is what was counted (a deployment's max_tokens or
        extra_body cannot raise the cap). With several engines in gateway.yaml (or a route's own),
        the call goes to the one its blocks are held on, whichever deployment LiteLLM picked."""
        held = self._held.get(str(kwargs.get("litellm_call_id")))
        if held is not None:
            apply(kwargs, held.body)
            if self._pinned:
                kwargs["api_base"] = f"{held.upstream.rstrip('/')}/v1"
        return kwargs

    async def async_post_call_response_headers_hook(self, data: dict, user_api_key_dict: Any, response: Any,
                                                    request_headers: dict[str, str] | None = None,
                                                    litellm_call_info: dict[str, Any] | None = None
                                                    ) -> dict[str, str] | None:
        """X-Kvtune-Max-Tokens: the cap the call was admitted with, as the gateway answers it."""
        metadata = data.get("metadata")
        cap = metadata.get(CAP_METADATA) if isinstance(metadata, dict) else None
        return {"X-Kvtune-Max-Tokens": str(cap)} if isinstance(cap, int) else None

    # ---------------------------------------------------------------- release, exactly once

    def release(self, data: Any) -> bool:
        """Give back the blocks of the call `data` is the request record of (its litellm_call_id and
        the hold token admission wrote in its metadata); True the first time, False for a call not
        held (refused, already released, or another call under the same id)."""
        held = self._own_hold(data)
        if held is None:
            return False
        del self._held[str(data.get("litellm_call_id"))]
        self.admission.release(held.reservation)
        return True

    def _own_hold(self, data: Any) -> Held | None:
        """The hold of the call `data` is the request record of: its litellm_call_id, proven by the
        hold token admission wrote in its metadata (a client chooses the id, never the token)."""
        if not isinstance(data, Mapping):
            return None
        metadata = data.get("metadata")
        token = metadata.get(HOLD_METADATA) if isinstance(metadata, Mapping) else None
        held = self._held.get(str(data.get("litellm_call_id")))
        if held is None or token is None or not secrets.compare_digest(str(token), held.token):
            return None
        return held

    @property
    def held(self) -> int:
        """Calls admitted and not yet released."""
        return len(self._held)

    async def async_post_call_success_hook(self, data: dict, user_api_key_dict: Any, response: Any) -> Any:
        if not data.get("stream"):  # a stream is released when it ends (the iterator hook)
            self.release(data)
        return None

    async def async_post_call_failure_hook(self, request_data: dict, original_exception: Exception,
                                           user_api_key_dict: Any, traceback_str: str | None = None) -> Any:
        self.release(request_data)
        return None

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict) -> AsyncGenerator[Any, None]:
        """The stream as LiteLLM sends it; its blocks go back when it ends however it ends (done,
        cut by the engine, or cancelled by a client that left). Each chunk is told to the
        reservation as the gateway's relay tells each event (kvtune.gateway.relay.events_seen_tokens:
        at least one token a chunk but the first), so the statistical ledger and the flow-control
        forecast condition on a LiteLLM stream's progress as on the gateway's own."""
        held = self._own_hold(request_data)
        progress = self.admission.progress_of(held.reservation) if held is not None else None
        chunks = 0
        try:
            async for chunk in response:
                if progress is not None:
                    chunks += 1
                    progress(events_seen_tokens(chunks))
                yield chunk
        finally:
            self.release(request_data)


def from_env() -> KvtuneAdmission:
    """The hook for the gateway.yaml that KVTUNE_GATEWAY_CONFIG names."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise RuntimeError(f"{CONFIG_ENV} must name the gateway.yaml kvtune's LiteLLM hook enforces")
    hook = KvtuneAdmission(load_gateway_config(path))
    hook.start_soon()
    return hook


_instance: KvtuneAdmission | None = None


def __getattr__(name: str) -> Any:
    """`proxy_handler`, what LiteLLM's config names: built from the environment when first asked."""
    global _instance
    if name != "proxy_handler":
        raise AttributeError(name)
    if _instance is None:
        _instance = from_env()
    return _instance


__all__ = ["CALL_PATHS", "CONFIG_ENV", "TEAM_HEADER", "Held", "KvtuneAdmission", "from_env"]
