"""Human output of `kvtune profile`: a rich table per route, bar-row histograms, a progress bar.

rich is imported only here, so `--json` and the library never load it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import numpy as np

from kvtune.cli._progress import transient_bar
from kvtune.controls import escape_controls
from kvtune.domain.tail_class import TailClass
from kvtune.profile.histogram import Histogram
from kvtune.profile.logged_model import describe_models, models_by_rows
from kvtune.profile.routes import TAIL_RULE, Profile, RouteProfile, classify_tail, summarize_plain

_BAR_WIDTH = 32
_PROGRESS_DELAY_S = 0.5  # inputs read faster than this never show a bar


def _fmt(q) -> str:
    return f"≥{q.value_tokens:,}" if q.lower_bound else f"{q.value_tokens:,}"


def render_profile(profile: Profile, *, file=None) -> None:
    """Print the per-route table, one histogram per route, and the inputs read."""
    from rich.table import Table

    from kvtune.cli._console import output_console, shown  # rich: only for the tables

    console = output_console(file, highlight=False)
    if not profile.routes:
        console.print("No requests to profile.")
        return
    table = Table(title="Output and prompt tokens per route (≥ = lower bound: censored)", title_justify="left")
    table.add_column("route", no_wrap=True)
    table.add_column("requests", justify="right")
    table.add_column("cut", justify="right")
    for key in ("p50", "p90", "p95", "p99", "max"):
        table.add_column(f"out {key}", justify="right")
    for key in ("p50", "p99", "max"):
        table.add_column(f"prompt {key}", justify="right")
    table.add_column("tail")
    routes = sorted(profile.routes, key=lambda r: (-r.requests, r.route))
    for route in routes:
        out = route.output.summary()
        prompt = summarize_plain(route.prompt) if route.prompt.total else None
        table.add_row(
            shown(route.route),
            f"{route.requests:,}",
            f"{100 * route.output.censored_share:.1f}%",
            *(_fmt(out[k]) for k in ("p50", "p90", "p95", "p99", "max")),
            *((_fmt(prompt[k]) for k in ("p50", "p99", "max")) if prompt else ("-", "-", "-")),
            _tail_label(out),
        )
    console.print(table)
    console.print(f"cut = censored share (hit the cap). Tail class: {TAIL_RULE}; ? = decided on lower bounds.")
    for route in routes:
        console.print()
        _render_route_details(console, route)
    console.print()
    for item in profile.inputs:
        console.print(f"read {shown(item.path)} ({item.format}, {item.rows:,} rows)")


def _tail_label(summary) -> str:
    tail = classify_tail(summary)
    return tail.class_.value + ("?" if tail.lower_bound and tail.class_ is TailClass.LIGHT else "")


def _render_route_details(console, route: RouteProfile) -> None:
    from kvtune.cli._console import shown  # rich: only for the tables

    console.print(f"[bold]{shown(route.route)}[/bold]: output tokens")
    for label, bar, share in _bar_rows(route.output.observed):
        console.print(f"  {label:>15}  {bar:<{_BAR_WIDTH}} {100 * share:5.1f}%")
    facts = []
    if route.max_tokens.total:
        asked = summarize_plain(route.max_tokens)
        facts.append(f"max_tokens requested p50 {_fmt(asked['p50'])}, p99 {_fmt(asked['p99'])}")
    if route.finish_reasons:
        facts.append("finish: " + ", ".join(f"{k} {v:,}" for k, v in route.finish_reasons.items()))
    if route.arrival is not None and route.arrival.mean_rate_rps is not None:
        a = route.arrival
        facts.append(f"arrivals: mean {a.mean_rate_rps:.2f}/s, peak {a.peak_rate_rps:.2f}/s over 60 s")
    for name, h in (("latency", route.latency_ms), ("TTFT", route.ttft_ms)):
        if h is not None:
            facts.append(f"{name} p50 {h.quantile(0.5):,.0f} ms, p99 {h.quantile(0.99):,.0f} ms")
    for fact in facts:
        console.print(f"  {fact}")


def _bar_rows(h: Histogram) -> list[tuple[str, str, float]]:
    """Rows over power-of-two ranges 0, 1, 2–3, 4–7, …: label, bar, share of requests."""
    if h.total == 0:
        return []
    bins = np.where(h.values == 0, 0, np.floor(np.log2(np.maximum(h.values, 1))).astype(np.int64) + 1)
    counts = np.bincount(bins, weights=h.counts).astype(np.int64)
    first = int(np.flatnonzero(counts)[0])
    top = counts.max()
    rows = []
    for b in range(first, counts.size):
        lo, hi = (0, 0) if b == 0 else (1 << (b - 1), (1 << b) - 1)
        label = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
        eighths = int(round(8 * _BAR_WIDTH * counts[b] / top))
        bar = "█" * (eighths // 8) + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[eighths % 8]
        rows.append((label, bar, counts[b] / h.total))
    return rows


def render_skipped(profile: Profile, *, file=None) -> None:
    """One line per skip reason, with where it first happened, on stderr."""
    if not profile.skipped_rows:
        return
    out = file or sys.stderr
    print(f"skipped {profile.skipped_rows:,} rows:", file=out)
    for reason, count in profile.skipped.items():
        where = profile.skip_examples.get(reason)
        print(escape_controls(f"  {count:,} {reason}" + (f" (first: {where})" if where else "")), file=out)


def render_window(profile: Profile, *, file=None) -> None:
    """One line on stderr for a --since/--until window: its bounds, files pruned, rows outside."""
    w = profile.window
    if w is None:
        return
    print(f"window [{w.since or '-inf'}, {w.until or '+inf'}): {w.pruned_files:,} files pruned by partition "
          f"date (not read), {w.outside_rows:,} rows outside the window", file=file or sys.stderr)


def render_skipped_files(profile: Profile, *, file=None) -> None:
    """One line on stderr per kind of file not read (kvtune's own outputs, --exclude), never silent."""
    for note in profile.notes:
        print(escape_controls(f"note: {note}"), file=file or sys.stderr)


def render_models(profile: Profile, *, file=None) -> None:
    """One line on stderr naming the logged models (several: each with its rows) and what --log-model
    left out, so a mixed log is visible before `recommend` refuses it."""

    named = models_by_rows(profile.models)
    selection = profile.log_model
    if selection is None and len(named) < 2:
        return
    line = f"models: {describe_models(named) or 'none named'}"
    if selection is not None:
        left = describe_models(models_by_rows(selection.left_out)) or "no other model"
        line += (f"; --log-model {selection.name} left out {left}"
                 + (f" and {selection.unnamed_rows:,} row(s) naming none" if selection.unnamed_rows else ""))
    else:
        line += ": one deployment serves one; pick one with --log-model"
    print(escape_controls(line), file=file or sys.stderr)


def render_folded(profile: Profile, max_routes: int | None, *, file=None) -> None:
    """One line on stderr when routes were folded into `*`, so a `*` in the output is explained."""
    if not profile.folded_routes:
        return
    limit = f" (--max-routes {max_routes:,} keeps the busiest)" if max_routes is not None else ""
    print(f"folded {profile.folded_routes:,} routes ({profile.folded_requests:,} requests) into *{limit}; "
          "so many routes usually mean ids in the route key: see --route-by", file=file or sys.stderr)


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A byte-progress callback for ingest drawing a transient bar on stderr, or None.

    The bar appears only once reading has taken longer than half a second.
    """
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    progress = Progress(
        "reading logs", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True,
    )
    with transient_bar(progress, "read", delay_s=_PROGRESS_DELAY_S) as update:
        yield update
