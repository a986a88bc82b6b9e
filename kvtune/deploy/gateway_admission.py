"""The admission a deployed gateway.yaml runs, in simulated time: `kvtune simulate --gateway`
reads the file with the gateway's own reader (kvtune.gateway.config) and hands its budget, queue,
policy and routes to the simulator's LedgerAdmission, which knows nothing of gateway.yaml.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtune.domain.route import Route
from kvtune.gateway.config import GatewayConfig
from kvtune.gateway.flow import band_of
from kvtune.sim.admission import LedgerAdmission

__all__ = ["gateway_admission"]


def gateway_admission(config: GatewayConfig, route: Route | None,
                      request_routes: Sequence[Route | None] | None = None) -> LedgerAdmission:
    """The admission `config` deploys, for requests that match `route` (or request i
    `request_routes[i]`)."""
    # one engine: the first upstream's budget (each upstream of several has its own)
    flow = config.flow
    bands = None
    if flow is not None and request_routes is not None:
        bands = [band_of(flow, None, None if r is None else r.band) for r in request_routes]
    return LedgerAdmission(
        config.upstreams[0].block_budget, block_size=config.block_size, max_model_len=config.max_model_len,
        retry_after_min_s=config.retry_after_min_s, retry_after_max_s=config.retry_after_max_s,
        queue_max_waiting=config.queue_max_waiting, queue_timeout_s=config.queue_timeout_s,
        route_max_new_tokens=None if route is None else route.max_new_tokens,
        policy=config.admission, output_law=None if route is None else route.output_law,
        request_laws=None if request_routes is None else [None if r is None else r.output_law for r in request_routes],
        request_caps=None if request_routes is None
        else [None if r is None else r.max_new_tokens for r in request_routes],
        flow=flow, band=0 if flow is None else band_of(flow, None, None if route is None else route.band),
        request_bands=bands)
