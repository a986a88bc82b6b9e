"""`run_simulation`: traffic, engine settings, step time and admission in; the results JSON out.

What `kvtune simulate` calls. A closed loop bounded only by a duration cannot know up front how
many requests its clients will send: it draws CLOSED_LOOP_FIRST_DRAW, and draws twice as many
again whenever the clients used them all before the duration ended (bench's draws for a seed are
a prefix of its longer draws, so the requests sent are the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtune.domain.retry_policy import RetryPolicy
from kvtune.domain.slo import Slo
from kvtune.sim.admission import Admission
from kvtune.sim.engine import CLIENT_RETRY, simulate
from kvtune.sim.plot import Timeline, timeline
from kvtune.sim.report import sim_report
from kvtune.sim.requests import Outcome
from kvtune.sim.results import OUTCOMES, SimResult
from kvtune.sim.rules import EngineRule, rule_name
from kvtune.sim.setup import EngineSetup, TimingSetup
from kvtune.sim.traffic import MAX_REQUESTS, Traffic

_NOT_SENT = OUTCOMES.index(Outcome.NOT_SENT)


@dataclass(frozen=True, slots=True)
class SimulationRun:
    report: dict[str, Any]
    result: SimResult
    timeline: Timeline | None


def run_simulation(traffic: Callable[[int | None], Traffic], engine: EngineSetup, timing: TimingSetup, *,
                   admission: Callable[[Sequence[str]], Admission | None], slo: Slo | None, context: dict[str, Any],
                   admission_info: dict[str, Any], time_bounded_closed_loop: bool = False,
                   retry: RetryPolicy = CLIENT_RETRY, rule: EngineRule = None,
                   capacity: dict[str, Any] | None = None) -> SimulationRun:
    """Simulate `traffic(n)` (n: requests to draw for a closed loop, None: the traffic's own bound)
    on the engine whose scheduler `rule` names (kvtune.sim.rules; None: vLLM); `admission(routes)`
    a fresh admission for requests whose routes are `routes` (one per request); `capacity` what
    the JSON says of where the pool came from (`simulation.capacity`)."""
    n: int | None = None
    while True:
        t = traffic(n)
        result = simulate(t.workload, engine.settings, timing.model, admission=admission(t.route), retry=retry,
                          record_steps=True, closed_loop=t.closed_loop, frontend=timing.frontend, engine=rule)
        used_all = not (result.requests.outcome == _NOT_SENT).any()
        if not (time_bounded_closed_loop and used_all and len(t) < MAX_REQUESTS):
            break
        n = 2 * len(t)
    simulation = {"timing": timing.to_dict(), "engine": engine.to_dict(),
                  **({} if capacity is None else {"capacity": capacity}), "admission": admission_info,
                  "rule": rule_name(rule),
                  "retry": {"max_retries": retry.max_retries, "max_wait_s": retry.max_wait_s}}
    # the unit the pool is counted in: vLLM's blocks, SGLang's tokens, TensorRT-LLM's blocks
    unit = engine.settings.block_size if rule is None else getattr(rule, "tokens_per_block", 1)
    report = sim_report(result, t, slo=slo, context=context, simulation=simulation, block_size=unit)
    line = None if result.steps is None else timeline(result.steps, usable_blocks=result.usable_blocks,
                                                      end_s=result.duration_s)
    return SimulationRun(report, result, line)


__all__ = ["SimulationRun", "run_simulation"]
