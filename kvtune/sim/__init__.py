"""A discrete-event simulation of vLLM V1's scheduler (or SGLang's, or TensorRT-LLM's), with the
gateway's admission in front.

Step times come from kvtune.domain.step_time.StepTimeModel (calibrated, or a roofline estimate).

    requests.py   what is served: SimRequest, Workload (columns), Outcome
    blocks.py     BlockPool: free blocks and the free-queue order prefix caching sees
    scheduler.py  EngineSettings, Scheduler: vLLM's schedule() / update_from_output, vectorized
    rules.py      which engine's rule: SGLangRule, TrtllmRule (CapacityPolicy), engine_rule(name)
    sglang.py     SGLangScheduler: PrefillAdder's new_token_ratio estimate, retract_decode
    trtllm.py     TrtllmScheduler: GUARANTEED_NO_EVICT / MAX_UTILIZATION capacity scheduling
    admission.py  the Admission hook: DirectAdmission, LedgerAdmission (the gateway's ledger)
    engine.py     simulate(): the event loop, jumping over runs of identical decode steps
    results.py    SimResult: per request, per step, totals
"""

from kvtune.domain.engine_settings import EngineSettings
from kvtune.sim.admission import Admission, DirectAdmission, LedgerAdmission, Verdict, VerdictKind, Wakeup
from kvtune.sim.engine import CLIENT_RETRY, ClosedLoop, simulate
from kvtune.sim.requests import Outcome, SimRequest, Workload
from kvtune.sim.results import Decision, RequestColumns, RequestResult, SimResult, StepSeries
from kvtune.sim.rules import ENGINE_NAMES, CapacityPolicy, SGLangRule, TrtllmRule, engine_rule

__all__ = [
    "simulate", "CLIENT_RETRY", "ClosedLoop", "EngineSettings", "SimRequest", "Workload", "Outcome",
    "Admission", "DirectAdmission", "LedgerAdmission", "Verdict", "VerdictKind", "Wakeup",
    "SimResult", "RequestColumns", "RequestResult", "StepSeries", "Decision",
    "SGLangRule", "TrtllmRule", "CapacityPolicy", "engine_rule", "ENGINE_NAMES",
]
