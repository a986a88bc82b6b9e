"""The door to `kvtune simulate`: the traffic on a deployment, in simulated time (kvtune.simulation)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtune.domain.deployment import Deployment, Measurement
from kvtune.domain.load_shape import Load
from kvtune.domain.log_reading import LogReplay
from kvtune.domain.simulated_server import SimulatedServer
from kvtune.domain.slo import Slo
from kvtune.profile.routes import Profile
from kvtune.simulation import Simulation, run_simulate


def simulate(
    workload: Profile | Callable[[], Profile] | LogReplay,
    deployment: Deployment,
    server: SimulatedServer | None = None,
    load: Load | None = None,
    slo: Slo | None = None,
    *,
    measured: Measurement | None = None,
    routes: Sequence[str] = (),
    on_note: Callable[[str], None] | None = None,
) -> Simulation:
    """Throughput, latency, preemptions and 429s of the traffic on a deployment: what `kvtune
    simulate` predicts (kvtune.sim: the engine's scheduler step by step, the gateway's own
    admission in front with `server.gateway`).

    `workload` is a profile (or a function reading one: called once the engine is set up), whose
    `routes` the requests are drawn from, or a LogReplay of logs sent at their own timestamps.
    The pool is `server.capacity_file`'s, else kvtune's estimate for the deployment's model on
    its GPU (vLLM's; another engine's is given: `measured` kv_tokens or num_gpu_blocks); the step
    time is the file's calibrated `timing`, else silicon data or the roofline for the model and
    GPU. Without a rate or concurrency in `load`, the logs' mean arrival rate; `on_note` hears
    what the run should tell (a load taken by default, files the replay left out).

    >>> sim = kvtune.simulate(profile, kvtune.Deployment("llama-3.1-8b", gpu="H100-80GB"),
    ...                       load=kvtune.Load(rate_rps=3, max_requests=200))   # doctest: +SKIP
    >>> sim.report["throughput"]["output_tokens_per_s"]                    # doctest: +SKIP
    412.7
    """
    return run_simulate(workload, deployment, server or SimulatedServer(), load or Load(), slo,
                        measured=measured, routes=routes, on_note=on_note)
