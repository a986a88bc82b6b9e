"""The what-if table in words: the headline sentence, each row's cells and the objective line
that the terminal, report.md and report.html show. The table itself is a document on the floor
(kvtune.domain.whatif); kvtune.policy.search builds its rows.
"""

from __future__ import annotations

from typing import Any

from kvtune.domain.whatif import Objective, PolicyKind, Predicted, WhatIfRow


def compute_bound_note(predicted: Predicted, budget_blocks: int | None, ttft_target_ms: float | None) -> str | None:
    """A flow-control row's note when the engine, not KV, was short: its KV peak stayed under the
    gateway's budget while vLLM's own waiting queue reached at least half its running batch
    (requests the gateway had admitted waited inside vLLM with KV to spare: for compute, prefill)
    and TTFT p99 missed the target, where no KV gate shortens the wait. None otherwise, or when a
    figure is unknown. (A gateway whose ledger is full holds requests back in front of vLLM, whose
    queue then stays short: on the Azure conversation trace at 150 % vLLM's waiting peak is 18-30
    of 333-386 running; on the code trace 109-122 of 139-145.)"""
    peak, waiting, running, ttft = (predicted.kv_peak_blocks, predicted.waiting_peak, predicted.running_peak,
                                    predicted.ttft_p99_ms)
    if budget_blocks is None or ttft_target_ms is None or peak is None or waiting is None or running is None \
            or ttft is None:
        return None
    if peak >= budget_blocks or 2 * waiting < running or ttft <= ttft_target_ms:
        return None
    return (f"compute-bound: vLLM queued up to {waiting:,} requests beside {running:,} running while KV peaked at "
            f"{peak:,} of the {budget_blocks:,}-block budget, and TTFT p99 {ttft:,.0f} ms missed the "
            f"{ttft_target_ms:,.0f} ms target: they wait inside vLLM for compute, which no KV gate (flow control "
            "included) shortens")


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def headline(rows: tuple[WhatIfRow, ...], objective: Objective) -> str:
    """The chosen row against direct to vLLM, in one sentence (the headline of every output)."""
    chosen = next(r for r in rows if r.chosen)
    direct = next((r for r in rows if r.policy.kind is PolicyKind.DIRECT), None)
    p = chosen.predicted
    versus = ""
    if direct is not None and direct.predicted.output_tokens_per_s > 0:
        d = direct.predicted
        versus = (f" ({p.output_tokens_per_s / d.output_tokens_per_s:.2f}× direct to vLLM's "
                  f"{d.output_tokens_per_s:,.1f}, which preempts {d.preemption_rate:.1%} of requests)")
    goodput = f", goodput {p.goodput_rps:,.2f} req/s" if p.goodput_rps is not None else ""
    return (f"{chosen.label}: {p.output_tokens_per_s:,.1f} output tokens/s{versus}{goodput}; "
            f"{p.preemption_rate:.1%} preempted, {p.share_429:.1%} answered 429, {p.truncation_share:.1%} "
            f"truncated, TTFT p99 {_ms(p.ttft_p99_ms)} ms")


def table_cells(rows: tuple[WhatIfRow, ...]) -> list[dict[str, Any]]:
    """Each row's cells as the what-if tables show them (terminal, report.md, report.html)."""
    out = []
    for i, r in enumerate(rows, 1):
        p = r.predicted
        budget = "—" if r.budget_blocks is None else f"{r.budget_blocks:,}"
        if r.safety_fraction is not None and r.budget_blocks is not None:
            budget += f" ({r.safety_fraction:g})"
        out.append({"index": str(i), "policy": r.policy_cell, "caps": r.cap_level or "none", "budget": budget,
                    "tokens_per_s": f"{p.output_tokens_per_s:,.1f}",
                    "goodput": "—" if p.goodput_rps is None else f"{p.goodput_rps:,.2f}",
                    "ttft": f"{_ms(p.ttft_p50_ms)} / {_ms(p.ttft_p99_ms)}",
                    "e2e": f"{_ms(p.e2e_p50_ms)} / {_ms(p.e2e_p99_ms)}",
                    "preempted": f"{p.preemption_rate:.1%}", "share_429": f"{p.share_429:.1%}",
                    "truncated": f"{p.truncation_share:.1%}", "verdict": r.verdict, "chosen": r.chosen,
                    "broken": bool(r.violations), "why": r.why})
    return out


def replica_cells(row: WhatIfRow) -> list[dict[str, Any]]:
    """Each replica's part of a row, then the deployment's total, as the reports show them."""
    out = []
    for r in row.replicas:
        p = r.predicted
        out.append({"replica": r.capacity_file, "share": f"{r.share:.0%}",
                    "budget": "—" if r.budget_blocks is None else f"{r.budget_blocks:,}",
                    "max_num_seqs": f"{r.max_num_seqs:,}", "max_num_batched_tokens": f"{r.max_num_batched_tokens:,}",
                    **_figure_cells(p)})
    if out:
        out.append({"replica": "deployment (total)", "share": "100%",
                    "budget": "—" if row.budget_blocks is None else f"{row.budget_blocks:,}",
                    "max_num_seqs": "", "max_num_batched_tokens": "", **_figure_cells(row.predicted)})
    return out


def _figure_cells(p: Predicted) -> dict[str, str]:
    return {"tokens_per_s": f"{p.output_tokens_per_s:,.1f}", "ttft": f"{_ms(p.ttft_p50_ms)} / {_ms(p.ttft_p99_ms)}",
            "e2e": f"{_ms(p.e2e_p50_ms)} / {_ms(p.e2e_p99_ms)}", "preempted": f"{p.preemption_rate:.1%}",
            "share_429": f"{p.share_429:.1%}"}


TABLE_NOTE = ("latencies in ms of completed requests (p50 / p99); budget in blocks (safety fraction); caps: each "
              "route's percentile of output tokens (tail: p95 for light tails, p99 for heavy ones); trunc: the "
              "share of answers the row's caps cut (the logged output lengths' Kaplan–Meier estimate)")


def objective_line(objective: Objective) -> str:
    """What was maximised, within what, at which load, on which step time."""
    limits = []
    if objective.max_preemption_rate is not None:
        limits.append(f"preemption rate ≤ {objective.max_preemption_rate:.1%}")
    if objective.max_429_share is not None:
        limits.append(f"429 share ≤ {objective.max_429_share:.1%}")
    if objective.max_truncation is not None:
        limits.append(f"answers truncated by the caps ≤ {objective.max_truncation:.1%}")
    timing = "roofline step-time estimate" if objective.basis.timing.estimate else "calibrated step time"
    return (f"objective: the most {objective.metric_label} within {', '.join(limits) or 'no constraints'}, at "
            f"{objective.load.label}, {objective.requests:,} requests, {objective.seeds_label} ({timing})")


__all__ = ["headline", "objective_line", "table_cells", "replica_cells", "TABLE_NOTE", "compute_bound_note"]
