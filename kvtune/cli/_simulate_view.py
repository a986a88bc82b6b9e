"""Rich rendering for `kvtune simulate`: the predicted figures, where the settings came from, a plot."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvtune.controls import escape_controls
from kvtune.sim.plot import Timeline, terminal_lines


def _ms(stats: dict[str, Any], key: str) -> str:
    value = stats.get(key)
    return "—" if value is None else f"{value:,.1f}"


_ESTIMATE = {"roofline-estimate": "ROOFLINE ESTIMATE", "silicon": "SILICON-DATA ESTIMATE"}


def render_simulation(report: dict[str, Any], line: Timeline | None, console: Console) -> None:
    sim = report["simulation"]
    timing = sim["timing"]
    estimate = timing["estimate"]
    title = "kvtune simulate" + (f" — {_ESTIMATE.get(timing['source'], 'ESTIMATE')} (no calibrated timing)"
                                 if estimate else "")
    admission = sim["admission"]
    route = escape_controls(str(admission.get("route")))
    where = ("straight to vLLM" if admission["kind"] == "direct" else
             f"through the gateway (budget {admission['block_budget']:,} blocks, route {route}, "
             f"cap {admission['max_new_tokens']:,})")
    table = Table(title=escape(f"{title}: {where}"), title_justify="left")
    table.add_column("figure")
    table.add_column("predicted", justify="right")
    req, thr, srv = report["requests"], report["throughput"], report["server"]
    rows = [
        ("requests sent / completed", f"{req['sent']:,} / {req['completed']:,}"),
        ("429 (retries exhausted) / refused", f"{req['failed']['429']:,} / {req['failed']['4xx']:,}"),
        ("retries", f"{req['retries']:,}"),
        ("duration (simulated)", f"{report['duration_s']:,.2f} s"),
        ("output tokens/s", f"{thr['output_tokens_per_s']:,.1f}"),
        ("requests/s", f"{thr['requests_per_s']:,.3f}"),
        ("preemptions", f"{srv['preemptions']:,}"),
        ("KV use peak", f"{srv['kv_cache_usage_peak']:.1%}"),
        ("running / waiting peak", f"{srv['running_peak']:,} / {srv['waiting_peak']:,}"),
    ]
    for name in ("ttft", "tpot", "e2e"):
        stats = report["latency_ms"][name]
        rows.append((f"{name} ms p50 / p90 / p99", f"{_ms(stats, 'p50')} / {_ms(stats, 'p90')} / {_ms(stats, 'p99')}"))
    goodput = report.get("goodput")
    if goodput is not None:
        rows.append(("SLO attainment", "—" if goodput["attainment"] is None else f"{goodput['attainment']:.1%}"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    console.print(escape(f"Load: {load_line(report['load'])}."), soft_wrap=True, highlight=False)
    engine = ", ".join(f"{k} {v['value']} ({v['from']})" for k, v in sim["engine"].items())
    console.print(escape(f"Engine: {engine}."), soft_wrap=True, highlight=False)
    c = timing["coefficients"]
    console.print(escape(f"Step time ({timing['source']}): c0 {c['c0']:.3g} s + c1 {c['c1']:.3g} s/token + "
                         f"c2 {c['c2']:.3g} s/token/context + c3 {c['c3']:.3g} s/request"
                         + (f" + c4 {c['c4']:.3g} s/context token read" if c.get("c4") else "") + "; "
                         + _front(timing)),
                  soft_wrap=True, highlight=False)
    if "label" in timing:
        console.print(escape(f"Step-time source: {timing['label']}."), soft_wrap=True, highlight=False)
    if line is not None:
        for text in terminal_lines(line):
            console.print(escape(text), highlight=False, soft_wrap=True)
    done = f"{sim['events']:,} events, {sim['steps']:,} engine steps, simulated in {sim['wall_s']:.2f} s."
    console.print(escape(done), highlight=False, soft_wrap=True)


_LOAD_FROM = {"option": "as given", "logs": "the logs' own arrivals",
              "default": "no timestamps in the logs, so one client at a time"}


def load_line(load: dict[str, Any]) -> str:
    """Which load ran and where it came from, e.g. 'Poisson 3.34 req/s (the logs' mean arrival rate)'."""
    kind = load["kind"]
    where = _LOAD_FROM.get(str(load.get("from")), "")
    if kind in ("poisson", "gamma"):
        shape = f"{'Poisson' if kind == 'poisson' else 'gamma'} arrivals at {load['rate_rps']:,.4g} req/s"
        if kind == "gamma":
            shape += f" (burstiness {load['burstiness']:g})"
        if load.get("from") == "logs":
            where = "the logs' mean arrival rate"
    elif kind == "replay":
        shape, where = f"the logs' own timestamps ÷ {load['speedup']:g}", ""
    else:
        shape = f"{load['concurrency']:,} concurrent client(s), closed loop"
    bound = [f"{load['max_requests']:,} requests" if load.get("max_requests") else "",
             f"{load['duration_s']:g} s" if load.get("duration_s") else ""]
    return shape + (f" ({where})" if where else "") + "".join(f", {b}" for b in bound if b)


def _front(timing: dict[str, Any]) -> str:
    fe = timing.get("frontend")
    if fe is None:
        return f"HTTP overhead {timing['http_overhead_s'] * 1000:.1f} ms (fixed)."
    return (f"API server (one process its requests share): {fe['request_s'] * 1000:.2f} ms/request + "
            f"{fe['token_s'] * 1000:.3f} ms/token.")
