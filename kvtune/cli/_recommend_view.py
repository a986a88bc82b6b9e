"""The human view of a recommendation: headline, per-route caps, settings with their reasons."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kvtune.policy.recommendation import Recommendation
    from kvtune.policy.whatif import Objective, WhatIfRow


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
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "task" not in state:
            progress.start()
            state["task"] = progress.add_task("simulate", total=total)
        progress.update(state["task"], completed=done, total=total)

    try:
        yield update
    finally:
        if "task" in state:
            progress.stop()


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _pair(a: float | None, b: float | None) -> str:
    return f"{_ms(a)} / {_ms(b)}"


def what_if_headline(rec: Recommendation) -> str:
    """The chosen row against direct to vLLM, in one sentence (plain text)."""
    chosen, direct, objective = rec.chosen, rec.direct, rec.objective
    assert chosen is not None and objective is not None
    p = chosen.predicted
    versus = ""
    if direct is not None and direct.predicted.output_tokens_per_s > 0:
        d = direct.predicted
        versus = (f" ({p.output_tokens_per_s / d.output_tokens_per_s:.2f}× direct to vLLM's "
                  f"{d.output_tokens_per_s:,.1f}, which preempts {d.preemption_rate:.1%})")
    goodput = f", goodput {p.goodput_rps:,.2f} req/s" if p.goodput_rps is not None else ""
    return (f"{chosen.label}: {p.output_tokens_per_s:,.1f} output tokens/s{versus}{goodput}; "
            f"{p.preemption_rate:.1%} preempted, {p.share_429:.1%} answered 429, {p.truncation_share:.1%} "
            f"truncated, TTFT p99 {_ms(p.ttft_p99_ms)} ms")


def objective_line(objective: Objective) -> str:
    limits = [f"preemption rate ≤ {objective.max_preemption_rate:.1%}"] if objective.max_preemption_rate is not None \
        else []
    if objective.max_429_share is not None:
        limits.append(f"429 share ≤ {objective.max_429_share:.1%}")
    timing = "roofline estimate" if objective.basis.timing.estimate else "calibrated step time"
    return (f"objective: most {objective.metric_label} within {', '.join(limits) or 'no constraints'}, at "
            f"{objective.load.label}, {objective.requests:,} requests, seed {objective.seed} ({timing})")


def _policy_cell(r: WhatIfRow) -> str:
    kind = r.policy.kind.value
    return {"direct": "direct (vLLM defaults)", "worst-case": "whole context"}.get(kind, r.policy.label)


def show_what_if(rows: Sequence[WhatIfRow], objective: Objective, console: Console | None = None) -> None:
    """The what-if table: one row per simulated configuration, the chosen one marked."""
    console = console or Console()
    console.print(objective_line(objective))
    table = Table(title="What if (simulated)", title_justify="left", pad_edge=False)
    goodput = objective.slo is not None
    headers = ["#", "policy", "caps", "budget", "tok/s", *(["goodput"] if goodput else []), "TTFT p50/p99",
               "e2e p50/p99", "preempt", "429", "trunc", "verdict"]
    for header in headers:
        left = header in ("#", "policy", "caps", "verdict")
        table.add_column(header, justify="left" if left else "right", overflow="fold",
                         no_wrap=not left and header not in ("TTFT p50/p99", "e2e p50/p99"))
    for i, r in enumerate(rows, 1):
        p = r.predicted
        verdict = ("[bold green]▶ chosen[/bold green]" if r.chosen else
                   "reference" if r.reference and r.feasible else
                   f"[red]✗ {'; '.join(v.text for v in r.violations)}[/red]" if r.violations else "ok")
        budget = "—" if r.budget_blocks is None else f"{r.budget_blocks:,}"
        if r.safety_fraction is not None and r.budget_blocks is not None:
            budget += f" ({r.safety_fraction:g})"
        cells = [str(i), _policy_cell(r), r.cap_level or "none", budget, f"{p.output_tokens_per_s:,.1f}",
                 *([f"{p.goodput_rps or 0:,.2f}"] if goodput else []), _pair(p.ttft_p50_ms, p.ttft_p99_ms),
                 _pair(p.e2e_p50_ms, p.e2e_p99_ms), f"{p.preemption_rate:.1%}", f"{p.share_429:.1%}",
                 f"{p.truncation_share:.1%}", verdict]
        table.add_row(*cells, style="bold" if r.chosen else None)
    console.print(table)
    console.print("latencies in ms of completed requests; budget in blocks (safety fraction); caps: each route's "
                  "percentile of output tokens (tail: p95 light, p99 heavy tails)")
    chosen = next((r for r in rows if r.chosen), None)
    if chosen is not None:
        console.print(f"[bold green]▶[/bold green] {chosen.why}")


def show_recommendation(rec: Recommendation, written: list[str], console: Console | None = None) -> None:
    console = console or Console()
    conc, cap, hw = rec.concurrency, rec.capacity, rec.hardware
    gain = f"{conc.gain:.1f}×" if conc.gain is not None else "n/a"
    console.print(
        f"[bold]{rec.model}[/bold] on {hw.gpu or 'the given memory'} "
        f"(tp {hw.tensor_parallel_size}): KV pool {cap.num_blocks:,} blocks × "
        f"{cap.block_size} tokens ({cap.source}), budget {rec.budget_blocks:,} blocks"
    )
    if rec.what_if is not None and rec.objective is not None:
        console.print(f"[bold green]{what_if_headline(rec)}[/bold green]")
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
