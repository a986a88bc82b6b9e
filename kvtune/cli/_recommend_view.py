"""The human view of a recommendation: headline, per-route caps, settings with their reasons."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvtune.cli._console import output_console, shown
from kvtune.cli._progress import transient_bar
from kvtune.deploy.render import upstream_budgets
from kvtune.domain.whatif import Objective, WhatIfRow
from kvtune.policy.whatif import TABLE_NOTE, headline, objective_line, table_cells

if TYPE_CHECKING:
    from kvtune.deploy.render import RenderOptions
    from kvtune.domain.recommendation import Recommendation


def _gib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**30:.1f} GiB"


@contextlib.contextmanager
def search_progress(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A transient bar on stderr over the what-if rows simulated, or None (silent)."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress = Progress("simulating the what-if table", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with transient_bar(progress, "simulate") as update:
        yield update


def show_what_if(rows: tuple[WhatIfRow, ...], objective: Objective, console: Console | None = None) -> None:
    """The what-if table: one row per simulated configuration, the chosen one marked."""
    console = console or output_console()
    console.print(objective_line(objective))
    table = Table(title="What if (simulated)", title_justify="left", pad_edge=False)
    goodput = objective.slo is not None
    columns = [("#", "index"), ("policy", "policy"), ("caps", "caps"), ("budget", "budget"), ("tok/s", "tokens_per_s"),
               *([("goodput", "goodput")] if goodput else []), ("TTFT p50/p99", "ttft"), ("e2e p50/p99", "e2e"),
               ("preempt", "preempted"), ("429", "share_429"), ("trunc", "truncated"), ("verdict", "verdict")]
    for header, _ in columns:
        left = header in ("#", "policy", "caps", "verdict")
        table.add_column(header, justify="left" if left else "right", overflow="fold",
                         no_wrap=not left and header not in ("TTFT p50/p99", "e2e p50/p99"))
    for cells in table_cells(rows):
        values = [str(cells[key]) for _, key in columns]
        if cells["chosen"]:
            values[-1] = "[bold green]▶ chosen[/bold green]"
        elif cells["broken"]:
            values[-1] = f"[red]{values[-1]}[/red]"
        table.add_row(*values, style="bold" if cells["chosen"] else None)
    console.print(table)
    console.print(TABLE_NOTE)
    chosen = next((r for r in rows if r.chosen), None)
    if chosen is not None:
        console.print(f"[bold green]▶[/bold green] {chosen.why}")


def show_recommendation(rec: Recommendation, written: list[str], console: Console | None = None) -> None:
    console = console or output_console()
    conc, cap, hw = rec.concurrency, rec.capacity, rec.hardware
    gain = f"{conc.gain:.1f}×" if conc.gain is not None else "n/a"
    console.print(
        f"[bold]{shown(rec.model)}[/bold] on {hw.gpu or 'the given memory'} "
        f"(tp {hw.tensor_parallel_size}): KV pool {cap.num_blocks:,} blocks × "
        f"{cap.block_size} tokens ({cap.source}), budget {rec.budget_blocks:,} blocks"
    )
    if rec.what_if is not None and rec.objective is not None:
        console.print(f"[bold green]{headline(rec.what_if, rec.objective)}[/bold green]")
        show_what_if(rec.what_if, rec.objective, console)
    else:
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
            shown(r.route), f"{r.requests:,}", r.tail.value, f"{r.cap:,}", r.max_new_tokens.rule,
            f"{r.truncation_share:.1%}",
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
        console.print(f"[yellow]note:[/yellow] {shown(note)}")
    if written:
        console.print("wrote " + ", ".join(written))


def show_upstream_budgets(rec: Recommendation, options: RenderOptions) -> None:
    """The engine upstreams' budgets (several replicas), and each nginx's static slice of them
    under --nginx-replicas."""
    m = options.nginx_replicas
    rows = upstream_budgets(rec, options)
    simulated = all(r["predicted"] is not None for r in rows)
    limits = all(r["max_num_seqs"] is not None for r in rows)  # each replica's own engine limits
    figures = ("tokens/s", "TTFT p50 / p99 ms", "preempted", "429")
    table = Table(title="Upstream budgets" + (f" ({m} nginx replicas, a static slice each)" if m > 1 else "")
                  + (" and each replica's simulated figures" if simulated else ""))
    for column in ("upstream", "budget blocks", "budget tokens", "source", *(("slice blocks",) if m > 1 else ()),
                   *(("max_num_seqs", "batched tokens") if limits else ()), *(figures if simulated else ())):
        table.add_column(column, justify="left" if column in ("upstream", "source") else "right")
    for row in rows:
        cells = [row["url"], f"{row['block_budget']:,}", f"{row['budget_tokens']:,}", row["source"]]
        if m > 1:
            cells.append(f"{row['slice_blocks']:,}")
        if limits:
            cells += [f"{row['max_num_seqs']:,}", f"{row['max_num_batched_tokens']:,}"]
        if simulated:
            cells += _figures(row["predicted"])
        table.add_row(*cells)
    chosen = rec.chosen
    if simulated and chosen is not None:
        total = sum(r["block_budget"] for r in rows)
        table.add_row("deployment", f"{total:,}", f"{total * rec.capacity.block_size:,}", "the sum",
                      *([""] if m > 1 else []), *(["", ""] if limits else []), *_figures(chosen.predicted),
                      style="bold")
    Console(width=200).print(table)


def _figures(p) -> list[str]:
    """A Predicted's cells: output tokens/s, TTFT p50 / p99, preempted and 429 shares."""
    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:,.0f}"

    return [f"{p.output_tokens_per_s:,.1f}", f"{ms(p.ttft_p50_ms)} / {ms(p.ttft_p99_ms)}",
            f"{p.preemption_rate:.1%}", f"{p.share_429:.1%}"]
