"""The human view of a recommendation: headline, per-route caps, settings with their reasons."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kvtune.policy.recommendation import Recommendation


def _gib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**30:.1f} GiB"


def show_recommendation(rec: Recommendation, written: list[str], console: Console | None = None) -> None:
    console = console or Console()
    conc, cap, hw = rec.concurrency, rec.capacity, rec.hardware
    gain = f"{conc.gain:.1f}×" if conc.gain is not None else "n/a"
    console.print(
        f"[bold]{rec.model}[/bold] on {hw.gpu or 'the given memory'} "
        f"(tp {hw.tensor_parallel_size}): KV pool {cap.num_blocks:,} blocks × "
        f"{cap.block_size} tokens ({cap.source}), budget {rec.budget_blocks:,} blocks"
    )
    console.print(
        f"[bold green]{conc.admitted:,} concurrent requests[/bold green] for the logged route mix with "
        f"per-route caps, vs {conc.worst_case:,} when every request reserves the whole "
        f"{conc.context_tokens:,}-token context: [bold]{gain}[/bold]"
    )

    routes = Table(title="Per route", title_justify="left")
    for header in ("route", "requests", "tail", "cap", "rule", "truncated", "asked > cap",
                   "reserve p50/p99", "concurrency"):
        routes.add_column(header, justify="left" if header in ("route", "tail", "rule") else "right")
    for r in rec.routes:
        asked = r.requested_max_tokens
        routes.add_row(
            r.route, f"{r.requests:,}", r.tail.value, f"{r.cap:,}", r.max_new_tokens.rule, f"{r.truncation_share:.1%}",
            "—" if asked is None else f"{asked.share_above_cap:.0%}",
            f"{r.reservation_blocks.p50}/{r.reservation_blocks.p99} blk",
            f"{r.concurrency.admitted:,} vs {r.concurrency.worst_case:,}",
        )
    console.print(routes)

    settings = Table(title="Settings", title_justify="left")
    for header in ("setting", "value", "rule", "reason"):
        settings.add_column(header, overflow="fold")
    for name, decision in [("safety_fraction", rec.safety_fraction), ("block_budget", rec.block_budget),
                           *rec.settings.items()]:
        if decision is not None:
            settings.add_row(name, str(decision.value), decision.rule, decision.reason)
    console.print(settings)
    console.print(f"memory per GPU: weights {_gib(cap.weights_bytes)}, overhead {_gib(cap.overhead_bytes)}, "
                  f"KV {_gib(cap.kv_cache_bytes)}")
    for note in rec.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if written:
        console.print("wrote " + ", ".join(written))
