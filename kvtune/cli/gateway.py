"""`kvtune gateway --config gateway.yaml`: run the admission gateway in front of vLLM."""

from __future__ import annotations

import asyncio
import signal

import click

from kvtune import api
from kvtune.errors import InputError


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(), metavar="FILE",
              help="gateway.yaml, as rendered by `kvtune recommend`.")
@click.option("--upstream", default=None, help="Upstream base URL (overrides the file), e.g. http://127.0.0.1:8000.")
@click.option("--host", default=None, help="Address to listen on (overrides listen.host).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=None,
              help="Port to listen on (overrides listen.port; 0 picks a free one).")
def gateway(config_path: str, upstream: str | None, host: str | None, port: int | None) -> None:
    """Reserve KV blocks per request, cap outputs, answer 429 + Retry-After when full.

    Proxies the OpenAI-compatible API to the upstream; /metrics, /healthz and /kvtune/ledger are
    served by the gateway itself. SIGINT/SIGTERM drain in-flight streams, then exit.

    \b
    Example:
        kvtune gateway --config out/gateway.yaml --upstream http://127.0.0.1:8000 --port 8080
    """
    from kvtune.gateway.proxy import loop_factory, serve  # aiohttp: only once the gateway runs

    config = api.gateway_config(config_path, upstream=upstream, host=host, port=port)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(addresses: str) -> None:
            to = ", ".join(f"{u.url} (budget {u.block_budget})" for u in config.upstreams)
            if len(config.upstreams) == 1:
                to = f"{config.upstream} (budget {config.block_budget} blocks of {config.block_size} tokens)"
            if config.ledger.shared:  # never the URL: it may hold a password
                to += f"; ledger shared in Redis under {config.ledger.key_prefix!r}"
            click.echo(f"kvtune gateway listening on {addresses} -> {to}", err=True)

        gw = await serve(config, stop=stop, on_ready=ready)
        click.echo(f"kvtune gateway stopped; {gw.ledger.reserved_blocks} blocks still reserved", err=True)

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(run())
    except OSError as exc:
        raise InputError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
                         field="listen") from exc
