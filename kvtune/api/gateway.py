"""The door to `kvtune gateway`: gateway.yaml read strictly, with the command line's overrides."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kvtune.endpoint import host_problem, url_problem
from kvtune.errors import InputError
from kvtune.gateway.config import GatewayConfig, load_gateway_config


def gateway_config(path: str | Path, *, upstream: str | None = None, host: str | None = None,
                   port: int | None = None) -> GatewayConfig:
    """gateway.yaml read strictly, with the address to listen on and (for one upstream) its URL
    overridden: the config `kvtune gateway` serves (kvtune.gateway.proxy.serve runs it).

    >>> config = kvtune.gateway_config("deploy/gateway.yaml", port=8080)   # doctest: +SKIP
    >>> config.block_budget, config.port                                  # doctest: +SKIP
    (25884, 8080)
    """
    config = load_gateway_config(path)
    for field, problem in (("upstream", upstream is not None and url_problem(upstream)),
                           ("host", host is not None and host_problem(host))):
        if problem:
            raise InputError(problem, field=field)
    upstreams = config.upstreams
    if upstream is not None:
        if len(upstreams) > 1:
            raise InputError(f"{os.fspath(path)} names {len(upstreams)} upstreams, each with its own budget: "
                             "edit its upstreams: instead", field="upstream")
        upstreams = (dataclasses.replace(upstreams[0], url=upstream),)
    return dataclasses.replace(config, upstreams=upstreams, host=host or config.host,
                               port=config.port if port is None else port)
