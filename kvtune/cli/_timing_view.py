"""Rich rendering for `kvtune calibrate --timing`: the plan and a bar per sweep on stderr, the fit's table."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtune.capacity.timing import (
    COEFFICIENT_UNITS,
    COEFFICIENTS,
    FITTED,
    FORMULA,
    FRONTEND_TERMS,
    FRONTEND_UNITS,
    Timing,
)


class RichTimingProgress:
    """Prints the plan, then one progress bar per sweep (requests sent of at most planned)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def on_plan(self, steps: Sequence[tuple[str, str, int]]) -> None:
        self.console.print("[bold]Timing plan[/] (bounded by --timing-budget-s):")
        for i, (name, what, _) in enumerate(steps, start=1):
            self.console.print(f"  {i}. {name}: {escape(what)}", soft_wrap=True)

    def on_step(self, name: str, total: int, seconds: float) -> None:
        self.progress = Progress(
            TextColumn(f"[bold]{name:<8}[/]"), BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} requests"),
            TimeElapsedColumn(), TextColumn(f"(share of the budget: {seconds:.0f} s)"), console=self.console,
            refresh_per_second=4,
        )
        self.progress.start()
        self.task = self.progress.add_task(name, total=total)

    def on_advance(self, count: int = 1) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task, count)

    def on_step_end(self) -> None:
        if self.progress is not None:
            if self.task is not None:  # a sweep that stopped early on its time share is done all the same
                task = self.progress.tasks[0]
                self.progress.update(self.task, total=task.completed)
            self.progress.stop()
        self.progress = self.task = None


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.2f}"


def print_timing(timing: Timing, console: Console) -> None:
    """The coefficients and the error of the fit on each sweep."""
    model = timing.model
    # calibrate fits c0..c3 (kvtune.capacity.timing.FITTED); c4 is shown only where a model has it
    names = COEFFICIENTS if model.c4 else COEFFICIENTS[:FITTED]
    formula = FORMULA if model.c4 else FORMULA.rsplit(" + c4", 1)[0]
    coefficients = Table(title=f"Step time ({timing.source.value}): {formula}", title_justify="left")
    coefficients.add_column("coefficient")
    coefficients.add_column("value", justify="right")
    coefficients.add_column("unit")
    for name in names:
        coefficients.add_row(name, f"{getattr(model, name):.4g}", COEFFICIENT_UNITS[name])
    coefficients.add_row("HTTP overhead", f"{timing.http_overhead_s:.4g}", "s per request")
    if timing.frontend is not None:
        for name in FRONTEND_TERMS:
            coefficients.add_row(f"API server {name}", f"{getattr(timing.frontend, name):.4g}", FRONTEND_UNITS[name])
    console.print(coefficients)

    sweeps = Table(title="Fit error per sweep (|predicted − measured| / measured)", title_justify="left")
    sweeps.add_column("sweep")
    for column in ("requests", "prompt tokens", "concurrency", "median", "p90", "client mean ms", "engine mean ms",
                   "steps seen"):
        sweeps.add_column(column, justify="right")
    for s in timing.sweeps:
        engine = s.server.engine_itl_mean_s if s.name in ("decode", "load") else s.server.engine_prefill_mean_s
        sweeps.add_row(
            s.name, f"{s.completed}/{s.requests}", f"{s.prompt_tokens[0]:,}–{s.prompt_tokens[1]:,}",
            ",".join(map(str, s.concurrency)) or "—", _pct(s.error.median if s.error else None),
            _pct(s.error.p90 if s.error else None), _ms(s.client_mean_s), _ms(engine),
            "—" if s.server.iterations is None else f"{s.server.iterations:,}",
        )
    console.print(sweeps)
    console.print("client mean: TTFT for overhead and prefill, inter-token gap for decode; engine mean: vLLM's "
                  "own prefill time and inter-token latency (/metrics); steps seen: vllm:iteration_tokens_total",
                  soft_wrap=True, style="dim")
    for s in timing.sweeps:
        for note in s.notes:
            console.print(f"{s.name}: {escape(note)}", soft_wrap=True)
    against = timing.measured_against
    console.print(f"Measured against {escape(against.model or '?')} at {escape(against.url)} with "
                  f"max_num_batched_tokens {against.max_num_batched_tokens:,} "
                  f"(from {against.max_num_batched_tokens_from}) in {timing.wall_s:.0f} s "
                  f"of a {timing.budget_s:g} s budget.", soft_wrap=True)
