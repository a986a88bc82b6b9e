"""Rich rendering for `kvtune bench`: the live progress on stderr and the summary table."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtune.cli._console import shown
from kvtune.engines import vllm

_PASS, _FAIL, _UNKNOWN = "[green]pass[/]", "[red]fail[/]", "[yellow]unknown[/]"

class RichBenchProgress:
    """A progress bar over requests (or seconds, for a duration-bound run) plus live counters."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]bench[/]"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}"),
            TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console, transient=True,
            refresh_per_second=4,
        )
        self.task: TaskID | None = None
        self.by_duration = False
        self.done = self.ok = self.failed = 0
        self.server = ""
        self.t0 = 0.0

    def on_start(self, info: Mapping[str, Any]) -> None:
        self.by_duration = info.get("max_requests") is None
        total = info.get("duration_s") if self.by_duration else info.get("max_requests")
        self.t0 = time.perf_counter()
        self.progress.start()
        self.task = self.progress.add_task("bench", total=total, status="")

    def _status(self) -> str:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        return f"ok {self.ok}  failed {self.failed}  {self.ok / elapsed:.1f} req/s{self.server}"

    def on_result(self, result) -> None:
        self.done += 1
        if result.ok:
            self.ok += 1
        else:
            self.failed += 1
        if self.task is not None and (self.done % 16 == 0 or self.done < 64):
            completed = time.perf_counter() - self.t0 if self.by_duration else self.done
            self.progress.update(self.task, completed=completed, status=self._status())

    def on_server(self, snapshot) -> None:
        kv = snapshot.get(vllm.KV_CACHE_USAGE)
        running = snapshot.get(vllm.NUM_REQUESTS_RUNNING)
        waiting = snapshot.get(vllm.NUM_REQUESTS_WAITING)
        parts = []
        if kv is not None:
            parts.append(f"KV {kv:.0%}")
        if running is not None:
            parts.append(f"running {running:.0f}")
        if waiting is not None:
            parts.append(f"waiting {waiting:.0f}")
        self.server = ("  │ " + "  ".join(parts)) if parts else ""

    def on_finish(self) -> None:
        self.progress.stop()


def _ms(stats: Mapping[str, Any], key: str) -> str:
    v = stats.get(key)
    return "–" if v is None else f"{v:,.1f}"


def render_summary(report: Mapping[str, Any], console: Console) -> None:
    """The people's view of the results JSON."""
    req = report["requests"]
    failed = {k: v for k, v in req["failed"].items() if v}
    load = report.get("load", {})
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    target = report.get("target", {})
    head.add_row("target", f"{target.get('url')} ({target.get('endpoint')}, model {target.get('model')})")
    head.add_row("load", ", ".join(f"{k} {v}" for k, v in load.items() if v not in (None, False)))
    head.add_row("requests", f"{req['sent']} sent, {req['completed']} completed"
                 + (", failed " + ", ".join(f"{k}: {v}" for k, v in failed.items()) if failed else "")
                 + (f", {req['retries']} retries" if req["retries"] else ""))
    tp = report["throughput"]
    head.add_row("throughput", f"{tp['requests_per_s']:,.2f} req/s, {tp['output_tokens_per_s']:,.1f} output tok/s "
                 f"over {report['duration_s']:,.2f} s")
    ol = report["output_length"]
    head.add_row("output tokens", f"{report['output_tokens_total']:,} received (server usage) of "
                 f"{report['output_tokens_requested_total']:,} requested"
                 + (f"; {ol['mismatched']} responses differ (short {ol['shortfall_tokens']:,}, "
                    f"over {ol['excess_tokens']:,})" if ol["mismatched"] else "; every response exact"))
    pl = report["prompt_length"]
    head.add_row("prompt tokens", f"{report['prompt_tokens_total']:,} (server usage) of "
                 f"{report['prompt_tokens_requested_total']:,} intended; {pl['mismatched']} of {pl['checked']} differ")
    if report.get("goodput"):
        g = report["goodput"]
        head.add_row("goodput",
                     f"{g['requests_met']} met the SLO ({g['attainment']:.1%}), {g['requests_per_s']:,.2f} req/s")
    console.print(head)

    lat = Table(title="latency (ms)", title_justify="left")
    for col in ("", "mean", "p50", "p90", "p99", "n"):
        lat.add_column(col, justify="right" if col else "left")
    for name in ("ttft", "itl", "tpot", "e2e"):
        s = report["latency_ms"][name]
        lat.add_row(name.upper(), _ms(s, "mean"), _ms(s, "p50"), _ms(s, "p90"), _ms(s, "p99"), f"{s['count']:,}")
    console.print(lat)

    server = report.get("server")
    if server is None:
        console.print(f"[yellow]server: {report.get('server_note') or 'no metrics'}[/]")
    else:
        kv = server.get("kv_cache_usage_peak")
        console.print(
            f"server: preemptions {server.get('preemptions')}, peak KV {('–' if kv is None else f'{kv:.1%}')}, "
            f"peak running {server.get('running_peak')}, peak waiting {server.get('waiting_peak')}, "
            f"generation tokens {server.get('generation_tokens')}, "
            f"{server.get('num_blocks')} blocks × {server.get('block_size')} tokens")

    v = report.get("verdict")
    if v:
        table = Table(title="verdict: " + ("[green]PASS[/]" if v["passed"] else "[red]FAIL[/]"), title_justify="left")
        for col in ("check", "result", "observed", "expected", "why"):
            table.add_column(col)
        for name, check in v.items():
            if name == "passed":
                continue
            result = _PASS if check["passed"] else (_FAIL if check["evaluated"] else _UNKNOWN)
            if name == "truncation_share":
                for r in check["routes"]:
                    rr = _PASS if r["passed"] else (_FAIL if r["passed"] is False else _UNKNOWN)
                    tol = "" if r["tolerance"] is None else f" ± {r['tolerance']:.3f}"
                    table.add_row(f"truncation {shown(r['route'])}", rr, str(r["observed"]),
                                  f"{r['expected']}{tol}", "")
            else:
                table.add_row(name, result, str(check["observed"]), str(check["expected"]), check["detail"])
        console.print(table)
